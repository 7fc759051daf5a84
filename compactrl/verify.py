"""`compactrl verify model` and `verify trainer`: our numbers against independent oracles.

`verify model`: our decoder against transformers on the same checkpoint folder.
transformers is the oracle here, never a runtime dependency. Two comparisons per model:
plain causal logits, and logits under an eviction mask (transformers given the same 4-D
bool mask and explicit ``position_ids``: its defaults are wrong after an eviction).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from compactrl.engine.sampling import SamplingParams
from compactrl.masks import dense_mask
from compactrl.models.config import FAMILIES as MODEL_FAMILIES
from compactrl.models.config import load_config
from compactrl.models.loading import config_summary, load_model, resolve_dtype
from compactrl.models.lora import load_thread_adapter
from compactrl.models.tiny import init_random, tiny_config, write_tiny_model
from compactrl.rl.forward import reprefill_logprobs, stream_logprobs
from compactrl.rl.reference import incremental_logprobs, random_eviction_stream

FAMILIES = tuple(MODEL_FAMILIES)


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError(
            "`verify model` compares against transformers, which is not installed: "
            "pip install 'compactrl[test]' (or pip install transformers)"
        ) from e
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def sample_evict_at(T: int, seed: int) -> torch.Tensor:
    """A schedule with a few mid-stream evictions (token 0, the 'system prompt', is kept)."""
    rng = np.random.default_rng(seed)
    ev = np.full(T, T)
    for e in sorted(rng.choice(np.arange(T // 4, T), size=3, replace=False)):
        a = int(rng.integers(1, e - 1))
        b = int(rng.integers(a + 1, min(e, a + T // 6) + 1))
        ev[a:b] = np.minimum(ev[a:b], e)
    return torch.as_tensor(ev)


@torch.no_grad()
def compare_with_transformers(model_dir: Path, dtype: str = "float32", T: int = 96, seed: int = 0) -> dict:
    transformers = _import_transformers()
    torch_dtype = resolve_dtype(dtype)
    cfg = load_config(model_dir)
    ours = load_model(model_dir, dtype=torch_dtype)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, attn_implementation="sdpa"
    ).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    pos = torch.arange(T)[None]
    mask = dense_mask(sample_evict_at(T, seed))
    causal = (ours(ids, pos) - theirs(input_ids=ids, position_ids=pos).logits).abs().max()
    evict = (
        ours(ids, pos, mask) - theirs(input_ids=ids, position_ids=pos, attention_mask=mask[None, None]).logits
    )
    return {
        "model": str(model_dir),
        **config_summary(cfg),
        "dtype": dtype,
        "tokens": T,
        "max_abs_logit_diff": float(causal),
        "max_abs_logit_diff_evict_mask": float(evict.abs().max()),
    }


def verify_model(
    model_dir: str | Path | None = None, dtype: str = "float32", tolerance: float | None = None
) -> dict:
    """Compare one folder, or freshly built tiny Llama, Qwen2 and Qwen3 checkpoints."""
    tolerance = tolerance if tolerance is not None else (1e-4 if dtype == "float32" else 5e-2)
    results = {}
    if model_dir is not None:
        r = compare_with_transformers(Path(model_dir), dtype)
        results[r["family"]] = r
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for fam in FAMILIES:
                folder = write_tiny_model(Path(tmp) / fam, family=fam)
                results[fam] = compare_with_transformers(folder, dtype) | {"model": f"tiny {fam} (generated)"}
    worst = max(max(r["max_abs_logit_diff"], r["max_abs_logit_diff_evict_mask"]) for r in results.values())
    return {
        "families": results,
        "tolerance": tolerance,
        "max_abs_logit_diff": worst,
        "ok": worst <= tolerance,
    }


def _grads(model, traces, backend: str) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lps = stream_logprobs(model, traces, backend=backend, chunk=48, max_row_tokens=4 * len(traces[0]))
    loss = sum((lp * torch.as_tensor(t.trainable, device=lp.device)).sum() for lp, t in zip(lps, traces))
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def verify_trainer(
    device: str = "cpu", dtype: str = "float32", n_streams: int = 8, length: int = 160, seed: int = 0
) -> dict:
    """The trainer forward (each attention backend) against a token-by-token evicting KV cache.

    Log-probs of every backend vs the incremental oracle; gradients of each backend vs the dense
    mask; and the negative controls (plain causal mask, re-prefill of the kept tokens), which
    must differ by nats, or the check would pass on a model that ignores its context.
    """
    torch_dtype = resolve_dtype(dtype)
    model = init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=seed)
    model = model.to(device=device, dtype=torch_dtype)
    traces = [random_eviction_stream(seed + k, T=length) for k in range(n_streams)]
    on_cpu = torch.device(device).type == "cpu"
    flex_ok = not (on_cpu and torch_dtype == torch.float64)  # CPU flex: no float64 kernel
    backends = ("chunked", "dense", "flex") if flex_ok else ("chunked", "dense")
    worst = dict.fromkeys(backends, 0.0)
    causal_diff = reprefill_diff = 0.0
    for t in traces:
        ref = incremental_logprobs(model, t).to(device)
        with torch.no_grad():
            for b in backends:
                lp = stream_logprobs(model, [t], backend=b, chunk=48)[0].double()
                worst[b] = max(worst[b], float((lp - ref)[1:].abs().max()))
            ids, pos = torch.as_tensor(t.tokens, device=device), torch.arange(len(t), device=device)
            causal = torch.log_softmax(model(ids, pos)[0].double(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
            fresh = reprefill_logprobs(model, t).to(device).double()
        after = torch.as_tensor(t.live_counts() <= np.arange(len(t)), device=device)[
            :-1
        ]  # query saw an eviction
        causal_diff = max(causal_diff, float((causal - ref[1:])[after].abs().max()))
        reprefill_diff = max(reprefill_diff, float((fresh - ref)[1:][after].abs().max()))
    dense = _grads(model, traces, "dense")
    grad_diff = {}
    for b in ("chunked",) if on_cpu else ("chunked", "flex"):  # flex has no CPU backward
        g = _grads(model, traces, b)
        grad_diff[b] = max(
            float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(g, dense)
        )
    tol, grad_tol = {torch.float64: (1e-9, 1e-9), torch.float32: (5e-5, 1e-3)}.get(torch_dtype, (0.15, 0.1))
    ok = max(worst.values()) <= tol and max(grad_diff.values()) <= grad_tol
    ok = ok and min(causal_diff, reprefill_diff) >= 0.1
    return {
        "device": str(device),
        "dtype": dtype,
        "streams": n_streams,
        "tokens_per_stream": length,
        "evictions": sum(len(t.eviction_events()) for t in traces),
        "max_abs_logprob_diff": {b: worst[b] for b in backends},
        "max_rel_grad_diff_vs_dense": grad_diff,
        "negative_control": {"causal_diff": causal_diff, "reprefill_diff": reprefill_diff},
        "tolerance": tol,
        "grad_tolerance": grad_tol,
        "ok": ok,
    }


def _random_rollouts(engine, n_sessions: int, seed: int, vocab: int) -> list:
    """Ragged multi-turn sessions with mid-stream evictions, evictions right before generation,
    and forks, all driven through one engine so their steps are batched together."""
    rng = np.random.default_rng(seed)
    sessions = [engine.session(f"v{k}") for k in range(n_sessions)]
    for s in sessions:
        s.append(rng.integers(0, vocab, int(rng.integers(8, 48))).tolist(), role="system")
    for turn in range(4):
        for k, s in enumerate(sessions):
            T = len(s.tokens)
            if turn and rng.random() < 0.8:  # a span in the middle (token 0 = system prompt is kept)
                a = int(rng.integers(1, T - 1))
                live = [j for j in range(a, min(T, a + int(rng.integers(1, 16)))) if s.evict_at[j] is None]
                s.evict(live)
            s.append(rng.integers(0, vocab, int(rng.integers(1, 12))).tolist())
            if rng.random() < 0.3:  # right before generation: the newest tokens go too
                s.evict([len(s.tokens) - 1])
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 12)), seed=seed * 1000 + 10 * k + turn, ignore_eos=True,
                top_k=int(rng.choice([0, 20])), model_logprobs=True,
            )  # fmt: skip
            s.generate(params)
        engine.run()
        if turn == 1:
            sessions += [s.fork(f"{s.id}.fork") for s in sessions[:: max(1, n_sessions // 4)]]
    return sessions


# bfloat16 / float16 models: the engine batches, fuses and orders its sums differently from the
# trainer, and every bfloat16 activation rounds to ~3 significant digits, so the two forwards agree
# only up to that rounding, which grows with depth. The gate is on the mean KL per sampled token
# (max |logprob diff| is reported; a few tokens near a rounding boundary dominate it): 1e-2 nats
# is ~6x what SmolLM2-135M (30 layers) measures and ~500x the tiny model (docs/benchmarks.md, "Engine vs
# trainer"), while a wrong mask or stale K/V moves log-probs by nats (the re-prefill control).
ENGINE_TOLERANCE = 5e-5  # float32 and float64 (the engine samples from float32 logits either way)
ENGINE_KL_TOLERANCE_LOW_PRECISION = 1e-2


def _record_distributions(engine) -> dict:
    """Capture the engine's log-softmax at every sampled position: ``{session: {position: [V]}}``.
    A fork inherits what its parent recorded (its stream holds the parent's sampled tokens)."""
    dists: dict = {}
    sample, fork = engine._sample, engine.fork

    def recording_sample(ready):
        for s in ready:
            dists.setdefault(s, {})[len(s.tokens)] = s.pending_logits.float().log_softmax(-1).cpu()
        sample(ready)

    def recording_fork(parent, rollout_id):
        child = fork(parent, rollout_id)
        dists[child] = dict(dists.get(parent, {}))
        return child

    engine._sample, engine.fork = recording_sample, recording_fork
    return dists


def verify_engine(
    n_sessions: int = 32,
    seed: int = 0,
    pool_tokens: int | None = None,
    model_dir: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    matmul: str = "auto",
) -> dict:
    """Every log-prob the engine logged vs the trainer's one-pass forward over the exported traces.

    The engine runs randomised sessions (ragged, batched, forked, several evictions each) with a
    KV pool small enough to force preemptions unless ``pool_tokens`` says otherwise, on a tiny
    random model or ``model_dir``, in ``dtype`` on ``device``. Beside the max |logprob diff| of the
    sampled tokens it reports the KL between the engine's and the trainer's full next-token
    distributions at every sampled position (mean and max). Float32/float64 are gated on the max
    |logprob diff| (``ENGINE_TOLERANCE``), bfloat16/float16 on the mean KL
    (``ENGINE_KL_TOLERANCE_LOW_PRECISION``). The negative control re-prefills the same streams after
    each eviction and must differ by >= 0.1 nats. ``matmul``: the engine's ``EngineConfig.matmul``.
    """
    from compactrl.engine import Engine, EngineConfig

    torch_dtype = resolve_dtype(dtype)
    if model_dir is not None:
        model = load_model(model_dir, dtype=torch_dtype, device=device)
    else:
        model = init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=seed)
        model = model.to(device=device, dtype=torch_dtype)
    vocab = model.config.vocab_size
    pool = pool_tokens or 40 * n_sessions
    # no idle grace: which session the small pool preempts depends on the steps, not on the machine's speed
    config = EngineConfig(kv_pool_tokens=pool, max_step_tokens=256, matmul=matmul, idle_grace_s=0)
    engine = Engine(model, None, config)
    dists = _record_distributions(engine)
    sessions = _random_rollouts(engine, n_sessions, seed, vocab=vocab)
    traces = [s.trace() for s in sessions]
    worst = neg = 0.0
    kls, diffs = [], []
    with torch.no_grad():
        ours = stream_logprobs(model, traces)
        everything = torch.arange(vocab, device=model.lm_head.weight.device)
        for s, t, lp in zip(sessions, traces, ours, strict=True):
            m = torch.as_tensor(t.trainable)
            logged = torch.tensor(s.model_logprobs, dtype=torch.float64)[m]
            d = (lp.double().cpu()[m] - logged).abs()
            diffs.append(d)
            worst = max(worst, float(d.max()))
            neg = max(neg, float((reprefill_logprobs(model, t).double().cpu()[m] - logged).abs().max()))
            at = sorted(dists.get(s, {}))
            if at:  # the trainer's full distribution where the engine sampled (candidates = every id)
                cand = torch.zeros(len(t), vocab, dtype=torch.long, device=everything.device)
                cand[at] = everything
                (full,) = stream_logprobs(model, [t], candidates=[cand])
                # renormalised in float64: a float32 log-softmax over a large vocabulary sums to
                # 1 +- 1e-6, which would otherwise enter the KL at first order
                trainer = full[at].double().cpu().log_softmax(-1)
                engine_lp = torch.stack([dists[s][i] for i in at]).double().log_softmax(-1)
                kls.append((engine_lp.exp() * (engine_lp - trainer)).sum(-1))
    kl = torch.cat(kls) if kls else torch.zeros(1, dtype=torch.float64)
    metrics = engine.metrics()
    low = torch_dtype in (torch.bfloat16, torch.float16)
    tol = ENGINE_TOLERANCE
    close = float(kl.mean()) <= ENGINE_KL_TOLERANCE_LOW_PRECISION if low else worst <= tol
    return {
        "model": str(model_dir) if model_dir is not None else "tiny qwen3 (random)",
        "dtype": dtype,
        "device": str(device),
        "matmul": engine.linears.kind,
        "one_call_steps": engine.decode_layers.calls,  # decode steps whose layers ran in decode_layers.c
        "sessions": len(sessions),
        "forks": len(sessions) - n_sessions,
        "tokens": sum(len(t) for t in traces),
        "sampled_tokens": int(sum(t.trainable.sum() for t in traces)),
        "evictions": sum(len(t.eviction_events()) for t in traces),
        "preemptions": metrics["preemptions"],
        "kv_pool_tokens": pool,
        "max_abs_logprob_diff": worst,
        "mean_abs_logprob_diff": float(torch.cat(diffs).mean()) if diffs else 0.0,
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "kl_positions": int(kl.numel()) if kls else 0,
        "reprefill_diff": neg,
        "tolerance": None if low else tol,
        "kl_tolerance": ENGINE_KL_TOLERANCE_LOW_PRECISION if low else None,
        "ok": close and neg >= 0.1,
    }


