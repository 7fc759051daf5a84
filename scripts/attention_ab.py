"""Decode attention alone: the engine's kernel against SDPA as the engine calls it, side by side in one run.

  python scripts/attention_ab.py [--batch 8 32] [--context 128 1024] [--dtype float32 bfloat16]
                                 [--holes 0.1] [--rounds 7] [--threads 1] [--before REV] [--out FILE]

SmolLM2-135M's shapes: 30 layers, each its own cache ``[batch, 3 KV heads, context, 64]`` with a
fraction ``--holes`` of the entries evicted, and one query token of 9 heads per session. Each round
runs the 30 layers with every contestant in turn (the order alternating); the JSON reports each
one's median milliseconds per step, its ratio to SDPA, and the K/V bytes the kernel reads per
second. ``--before REV`` adds the kernel's C source at that git revision, built with the same
flags, to measure a change to the kernel alone.
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from compactrl.bench.harness import in_ms, interleaved, machine_info, medians
from compactrl.engine.decode_attention import SOURCE, DecodeAttention, build
from compactrl.engine.runner import _attend_rows

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HKV, G, D = 30, 3, 3, 64


def setting(batch: int, context: int, dtype: torch.dtype, holes: float, kernels: dict, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    shape = (batch, HKV, context, D)
    caches = [[torch.randn(shape, generator=gen).to(dtype) for _ in "kv"] for _ in range(LAYERS)]
    valid = torch.rand(batch, context, generator=gen) >= holes
    valid[:, -1] = True  # each session's new token
    q = torch.randn(batch, HKV * G, D, generator=gen).to(dtype)
    rows, lens = torch.arange(batch), torch.full((batch,), context)
    mask = torch.zeros(batch, 1, 1, context, dtype=dtype).masked_fill_(~valid[:, None, None], float("-inf"))
    qd, out = q.view(batch, HKV, G, D), torch.empty_like(q)

    def sdpa():
        for K, V in caches:
            out.copy_(_attend_rows(qd, K, V, mask, 0, batch, 0, context).reshape(out.shape))

    def kernel(attn):
        def run():
            for K, V in caches:
                attn(q, K, V, valid, rows, lens, context, out)

        return run

    runs = {"sdpa": sdpa} | {name: kernel(a) for name, a in kernels.items()}
    results = {}

    def arm(name: str):
        timed = in_ms(runs[name])

        def run() -> float:
            t = timed()
            results[name] = out.double().clone()  # untimed
            return t

        return run

    ms = interleaved({name: arm(name) for name in runs}, rounds, alternate=True)  # a warm-up round first
    step = medians(ms)
    kv_bytes = 2 * LAYERS * HKV * D * dtype.itemsize * int(valid.sum())
    return {
        "batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."), "ms": step,
        "vs_sdpa": {name: step["sdpa"] / t for name, t in step.items() if name != "sdpa"},
        "kernel_kv_gb_per_s": kv_bytes / step["kernel"] / 1e6,
        "max_abs_diff_vs_sdpa": {n: float((o - results["sdpa"]).abs().max()) for n, o in results.items()},
        "rounds_ms": ms,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--holes", type=float, default=0.1, help="fraction of cache entries evicted")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", default=None, help="also the kernel's source at this git revision")
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"kernel": SOURCE}
        if a.before:
            old = Path(tmp) / "decode_attention.c"
            rel = SOURCE.relative_to(ROOT).as_posix()
            old.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{a.before}:{rel}"],
                                           capture_output=True, check=True).stdout)  # fmt: skip
            sources[f"kernel@{a.before}"] = old
        settings = []
        for dtype in (getattr(torch, d) for d in a.dtype):
            kernels = {}
            for name, src in sources.items():
                attn = DecodeAttention("kernel", "cpu", dtype, G, D)
                attn.lib = build(src)
                if isinstance(attn.lib, str):
                    raise SystemExit(attn.lib)
                kernels[name] = attn
            for b in a.batch:
                for c in a.context:
                    s = setting(b, c, dtype, a.holes, kernels, a.rounds)
                    settings.append(s)
                    print(f"{s['dtype']:8s} batch {b:3d} context {c:5d} ms {s['ms']} vs sdpa {s['vs_sdpa']}")
    result = {"machine": machine_info(a.threads), "holes": a.holes, "rounds": a.rounds, "before": a.before,
              "settings": settings}  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
