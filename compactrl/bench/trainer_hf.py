"""`compactrl bench trainer-hf`: our one-pass stream trainer against transformers + peft, same values.

The question is whether the trainer's own decoder and chunked eviction-mask attention is worth
having over the obvious alternative: a Hugging Face model with peft LoRA, fed the whole stream
with a dense 4-D eviction mask through SDPA. Both arms load the same checkpoint in float32, get
identical LoRA adapters (the same random, non-zero A and B: peft starts B at 0, where the
adapters do nothing and A gets no gradient), and train on the same real stream traces: forward,
``loss = -sum(log-probs of the policy tokens)``, backward into the adapters. The loss reads the
trained tokens only, so both arms run the head on the rows that predict them (ours as its trainer
does, ``stream_logprobs(..., wanted=trainable)``; transformers through ``logits_to_keep``); each
arm is also timed with the head over every row (``model(...).logits``, the usual way to write it).

Before anything is timed the arms must agree: per-token log-probs to ``TOLERANCE`` and the LoRA
gradients to float32 accuracy, and, as a negative control, the HF arm under a plain causal mask
must *not* agree (else the traces' evictions would not be exercised and the comparison would
say nothing about them).

With ``precision="bfloat16"`` both arms run forward and backward under bfloat16 autocast (the
way either is trained in bfloat16 on a CPU: float32 weights, bfloat16 GEMMs and attention), and
our float32 arm is timed beside them, so one run says whether bfloat16 pays on this CPU. The
float32 checks above still gate; bfloat16 has no exact answer, so each arm's log-probs and LoRA
gradients are compared with float32's, and ours must be no further from it than theirs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from compactrl.bench.harness import machine_info, markdown_table, medians, timed
from compactrl.models.config import load_config
from compactrl.models.loading import config_summary, load_model
from compactrl.models.lora import PROJECTIONS, LoraSettings, add_lora
from compactrl.rl.forward import Backend, stream_logprobs
from compactrl.trace import Trace, load_traces

DEFAULT_TRACES = Path("runs/bench_sidequest_replicate/a-sidequest-every2/traces.jsonl")
TOLERANCE = 5e-5  # max |log-prob difference| in float32 for the two arms to count as the same computation
Precision = Literal["float32", "bfloat16"]


def stream_traces(path: str | Path, n: int, vocab_size: int) -> list[Trace]:
    """The first ``n`` main traces that evict something. SideQuest's auxiliary-thread traces
    (``meta["aux"]``) are skipped: our trainer splices them into their main trace's stream, which
    a single HF forward per trace has no counterpart of, so only main traces are compared."""
    traces = [t for t in load_traces(path) if not t.meta.get("aux") and t.num_evicted][:n]
    if not traces:
        raise ValueError(f"{path} holds no main trace with evictions; pass --traces with stream-mode "
                         "traces of a compacting strategy (a run's traces.jsonl)")  # fmt: skip
    for t in traces:
        t.validate(vocab_size)
    return traces


def eviction_mask(evict_at: torch.Tensor) -> torch.Tensor:
    """``[1, 1, T, T]`` additive float mask, 0 where ``j <= i < evict_at[j]`` and -inf elsewhere.
    Built here from ``evict_at`` alone (not with compactrl.masks), so the HF arm does not share our
    mask code; transformers 5 hands a 4-D mask to SDPA as it is."""
    T = len(evict_at)
    i = torch.arange(T, device=evict_at.device)[:, None]
    j = torch.arange(T, device=evict_at.device)[None, :]
    seen = (j <= i) & (i < evict_at[None, :])
    return torch.zeros(T, T, device=evict_at.device).masked_fill(~seen, float("-inf"))[None, None]


def hf_logprobs(
    hf: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, trained: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[i] = log p(tokens[i] | what query i-1 saw)``, ``out[0] = 0``: stream_logprobs' convention.
    ``trained`` (bool ``[T]``): logits only on the rows that predict those tokens (0 elsewhere)."""
    T = len(tokens)
    pos = torch.arange(T, device=tokens.device)[None]
    at = torch.arange(1, T, device=tokens.device) if trained is None else trained[1:].nonzero()[:, 0] + 1
    keep = at - 1 if trained is not None else 0  # transformers: 0 keeps every row
    out = hf(input_ids=tokens[None], position_ids=pos, attention_mask=mask, use_cache=False,
             logits_to_keep=keep)  # fmt: skip
    logits = out.logits[0] if trained is not None else out.logits[0, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(1, tokens[at, None])[:, 0]
    return lp.new_zeros(T).index_put((at,), lp)


def lora_pair(model_dir: str | Path, r: int, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours and transformers' model of ``model_dir``, each with LoRA (r, alpha 2r, all seven
    projections, no dropout) holding the same seeded random weights; trainable: the adapters only."""
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    ours = load_model(model_dir, dtype="float32", device=device)
    add_lora(ours, LoraSettings(r=r, alpha=2 * r))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(PROJECTIONS))
    with warnings.catch_warnings():  # peft 0.21 reads an attribute transformers 5 deprecated; harmless
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        hf = get_peft_model(hf, config).to(device)
    theirs = {k.removeprefix("base_model.model."): p for k, p in hf.named_parameters() if p.requires_grad}
    mine = {k: p for k, p in ours.named_parameters() if p.requires_grad}
    if set(mine) != set(theirs):
        raise AssertionError(f"adapter names differ: {sorted(set(mine) ^ set(theirs))[:4]}")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in mine.items():  # A ~ 1/sqrt(fan-in); B small: the adapters shift outputs a few %
            scale = p.shape[1] ** -0.5 if ".lora_A." in name else 0.02 * r**-0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
            theirs[name].copy_(p)
    return ours.train(), hf.train()


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' gradients by our parameter names (peft's prefix dropped)."""
    return {k.removeprefix("base_model.model."): p.grad.detach().clone()
            for k, p in model.named_parameters() if p.requires_grad}  # fmt: skip


def grad_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """Worst adapter tensor's max |grad difference| over its own max |grad| (its scale)."""
    return max(float((g - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-30))
               for k, g in ours.items())  # fmt: skip


def grad_cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Cosine between two sets of adapter gradients, flattened: the direction a step would take."""
    x, y = (torch.cat([g[k].double().flatten() for k in sorted(a)]) for g in (a, b))
    return float(x @ y / (x.norm() * y.norm()).clamp_min(1e-300))


def run_trainer_hf_bench(
    model_dir: str | Path,
    traces_path: str | Path = DEFAULT_TRACES,
    *,
    lora_r: int = 16,
    n_traces: int = 8,
    repeats: int = 3,
    threads: int = 1,
    chunk: int = 256,
    device: str = "cpu",
    backend: Backend = "chunked",
    precision: Precision = "float32",
    progress: Callable[[int], Callable[[], None]] | None = None,
) -> dict:
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision {precision!r} is not one of float32, bfloat16")
    torch.set_num_threads(threads)
    # the traces are checked (and the vocabulary) before the models are loaded: bad input fails fast
    traces = stream_traces(traces_path, n_traces, load_config(Path(model_dir)).vocab_size)
    ours, hf = lora_pair(model_dir, lora_r, device)
    tokens = [torch.as_tensor(t.tokens, device=device) for t in traces]
    masks = [eviction_mask(torch.as_tensor(t.evict_at, device=device)) for t in traces]
    weights = [torch.as_tensor(t.trainable, device=device) for t in traces]
    bf16 = precision == "bfloat16"

    def step(arm: str, k: int, low: bool, every_row: bool = False) -> torch.Tensor:
        """Forward and backward of one arm on trace ``k``, under bfloat16 autocast if ``low``; the
        head on the trained tokens' rows, or on ``every_row``."""
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=low):
            if arm == "ours":
                wanted = None if every_row else [traces[k].trainable]
                lp = stream_logprobs(ours, [traces[k]], chunk=chunk, backend=backend, wanted=wanted)[0]
            else:
                lp = hf_logprobs(hf, tokens[k], masks[k], None if every_row else weights[k])
            (-(lp * weights[k]).sum()).backward()
        return lp.detach()

    def fresh(arm: str, k: int, low: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = ours if arm == "ours" else hf
        model.zero_grad(set_to_none=True)
        return step(arm, k, low), lora_grads(model)

    timed_arms = {"ours": ("ours", bf16, False), "hf": ("hf", bf16, False),
                  "ours_every_row": ("ours", bf16, True), "hf_every_row": ("hf", bf16, True)}  # fmt: skip
    if bf16:  # our float32 time beside them: does bfloat16 pay on this CPU?
        timed_arms["ours_float32"] = ("ours", False, False)
    advance = progress((repeats + 1) * len(traces)) if progress else (lambda: None)
    # Round 0, untimed, warms the arms up and yields the values compared: per trace, the float32
    # log-probs and adapter gradients of both arms, the HF arm under a causal mask, and in
    # bfloat16 each arm's distance from float32 (over the trained tokens).
    lp_diff, g_diff, causal_diff = 0.0, 0.0, float("inf")
    low = {arm: {"max": 0.0, "abs_sum": 0.0, "cosine": 1.0} for arm in ("ours", "hf")}
    for k in range(len(traces)):
        w = weights[k]
        (a, ga), (b, gb) = fresh("ours", k, False), fresh("hf", k, False)
        lp_diff = max(lp_diff, float((a - b)[w].abs().max()))
        g_diff = max(g_diff, grad_diff(ga, gb))
        with torch.no_grad():
            causal = hf_logprobs(hf, tokens[k], eviction_mask(torch.full_like(tokens[k], len(tokens[k]))))
        causal_diff = min(causal_diff, float((a - causal)[w].abs().max()))
        for arm, ref, ref_g in (("ours", a, ga), ("hf", b, gb)) if bf16 else ():
            lp, g = fresh(arm, k, True)
            d = (lp - ref)[w].abs()
            low[arm]["max"] = max(low[arm]["max"], float(d.max()))
            low[arm]["abs_sum"] += float(d.sum())
            low[arm]["cosine"] = min(low[arm]["cosine"], grad_cosine(g, ref_g))
        advance()
    # Then the arms take turns on every trace (A B, A B, ...), so machine drift hits both alike.
    runs: dict[str, list[float]] = {arm: [] for arm in timed_arms}
    for _ in range(repeats):
        total = dict.fromkeys(timed_arms, 0.0)
        for k in range(len(traces)):
            for arm, (model, low_arm, every) in timed_arms.items():
                net = ours if model == "ours" else hf
                total[arm] += timed(lambda k=k, m=model, x=low_arm, e=every: len(step(m, k, x, e)), net)[0]
            advance()
        for arm, s in total.items():
            runs[arm].append(s)
    med = medians(runs)
    n_tok = sum(len(t) for t in traces)
    n_trained = int(sum(t.trainable.sum() for t in traces))
    r = {
        "benchmark": "trainer_hf",
        "machine": machine_info(threads, device),
        "model": config_summary(ours.config) | {"source": str(model_dir)},
        "dtype": precision,
        "lora": {"r": lora_r, "alpha": 2 * lora_r, "targets": list(PROJECTIONS)},
        "traces": str(traces_path),
        "n_traces": len(traces),
        "tokens": n_tok,
        "trainable_tokens": n_trained,
        "evicted_tokens": sum(t.num_evicted for t in traces),
        "stream_backend": backend,
        "attention_chunk": chunk,
        "hf_attention": "sdpa, dense 4-D additive eviction mask",
        "repeats": repeats,
        "warmup": "one untimed round of both arms (the value checks), then the arms interleaved per trace",
        "ours_s": med["ours"],
        "hf_s": med["hf"],
        "ours_vs_hf": med["hf"] / med["ours"],
        "every_row": {"ours_s": med["ours_every_row"], "hf_s": med["hf_every_row"]},  # the head on all rows
        "ours_tokens_per_s": n_tok / med["ours"],
        "hf_tokens_per_s": n_tok / med["hf"],
        "max_abs_logprob_diff": lp_diff,  # float32, both arms
        "max_rel_lora_grad_diff": g_diff,
        "causal_mask_diff": causal_diff,  # the trace where a causal mask comes closest to ours
        "tolerance": TOLERANCE,
        "same_values": lp_diff <= TOLERANCE,
        "runs_s": runs,  # per repeat, the whole trace set: the spread behind the medians
    }
    if bf16:
        diff = {arm: {"max_abs_logprob_diff": v["max"], "mean_abs_logprob_diff": v["abs_sum"] / n_trained,
                      "min_lora_grad_cosine": v["cosine"]} for arm, v in low.items()}  # fmt: skip
        r["bfloat16_vs_float32"] = diff  # each arm against its own float32 values
        # ours no further from float32 than theirs, on average over the trained tokens
        r["no_less_exact"] = diff["ours"]["mean_abs_logprob_diff"] <= diff["hf"]["mean_abs_logprob_diff"]
        r["ours_float32_s"] = med["ours_float32"]
        r["bfloat16_speedup"] = med["ours_float32"] / med["ours"]  # ours: float32 time / bfloat16 time
    return r


def markdown(r: dict) -> str:
    """Our stream trainer against transformers + peft, with the checks; in bfloat16, with our
    float32 time beside it and each arm's distance from its float32 values."""
    lead = [r["n_traces"], f"{r['tokens']} ({r['evicted_tokens']})", r["trainable_tokens"]]
    if r["dtype"] == "bfloat16":
        d = r["bfloat16_vs_float32"]
        columns = ["traces", "tokens (evicted)", "trainable", "ours s", "transformers + peft s",
                   "time, ours / theirs", "ours float32 s", "time, bfloat16 / float32",
                   "mean \\|Δ log-prob\\| vs float32, ours / theirs", "max, ours / theirs",
                   "LoRA grad cosine, ours / theirs"]  # fmt: skip
        row = [*lead, f"{r['ours_s']:.1f}", f"{r['hf_s']:.1f}", f"{r['ours_s'] / r['hf_s']:.2f}",
               f"{r['ours_float32_s']:.1f}", f"{r['ours_s'] / r['ours_float32_s']:.2f}",
               *(" / ".join(f"{d[a][key]:{fmt}}" for a in ("ours", "hf"))
                 for key, fmt in (("mean_abs_logprob_diff", ".4f"), ("max_abs_logprob_diff", ".3f"),
                                  ("min_lora_grad_cosine", ".4f")))]  # fmt: skip
        return markdown_table(columns, [row])
    every = r["every_row"]
    columns = ["traces", "tokens (evicted)", "trainable", "ours s", "transformers + peft s",
               "time, ours / theirs", "head on every row: ours s", "theirs s",
               "max \\|Δ log-prob\\|", "max rel. LoRA grad diff", "causal-mask control"]  # fmt: skip
    row = [*lead, f"{r['ours_s']:.1f}", f"{r['hf_s']:.1f}", f"{r['ours_s'] / r['hf_s']:.2f}",
           f"{every['ours_s']:.1f}", f"{every['hf_s']:.1f}",
           f"{r['max_abs_logprob_diff']:.1e}", f"{r['max_rel_lora_grad_diff']:.1e}",
           f"{r['causal_mask_diff']:.1e}"]  # fmt: skip
    return markdown_table(columns, [row])
