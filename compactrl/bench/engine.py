"""`compactrl bench engine`: decode throughput of our engine vs transformers `generate` (and vLLM).

Every setting (batch x context) runs each engine on the same checkpoint, the same random
prompts and the same number of new tokens, in the same process run, in one dtype on one device.
Prefill and decode are timed apart: ours prefills (``run`` with nothing to generate), then times
the generation of N tokens (N sampling steps and N forwards, the last token being fed eagerly);
transformers is timed from its first generated token to its last through a streamer (N - 1
forwards). On CUDA every clock reading is preceded by a device synchronisation. After a
warm-up round, ours and transformers take turns for ``repeats`` rounds, and as many again after
vLLM has run (in its own process): their best rounds bracket vLLM's, so a slow phase of a shared
machine during one engine's window does not decide a ratio.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from compactrl.bench.harness import machine_info, markdown_table
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.engine.chunk_attention import ChunkAttention
from compactrl.engine.decode_attention import DecodeAttention
from compactrl.engine.decode_layers import unsupported
from compactrl.engine.linear import Linears
from compactrl.models.loading import config_summary, load_model, resolve_dtype
from compactrl.models.tiny import write_tiny_model


def _prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, (batch, context)).tolist()  # ids 0-2 are the tiny tokenizer's specials


def _clock(device: torch.device) -> float:
    """``perf_counter`` after the device has finished what was queued (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _ours(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for ``new_tokens`` per prompt), all prompts batched."""
    ctx = len(prompts[0])
    pool = len(prompts) * (ctx + new_tokens + 8)
    device = next(model.parameters()).device
    eng = Engine(model, None, EngineConfig(kv_pool_tokens=pool, max_step_tokens=max(2048, ctx)))
    eng.kv.preallocate(len(prompts), ctx + new_tokens)  # vLLM's timing excludes its KV allocation too
    sessions = [eng.session() for _ in prompts]
    t0 = _clock(device)
    for s, p in zip(sessions, prompts, strict=True):
        s.append(p)
    eng.run()
    t1 = _clock(device)
    for k, s in enumerate(sessions):
        s.generate(SamplingParams(max_tokens=new_tokens, seed=k, ignore_eos=True))
    eng.run()
    return t1 - t0, _clock(device) - t1


class _Clock:
    """A transformers streamer that only notes when each batch of new tokens arrives."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(_clock(self.device))

    def end(self) -> None:
        self.times.append(_clock(self.device))


def _hf(hf_model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    device = hf_model.device
    ids = torch.tensor(prompts, device=device)
    clock = _Clock(device)
    t0 = _clock(device)
    with torch.no_grad():
        hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            top_k=0,
            pad_token_id=0,
            streamer=clock,
        )
    # put() #0 is the prompt, #1 the first generated token (after prefill), the last is end()
    return clock.times[1] - t0, (clock.times[-1] - clock.times[1]) * new_tokens / (new_tokens - 1)


def _round_times(runs, prompts, new_tokens: int, rounds: int) -> list[list[tuple[float, float]]]:
    """``rounds`` rounds in which the engines take turns (so a slow phase of a shared machine hits
    them alike): per round, per engine, (prefill seconds, decode seconds)."""
    return [[run(prompts, new_tokens) for run in runs] for _ in range(rounds)]


def _best_rates(times, prompts, new_tokens: int) -> list[tuple[float, float]]:
    """Per engine (decode tokens/s, prefill tokens/s) of its best round: the protocol
    ``vllm_baseline.py`` gives vLLM."""
    B, C = len(prompts), len(prompts[0])
    out = []
    for e in range(len(times[0])):
        prefill, decode = (min(t[e][i] for t in times) for i in (0, 1))
        out.append((B * new_tokens / decode, B * C / prefill))
    return out


def read_bandwidth(gib: float = 0.5, repeats: int = 5) -> float:
    """Bytes per second one summing pass reads from memory on this CPU (best of ``repeats``): at
    decode batch sizes a step must read every weight once, so ``weight bytes / this`` is its floor."""
    a = torch.ones(int(gib * 2**30) // 4)
    best = min(_timed(a.sum) for _ in range(repeats))
    return a.numel() * 4 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def gemms_alone(model, lin: Linears, rows: int, repeats: int = 5) -> float:
    """Seconds of one decode step's linear layers and head alone, on ``rows`` tokens, back to back,
    through the engine's kernels (``lin``, prepared as the engine prepares its own; median of
    ``repeats``): what no fusion of the rest of the step removes."""
    c, dtype = model.config, next(model.parameters()).dtype
    x = torch.randn(rows, c.hidden_size, dtype=dtype)
    h = torch.randn(rows, c.intermediate_size, dtype=dtype)

    def step():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for group, inp in (((a.q_proj, a.k_proj, a.v_proj), x), ((a.o_proj,), x),
                               ((m.gate_proj, m.up_proj), x), ((m.down_proj,), h)):  # fmt: skip
                if lin.stacks(*group, x=inp):
                    lin.stacked(inp, *group)
                else:
                    for proj in group:
                        lin.linear(proj, inp)
        lin.logits(model, x)

    step()
    return float(np.median([_timed(step) for _ in range(repeats)]))


def evict_span(eng: Engine, s, start: int, span: int) -> tuple[float, bool]:
    """Evict stream tokens ``[start, start + span)`` and do what the engine's next step does before
    it feeds anything: clear their valid bits and, once the row's holes pass the compaction
    threshold (``EngineConfig.compact_holes``), compact the row (``KVBook.claim``, here claiming no
    entries). Returns (seconds, whether the row was compacted)."""
    device = eng.kv.device
    t0 = _clock(device)
    s.evict([(start, start + span)])
    eng.book.apply_drops(s)
    eng.book.claim(s, 0)
    return _clock(device) - t0, eng.kv.dead[s.row] == 0


def eviction_cost(model, context: int, sessions: int = 3) -> dict:
    """Time to evict in place vs one decode step, without and with the row compaction.

    Evicting only clears valid bits; the copy that moves the live entries over the holes is lazy,
    done when a row's holes pass a share of it. Each of ``sessions`` fresh sessions of ``context``
    tokens evicts spans of 1/80 of it (one decode step after each) until an eviction triggers the
    compaction: the evictions before it give ``evict_s``, the one that compacts ``evict_compact_s``
    (None when the context is too short to reach the threshold)."""
    device = next(model.parameters()).device
    eng = Engine(model, None, EngineConfig(kv_pool_tokens=2 * context + 256))
    span = max(1, context // 80)
    plain, compacting, step_s, moved = [], [], [], []
    for _ in range(sessions):
        s = eng.session()
        s.append(_prompts(1, context, model.config.vocab_size, 0)[0])
        eng.run()
        for r, a in enumerate(range(1, context - span + 1, span)):
            t, compacted = evict_span(eng, s, a, span)
            if compacted:
                compacting.append(t)
                moved.append(eng.kv.used[s.row])
                break
            plain.append(t)
            s.generate(SamplingParams(max_tokens=1, seed=r, ignore_eos=True))
            t0 = _clock(device)
            eng.step()  # one decode step: sample a token, feed it
            step_s.append(_clock(device) - t0)
        s.close()
    ev, st = float(np.median(plain)), float(np.median(step_s))
    evc = float(np.median(compacting)) if compacting else None
    return {
        "context": context,
        "evicted_per_call": span,
        "evict_s": ev,
        "decode_step_s": st,
        "evict_over_decode_step": ev / st,
        "compactions": len(compacting),
        "compacted_live_entries": int(np.median(moved)) if moved else None,
        "evict_compact_s": evc,
        "evict_compact_over_decode_step": None if evc is None else evc / st,
    }


def _vllm(
    vllm_python: str,
    model_dir: Path,
    batch: int,
    context: int,
    new_tokens: int,
    threads: int,
    dtype: str,
    repeats: int,
    kv_bytes_per_token: int,
) -> dict | None:
    script = Path(__file__).with_name("vllm_baseline.py")
    # vLLM's KV cache sized to hold the whole batch with room (as ours is): an undersized one
    # preempts and recomputes, which measures the cache size instead of the engine
    kv_gib = math.ceil(1.5 * batch * (context + new_tokens) * kv_bytes_per_token / 2**30)
    cmd = [vllm_python, str(script), "decode", "--model", str(model_dir), "--batch", str(batch)]
    cmd += ["--context", str(context), "--new-tokens", str(new_tokens), "--threads", str(threads)]
    cmd += ["--dtype", dtype, "--repeats", str(repeats), "--kv-gib", str(kv_gib)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ})
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-2000:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_engine_bench(
    model_dir: str | Path | None = None,
    *,
    batches: tuple[int, ...] = (1, 8, 32),
    contexts: tuple[int, ...] = (128, 2048),
    new_tokens: int = 64,
    size: str = "small",
    threads: int = 1,
    repeats: int = 3,
    dtype: str = "float32",
    device: str = "cpu",
    vllm_python: str | None = None,
    progress=None,
) -> dict:
    """Ours vs transformers (vs vLLM) per batch x context, in ``dtype`` on ``device``. vLLM runs
    in its own virtualenv (``vllm_python``), given the same dtype; on CUDA only when asked."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    torch_dtype = resolve_dtype(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = (
            Path(model_dir) if model_dir else write_tiny_model(Path(tmp) / "model", family="qwen3", size=size)
        )
        ours = load_model(folder, dtype=torch_dtype, device=device)
        lin = Linears(ours)  # the engine's GEMMs, prepared once, for the GEMMs-alone timings
        lin.prepare(ours)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, attn_implementation="sdpa"
        ).to(device)
        hf.eval()
        advance = progress(len(batches) * len(contexts)) if progress else (lambda: None)
        c = ours.config
        kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * torch_dtype.itemsize
        rows = []
        for context in contexts:
            for batch in batches:
                prompts = _prompts(batch, context, ours.config.vocab_size, seed=batch * 7 + context)
                runs = [lambda p, n: _ours(ours, p, n), lambda p, n: _hf(hf, p, n)]
                times = _round_times(runs, prompts, new_tokens, 1 + repeats)[1:]  # after a warm-up round
                v = None
                if vllm_python:  # ours and transformers again after it: the best rounds bracket vLLM's
                    args = (batch, context, new_tokens, threads, dtype, repeats, kv_bytes)
                    v = _vllm(vllm_python, folder, *args)
                    times += _round_times(runs, prompts, new_tokens, repeats)
                (r_ours, p_ours), (r_hf, p_hf) = _best_rates(times, prompts, new_tokens)
                row = {
                    "batch": batch,
                    "context": context,
                    "new_tokens": new_tokens,
                    "gemms_alone_s": gemms_alone(ours, lin, batch) if device == "cpu" else None,
                    "decode_tokens_per_s": r_ours,
                    "transformers_decode_tokens_per_s": r_hf,
                    "ratio_vs_transformers": r_ours / r_hf,
                    "prefill_tokens_per_s": p_ours,
                    "transformers_prefill_tokens_per_s": p_hf,
                }
                if v is not None and not v["decode_only_tokens_per_s"]:  # t(N) <= t(1): noise won
                    sys.stderr.write(f"vLLM's decode at batch {batch}, context {context}: not measurable\n")
                    v = None
                if v is not None:
                    # vLLM's decode-only rate: t(N) - t(1) on prompts already cached, prefill excluded
                    row["vllm_decode_tokens_per_s"] = v["decode_only_tokens_per_s"]
                    row["vllm_prefill_tokens_per_s"] = v["prefill_tokens_per_s"]
                    row["vllm_cached_prompt_tokens_decode"] = v["cached_prompt_tokens_decode"]
                    row["ratio_vs_vllm"] = r_ours / v["decode_only_tokens_per_s"]
                rows.append(row)
                advance()
        evictions = [eviction_cost(ours, c) for c in contexts]
        summary = config_summary(ours.config) | {
            "source": str(model_dir) if model_dir else f"tiny qwen3 {size}",
            "weight_bytes": sum(p.numel() * p.element_size() for p in ours.parameters()),
        }
    return {
        "benchmark": "engine",
        "machine": machine_info(threads, device),
        "read_bytes_per_s": read_bandwidth() if device == "cpu" else None,
        "model": summary,
        "dtype": dtype,
        "device": device,
        "threads": threads,
        "matmul": lin.kind,
        "attention": DecodeAttention.of(ours).kind,
        "chunk_attention": ChunkAttention.of(ours).kind,
        "decode_layers": unsupported(ours, lin, DecodeAttention.of(ours)) or "one call per decode step",
        "transformers": transformers.__version__,
        "settings": rows,
        "eviction": evictions,
    }


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    """Tokens/s of ours and the ratios to transformers (and vLLM where it ran), per setting: what
    the CLI prints and the documentation renders."""
    settings = result["settings"]
    others = ["transformers", *(["vllm"] * all("vllm_decode_tokens_per_s" in s for s in settings))]
    names = {"transformers": "transformers", "vllm": "vLLM"}
    columns = ["batch", "context", "decode: ours tok/s", *(f"/ {names[o]}" for o in others),
               "prefill: ours tok/s", *(f"/ {names[o]}" for o in others)]  # fmt: skip
    rows = []
    for s in settings:
        dec, pre = s["decode_tokens_per_s"], s["prefill_tokens_per_s"]
        rows.append([str(s["batch"]), str(s["context"]), f"{dec:.1f}",
                     *(f"{dec / s[f'{o}_decode_tokens_per_s']:.2f}" for o in others), f"{pre:.0f}",
                     *(f"{pre / s[f'{o}_prefill_tokens_per_s']:.2f}" for o in others)])  # fmt: skip
    return columns, rows


def floor_table(result: dict) -> tuple[list[str], list[list[str]]]:
    """One decode step (a token for each of ``batch`` sessions) of ours and of vLLM against the
    step's GEMMs alone and against reading the weights once at the measured memory bandwidth:
    where the GEMMs alone take most of vLLM's step, no saving elsewhere makes ours much faster."""
    read_s = result["model"]["weight_bytes"] / result["read_bytes_per_s"]
    columns = ["batch", "context", "ours ms", "vLLM ms", "GEMMs alone ms", "weights read once ms",
               "GEMMs alone / vLLM step", "ours / vLLM step"]  # fmt: skip
    rows = []
    for s in result["settings"]:
        ours, vllm = (s["batch"] / s[k] * 1e3 for k in ("decode_tokens_per_s", "vllm_decode_tokens_per_s"))
        g = s["gemms_alone_s"] * 1e3
        rows.append([str(s["batch"]), str(s["context"]), f"{ours:.1f}", f"{vllm:.1f}", f"{g:.1f}",
                     f"{read_s * 1e3:.1f}", f"{g / vllm:.2f}", f"{ours / vllm:.2f}"])  # fmt: skip
    return columns, rows


def has_floor(result: dict) -> bool:
    """Whether the floor table applies: vLLM ran at every setting and the GEMMs were timed (CPU)."""
    return bool(result.get("read_bytes_per_s")) and all(
        "vllm_decode_tokens_per_s" in s and s.get("gemms_alone_s") for s in result["settings"]
    )


def markdown(result: dict) -> str:
    return markdown_table(*table(result))


def floor_markdown(result: dict) -> str:
    return markdown_table(*floor_table(result))