def verify_run(run_dir: str | Path, model_dir: str | Path | None = None, tolerance: float = 5e-5) -> dict:
    """Every logged log-prob of a rollout run's traces vs the trainer's one-pass forward.

    Stream traces are checked under their eviction masks, re-prefill segments as the fresh
    sessions they were. Sampling log-probs equal the model's only without tempering or
    truncation, so the run must have sampled at temperature 1 (or greedily) with top-p 1, top-k 0.
    """
    import pydantic

    from compactrl.trace import load_traces

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: point at the run directory `compactrl rollout` wrote")
    from compactrl.agent.batch import RolloutConfig

    try:
        cfg = RolloutConfig.model_validate_json(cfg_path.read_text())
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ValueError(
            f"{cfg_path} is no rollout run's config ({where}: {first['msg']}); "
            "point at the run directory `compactrl rollout` wrote"
        ) from e
    traces = load_traces(run_dir / "traces.jsonl")
    if not traces:  # as `trace show` says of it
        raise ValueError(f"{run_dir / 'traces.jsonl'} holds no traces")
    r = cfg.rollout
    if r.temperature not in (0.0, 1.0) or r.top_p < 1 or r.top_k > 0:
        raise ValueError(
            "the run sampled with temperature/top-p/top-k truncation, so its log-probs are not the model's; "
            "verify runs made with temperature 1 (or 0), top_p 1 and top_k 0"
        )
    folder = Path(model_dir) if model_dir else Path(cfg.model.path or run_dir / "model")
    model = load_model(folder, dtype=cfg.model.dtype)
    if thread_adapter := getattr(cfg.strategy, "thread_adapter", None):  # on the forks' own tokens
        load_thread_adapter(model, thread_adapter)
    worst, sampled, evicted = 0.0, 0, 0
    with torch.no_grad():
        for t in traces:
            (lp,) = stream_logprobs(model, [t.validate(model.config.vocab_size)])
            m = t.trainable
            if m.any():
                worst = max(worst, float(np.abs(lp.double().numpy()[m] - t.logprobs[m]).max()))
            sampled += int(m.sum())
            evicted += t.num_evicted
    return {
        "run_dir": str(run_dir),
        "mode": cfg.mode,
        "traces": len(traces),
        "sampled_tokens": sampled,
        "evicted_tokens": evicted,
        "max_abs_logprob_diff": worst,
        "tolerance": tolerance,
        "ok": worst <= tolerance,
    }
