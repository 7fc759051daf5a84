"""`compactrl bench trainer`: one-pass stream training vs re-prefill training, side by side.

For each compaction schedule, the same synthetic rollout is trained on (forward + backward of
the summed log-probs of its policy tokens) two ways, interleaved in one run:

(a) stream: one forward over the whole rollout under the eviction mask;
(b) re-prefill: one sample per segment (kept tokens fed again), batched causal forwards,
    which is what frameworks that compact by re-prefilling train on.

The cost model says (b) processes ``N + N*r/(B-r)`` tokens for (a)'s ``N`` when every
compaction keeps ``r`` of a budget ``B`` (the live context at which compactions fire,
``budget_realised``: the budget, or less when turns do not tile it). A finite rollout
compacts only once the budget is first full, so its schedule realises
``N + (N-B)*r/(B-r)``: exactly when the turns tile the budget (sliding window, Markovian),
up to a partial segment otherwise (summary).
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from compactrl.bench.cost import extra_prefill
from compactrl.bench.harness import interleaved, machine_info, markdown_table, medians, timed
from compactrl.bench.synthetic import (
    STRATEGIES,
    Strategy,
    check_shape,
    kept_per_compaction,
    synthetic_rollout,
)
from compactrl.models.decoder import CausalLM, token_logprobs
from compactrl.models.loading import config_summary, load_model
from compactrl.models.tiny import write_tiny_model
from compactrl.rl.forward import Backend, Segment, reprefill_segments, stream_logprobs
from compactrl.trace import Trace


def stream_step(model: CausalLM, trace: Trace, chunk: int, backend: Backend = "chunked") -> int:
    lp = stream_logprobs(model, [trace], chunk=chunk, backend=backend)[0]
    (-(lp * torch.as_tensor(trace.trainable, device=lp.device)).sum()).backward()
    return len(trace)


def reprefill_step(model: CausalLM, trace: Trace, max_batch_tokens: int) -> int:
    """Train on the per-segment samples, batching equal-length samples into causal forwards."""
    by_len: dict[int, list[Segment]] = defaultdict(list)
    for seg in reprefill_segments(trace):
        by_len[len(seg.tokens)].append(seg)
    device = next(model.parameters()).device
    trainable = torch.as_tensor(trace.trainable, device=device)
    fed = 0
    for length, segs in by_len.items():
        per_batch = max(1, max_batch_tokens // length)
        for b in range(0, len(segs), per_batch):
            batch = segs[b : b + per_batch]
            ids = torch.as_tensor(np.stack([s.tokens for s in batch]), device=device)
            hidden = model.hidden_states(ids, torch.arange(length, device=device).expand(len(batch), -1))
            hs, ts, ws = [], [], []
            for row, s in enumerate(batch):
                first = max(s.num_kept, 1)
                hs.append(hidden[row, first - 1 : -1])
                ts.append(ids[row, first:])
                ws.append(trainable[s.stream_index[first:]])
            lp = token_logprobs(model, torch.cat(hs), torch.cat(ts))
            (-(lp * torch.cat(ws)).sum()).backward()
            fed += ids.numel()
    return fed


def bench_strategy(
    model: CausalLM,
    strategy: Strategy,
    n_tokens: int,
    *,
    budget: int,
    turn_len: int,
    repeats: int,
    chunk: int,
    max_batch_tokens: int,
    backend: Backend = "chunked",
    advance: Callable[[], None] = lambda: None,
) -> dict:
    vocab = model.config.vocab_size
    shape = dict(budget=budget, turn_len=turn_len, vocab_size=vocab)
    trace = synthetic_rollout(strategy, n_tokens, **shape)
    trace2 = synthetic_rollout(strategy, 2 * n_tokens, **shape)
    kept = kept_per_compaction(trace)
    runs = {
        "stream": lambda: stream_step(model, trace, chunk, backend),
        "reprefill": lambda: reprefill_step(model, trace, max_batch_tokens),
        "stream_2n": lambda: stream_step(model, trace2, chunk, backend),
    }
    # a warm-up round (flex compiles: each arm has shapes of its own), then the arms take turns
    arms = {k: lambda fn=fn: timed(fn, model) for k, fn in runs.items()}
    done = interleaved(arms, repeats, advance=advance)
    times = {k: [t for t, _ in v] for k, v in done.items()}
    tokens = {k: v[-1][1] for k, v in done.items()}
    med = medians(times)
    # B is the live context at which compactions actually fire (<= the budget when turns don't tile it)
    N, B = n_tokens, int(trace.live_counts().max())
    r = statistics.mean(kept) if kept else 0.0
    cost_model = 1 + extra_prefill(N, B, r) / N
    return {
        "strategy": strategy,
        "compactions": len(kept),
        "budget_realised": B,
        "kept_per_compaction": r,
        "stream_tokens": tokens["stream"],
        "reprefill_tokens": tokens["reprefill"],
        "token_ratio": tokens["reprefill"] / tokens["stream"],
        "token_ratio_cost_model": cost_model,
        "token_ratio_predicted": 1 + r * (N - B) / ((B - r) * N),
        "stream_s": med["stream"],
        "reprefill_s": med["reprefill"],
        "time_ratio": med["reprefill"] / med["stream"],
        "stream_2n_s": med["stream_2n"],
        "scaling": med["stream_2n"] / med["stream"],
        "runs_s": dict(times),  # every timed run per arm, in order: the spread behind the medians
    }


def check_params(
    strategies: tuple[str, ...], n_tokens: int, budget: int, turn_len: int, threads: int, repeats: int,
    device: str, dtype: str, backend: str,
) -> None:  # fmt: skip
    """Raise ValueError (naming the CLI's flags) on a shape that would not compact, or an
    attention backend, device or dtype the trainer cannot run."""
    for name, v in (("tokens", n_tokens), ("budget", budget), ("turn-len", turn_len), ("threads", threads)):
        if v <= 0:
            raise ValueError(f"--{name} must be positive, got {v}")
    if n_tokens < 2 * budget:
        raise ValueError(
            f"--tokens ({n_tokens}) must be at least 2 x --budget ({budget}) so that compactions happen"
        )
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if backend not in ("chunked", "flex", "dense"):
        raise ValueError(f"--backend {backend!r} is not one of chunked, flex, dense")
    if backend == "flex" and not device.startswith("cuda"):
        raise ValueError("--backend flex needs --device cuda: flex attention has no backward on CPU")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device (is this a CPU build of torch?)")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype {dtype!r} is not one of float32, bfloat16")
    try:
        for s in strategies:
            check_shape(s, budget, turn_len)
    except ValueError as e:
        raise ValueError(f"{e} (--strategy / --budget / --turn-len)") from None


def run_trainer_bench(
    model_dir: str | Path | None = None,
    *,
    strategies: tuple[Strategy, ...] = STRATEGIES,
    n_tokens: int = 4096,
    budget: int = 1024,
    turn_len: int = 128,
    size: str = "base",
    threads: int = 2,
    repeats: int = 2,
    chunk: int = 256,
    max_batch_tokens: int = 8192,
    device: str = "cpu",
    dtype: str = "float32",
    backend: Backend = "chunked",
    progress: Callable[[int], Callable[[], None]] | None = None,
) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_dir or write_tiny_model(Path(tmp) / "model", family="qwen3", size=size)
        model = load_model(folder, dtype=dtype, device=device).train()
    advance = progress(len(strategies) * 3 * (1 + repeats)) if progress else (lambda: None)
    rows = [
        bench_strategy(
            model,
            s,
            n_tokens,
            budget=budget,
            turn_len=turn_len,
            repeats=repeats,
            chunk=chunk,
            max_batch_tokens=max_batch_tokens,
            backend=backend,
            advance=advance,
        )
        for s in strategies
    ]
    return {
        "benchmark": "trainer",
        "machine": machine_info(threads, device),
        "model": config_summary(model.config)
        | {"source": str(model_dir) if model_dir else f"tiny qwen3 {size}"},
        "dtype": dtype,
        "stream_backend": backend,
        "n_tokens": n_tokens,
        "budget": budget,
        "turn_len": turn_len,
        "attention_chunk": chunk,
        "repeats": repeats,
        "warmup": "one untimed run of each arm, then the arms interleaved in each repeat",
        "strategies": rows,
    }


COLUMNS = ["strategy", "compactions", "r kept", "tokens (b)/(a)", "predicted (N→∞)", "time (b)/(a)",
           "time ratio / token ratio", "stream t(2N)/t(N)"]  # fmt: skip


def table(result: dict) -> list[list[str]]:
    """Re-prefill (b) against the one-pass stream (a), per strategy, under ``COLUMNS``."""
    rows = []
    for r in result["strategies"]:
        predicted = f"{r['token_ratio_predicted']:.2f} ({r['token_ratio_cost_model']:.2f})"
        rows.append([r["strategy"], str(r["compactions"]), f"{r['kept_per_compaction']:.0f}",
                     f"{r['token_ratio']:.2f}", predicted, f"{r['time_ratio']:.2f}",
                     f"{r['time_ratio'] / r['token_ratio']:.2f}", f"{r['scaling']:.2f}"])  # fmt: skip
    return rows


def markdown(result: dict) -> str:
    return markdown_table(COLUMNS, table(result))
