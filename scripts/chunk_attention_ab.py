"""Prompt-chunk attention: the engine's kernel against SDPA as the engine calls it, side by side in one run.

  python scripts/chunk_attention_ab.py [--dtype float32 bfloat16] [--prefill 1x128 8x128 1x1024]
                                       [--append 1024+64] [--holes 0.1] [--rounds 7] [--threads 1]
                                       [--before REV] [--model runs/smollm2] [--out FILE]

The kernel alone on SmolLM2-135M's shapes (30 layers, each its own cache of 3 KV heads of 64; 9
query heads): fresh prompts, ``SESSIONSxTOKENS`` (SDPA: one causal call over the step's block of
equal-length prompts, as the runner makes it), and turns appended to rows with a fraction
``--holes`` of their entries evicted, ``ENTRIES+TOKENS`` for 8 sessions (SDPA: the runner's masked
call per session). Each round runs the 30 layers with both in turn (the order alternating); the
JSON reports each one's median milliseconds, the kernel's speed-up and its GFLOP/s (the causal
products' multiply-adds, twice). ``--before REV`` adds the kernel as git revision REV had it
(compiled beside this one) as a third arm, and its time over ours. With ``--model``, whole
prefills of the ``--prefill`` shapes in one engine with the kernel in use and without (SDPA),
taking turns, both on the torch path's layers (``decode_layers.c``, which calls the kernel in
the engine's default, off).
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from compactrl.bench.harness import in_ms, interleaved, machine_info, medians, toggled_prefills
from compactrl.engine import Engine, EngineConfig
from compactrl.engine.chunk_attention import SOURCE, ChunkAttention, load_kernel
from compactrl.engine.runner import Feed, _session_attention
from compactrl.models.loading import load_model

LAYERS, HKV, G, D = 30, 3, 3, 64
APPEND_SESSIONS = 8


def kernel_before(rev: str):
    """The kernel as revision ``rev`` had it, compiled from that revision's source."""
    relative = SOURCE.relative_to(SOURCE.parents[2])
    text = subprocess.run(["git", "-C", str(SOURCE.parents[2]), "show", f"{rev}:{relative}"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / SOURCE.name
    path.write_text(text)
    lib = load_kernel(path)
    if isinstance(lib, str):
        raise SystemExit(f"the kernel of {rev} does not build: {lib}")
    return lib


def kernel_alone(sessions: int, first: int, tokens: int, holes: float, dtype, rounds: int,
                 before=None) -> dict:  # fmt: skip
    """``sessions`` chunks of ``tokens`` after ``first`` entries each (``first`` 0: fresh prompts);
    ``before``: an earlier revision's compiled kernel, a third arm."""
    gen = torch.Generator().manual_seed(0)
    end, N = first + tokens, sessions * tokens
    shape = (sessions, HKV, end, D)
    caches = [[torch.randn(shape, generator=gen).to(dtype) for _ in "kv"] for _ in range(LAYERS)]
    valid = torch.rand(sessions, end, generator=gen) >= holes
    valid[:, first:] = True  # the chunks' own tokens
    q = torch.randn(N, HKV * G, D, generator=gen).to(dtype)
    out = torch.empty_like(q)
    chunks = torch.tensor([[s * tokens, s, first, tokens] for s in range(sessions)])
    kernel = ChunkAttention("kernel", "cpu", dtype, G, D)
    earlier = ChunkAttention("kernel", "cpu", dtype, G, D)
    earlier.lib = before

    def run(k: ChunkAttention):
        def layers():
            for K, V in caches:
                k(q, K, V, valid, chunks, out)

        return layers

    qs = q.unflatten(0, (sessions, tokens)).transpose(1, 2)  # the runner's views of a block of prompts
    fresh = [[t[:, :, first:].transpose(1, 2).flatten(0, 1) for t in kv] for kv in caches]  # [N, Hkv, D]
    feeds = [Feed(None, [0] * tokens, first, first, s, [], False) for s in range(sessions)]
    kv = SimpleNamespace(k=[k for k, _ in caches], v=[v for _, v in caches], valid=valid)

    def sdpa():
        for li, (k, v) in enumerate(fresh):
            if first == 0:
                ks, vs = (t.unflatten(0, (sessions, tokens)).transpose(1, 2) for t in (k, v))
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                for f in feeds:
                    heads = q[f.row * tokens : (f.row + 1) * tokens].transpose(0, 1)[None]
                    _session_attention(heads, kv, li, f)

    arms = {"kernel": in_ms(run(kernel)), "sdpa": in_ms(sdpa)}
    if before:
        arms["before"] = in_ms(run(earlier))
    ms = medians(interleaved(arms, rounds, alternate=True))
    pairs = sum(first + t + 1 for t in range(tokens)) * sessions  # (query, key) pairs, holes included
    flop = LAYERS * 4 * HKV * G * D * pairs
    return {"sessions": sessions, "first": first, "tokens": tokens, "holes": holes if first else 0.0,
            "ms": ms, "speed_up": ms["sdpa"] / ms["kernel"], "kernel_gflop_per_s": flop / ms["kernel"] / 1e6,
            **({"speed_up_vs_before": ms["before"] / ms["kernel"]} if before else {})}  # fmt: skip


def prefills(model: str, sessions: int, tokens: int, rounds: int, dtype: str) -> dict:
    """Whole prefills in one engine, the kernel in use and not (SDPA), taking turns."""
    lm = load_model(model, dtype=dtype)
    eng = Engine(lm, None, EngineConfig(kv_pool_tokens=sessions * (tokens + 8), max_step_tokens=2048))
    kernel = eng.chunk_attention
    if kernel.kind != "kernel":
        raise SystemExit("the engine runs without the chunk attention kernel here")
    eng.decode_layers = None  # the torch path's layers in both arms (decode_layers_ab.py times the one call)

    def use(on: bool) -> None:
        eng.chunk_attention = kernel if on else None

    return toggled_prefills(eng, use, "kernel", "sdpa", sessions, tokens, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prefill", nargs="+", default=["1x128", "8x128", "1x1024"], help="SESSIONSxTOKENS")
    p.add_argument("--append", nargs="+", default=["1024+64"], help="ENTRIES+TOKENS, 8 sessions")
    p.add_argument("--holes", type=float, default=0.1, help="fraction of an appended-to row evicted")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", default=None, help="git revision whose kernel is a third arm")
    p.add_argument("--model", default=None, help="also time whole prefills of this model (runs/smollm2)")
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    shapes = [tuple(map(int, x.split("x"))) for x in a.prefill]
    appends = [tuple(map(int, x.split("+"))) for x in a.append]
    before = kernel_before(a.before) if a.before else None
    settings = [kernel_alone(n, 0, t, 0.0, dtype, a.rounds, before) for n, t in shapes]
    settings += [kernel_alone(APPEND_SESSIONS, e, t, a.holes, dtype, a.rounds, before) for e, t in appends]
    for s in settings:
        print(f"{s['sessions']} x {s['tokens']} after {s['first']}: ms {s['ms']} "
              f"speed-up {s['speed_up']:.2f}, {s['kernel_gflop_per_s']:.0f} GFLOP/s"
              + (f", {s['speed_up_vs_before']:.2f}x {a.before}'s" if before else ""))  # fmt: skip
    fills = [prefills(a.model, n, t, a.rounds, a.dtype) for n, t in shapes] if a.model else []
    for s in fills:
        print(f"prefill {s['sessions']}x{s['tokens']}: ms {s['ms']} speed-up {s['speed_up']:.2f}")
    result = {"machine": machine_info(a.threads), "dtype": a.dtype, "rounds": a.rounds, "before": a.before,
              "settings": settings, "model": a.model, "prefills": fills}  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
