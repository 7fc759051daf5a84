"""One-row linear layers alone (decode at batch 1): the engine's gemv kernel against torch's
product and oneDNN's, side by side in one run.

  python scripts/gemv_ab.py [--dtype float32 bfloat16] [--rounds 7] [--threads 1] [--out FILE]

SmolLM2-135M's shapes, as a decode step at batch 1 calls them: per layer the fused q/k/v (960 x
576), o (576 x 576), gate and up (1536 x 576 each), down (576 x 1536), 30 layers each with its own
random weights, and the tied head (49,152 x 576, in float32 for a bfloat16 model). Each round runs
every contestant over all of them in turn (the order alternating); the JSON reports each one's
median milliseconds, the weight bytes it reads per second, its speed-up over torch's product
(``F.linear``, what a single row ran before), and a summing pass's read bandwidth in the same run
(the floor: a product cannot read its weights faster).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from compactrl.bench.engine import read_bandwidth
from compactrl.bench.harness import machine_info
from compactrl.engine.linear import load_gemv

LAYERS, D, FF, VOCAB = 30, 576, 1536, 49152
SHAPES = [(960, D), (D, D), (FF, D), (FF, D), (D, FF)]


def setting(dtype: torch.dtype, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(s, generator=gen) * 0.05).to(dtype) for _ in range(LAYERS) for s in SHAPES]
    head = (torch.randn(VOCAB, D, generator=gen) * 0.05).to(dtype)
    xs = {n: torch.randn(1, n, generator=gen).to(dtype) for n in (D, FF)}
    lib = load_gemv()
    if isinstance(lib, str):
        raise SystemExit(lib)
    bf16, out = int(dtype == torch.bfloat16), torch.empty(VOCAB)

    def gemv():
        for w in [*ws, head]:
            x = xs[w.shape[1]].float()
            lib.gemv(x.data_ptr(), w.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], bf16, 1)

    head32 = head.float()  # a bfloat16 model's float32 head, converted once here (the engine's is blockwise)

    def torch_linear():
        for w in ws:
            F.linear(xs[w.shape[1]], w)
        F.linear(xs[D].float(), head32)

    runs = {"gemv": gemv, "torch": torch_linear}
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in [*ws, head]]

        def onednn():
            for w, p in zip([*ws, head], packed):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        runs["onednn"] = onednn
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(1 + rounds):  # round 0 warms up
        for name in list(runs) if r % 2 else list(runs)[::-1]:
            t = time.perf_counter()
            runs[name]()
            if r:
                ms[name].append((time.perf_counter() - t) * 1e3)
    step = {name: statistics.median(v) for name, v in ms.items()}
    nbytes = sum(w.numel() * w.element_size() for w in [*ws, head])
    check = ws[3]  # one layer's product against float64
    y = torch.empty(check.shape[0])
    x32 = xs[D].float()
    lib.gemv(x32.data_ptr(), check.data_ptr(), y.data_ptr(), *check.shape, bf16, 1)
    return {
        "dtype": str(dtype).removeprefix("torch."), "weight_bytes": nbytes, "ms": step,
        "gb_per_s": {name: nbytes / t / 1e6 for name, t in step.items()},
        "vs_torch": {name: step["torch"] / t for name, t in step.items() if name != "torch"},
        "max_abs_diff_vs_float64": float((y.double() - x32.double() @ check.double().T).abs().max()),
        "rounds_ms": ms,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    settings = []
    for dtype in a.dtype:
        s = setting(getattr(torch, dtype), a.rounds)
        settings.append(s)
        print(f"{dtype:8s} ms {s['ms']} GB/s {s['gb_per_s']} vs torch {s['vs_torch']}")
    result = {"machine": machine_info(a.threads), "rounds": a.rounds, "read_gb_per_s": read_bandwidth() / 1e9,
              "settings": settings}  # fmt: skip
    print(f"summing pass reads {result['read_gb_per_s']:.1f} GB/s")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
