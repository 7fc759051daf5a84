"""The engine's products of 2+ rows: ``panel_gemm.c`` (float32) or ``panel_gemm_bf16.c`` (bfloat16,
on a CPU with AVX512-BF16) against oneDNN, side by side in one run.

  python scripts/panel_gemm_ab.py [--dtype float32|bfloat16] [--rows 2 4 8 16 32 64 128 1024 2048]
                                  [--rounds 7] [--threads 1]
                                  [--model runs/smollm2 [--batch 8 32] [--context 128]
                                   [--prefill 1x128 8x128 1x1024]] [--out FILE]

SmolLM2-135M's products as a step calls them at ``rows`` tokens: per layer the stacked q/k/v
(960 x 576), o (576 x 576), stacked gate and up (3,072 x 576) and down (576 x 1,536), 30 layers
each with its own random weights, and the head (49,152 x 576) up to 256 rows: a decode
step runs the head on every row, a prefill step (the larger row counts) on its sessions' last
tokens only. Each round runs both over all of them (the order alternating); the JSON reports each
one's median milliseconds, the weight bytes it reads per second and its GFLOP/s, the speed-up over
oneDNN (what the engine ran before), a summing pass's read bandwidth and the core's FMA peak
(``fma_peak.c``: float32, no memory traffic) in the same run, and the kernel's largest error on
one layer against float64, relative to the size of the products' terms. In bfloat16 both sides
multiply bfloat16 weights and inputs, oneDNN with the CPU's bfloat16 dot products as vLLM runs
it, and the head too (the engine's head, float32 products of the bfloat16 weights, is what the
kernel computes; before it, the engine ran the head in float32 on a float32 copy).

With ``--model``, whole steps in one engine with the kernel in use and without it (oneDNN, as
before), taking turns: decode steps of ``--batch`` sessions of ``--context`` prompt tokens
(blocks of 4 steps; the torch path, ``decode_layers.c`` off, which would call the kernel either
way), and prefills of ``SESSIONSxTOKENS`` fresh prompts (``--prefill``, one timed ``run`` each);
median milliseconds. In bfloat16 the kernel arm also runs one row (batch 1) by ``gemv.c``. The
same prefills again with the kernel's SwiGLU epilogue (gate and up in, SiLU(gate) * up out)
against gate and up written out and activated by torch (``swiglu_prefills``). Prefills run the
torch path around the products in both arms (``decode_layers.c`` would take them either way).
"""

import argparse
import ctypes
import json
from pathlib import Path

import torch

from compactrl.bench.engine import read_bandwidth
from compactrl.bench.harness import (
    decoding_engine,
    in_ms,
    interleaved,
    machine_info,
    medians,
    toggled_prefills,
    toggled_steps,
)
from compactrl.engine import Engine, EngineConfig
from compactrl.engine.kernels import compile_c
from compactrl.engine.linear import Linears, load_panel_gemm, load_panel_gemm_bf16, panels
from compactrl.models.loading import load_model
from compactrl.models.tiny import init_random, tiny_config

LAYERS, D, FF, VOCAB = 30, 576, 1536, 49152
SHAPES = [(960, D), (D, D), (2 * FF, D), (D, FF)]
HEAD_ROWS = 256  # decode batch sizes: a prefill step runs the head on its last tokens only


def products(rows: int, rounds: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(rows)
    ws = [(torch.randn(s, generator=gen) * 0.05).to(dtype) for _ in range(LAYERS) for s in SHAPES]
    if rows <= HEAD_ROWS:
        ws.append((torch.randn(VOCAB, D, generator=gen) * 0.05).to(dtype))
    xs = {n: torch.randn(rows, n, generator=gen).to(dtype) for n in (D, FF)}
    lin = Linears(init_random(tiny_config("llama", vocab_size=300, size="tiny"), seed=0).to(dtype), "auto")
    width = lin._width(dtype, D)
    if not width:
        why = (load_panel_gemm_bf16 if dtype == torch.bfloat16 else load_panel_gemm)()
        raise SystemExit(f"no panel kernel runs {dtype} here: {why}")
    packs = [panels(w, width) for w in ws]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]

    def panel_gemm():
        for w, p in zip(ws, packs):
            lin.on_panels(xs[w.shape[1]], p, w.shape[0], None, dtype)

    def onednn():
        for w, r in zip(ws, reordered):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], r, None, "none", [], "")

    ms = interleaved({"panel_gemm": in_ms(panel_gemm), "onednn": in_ms(onednn)}, rounds, alternate=True)
    step = medians(ms)
    nbytes, n = sum(w.numel() * w.element_size() for w in ws), sum(w.numel() for w in ws)
    w, x = ws[3].double(), xs[FF].double()  # one down projection's float32 sums against float64
    err = (lin.on_panels(xs[FF], packs[3], D, None).double() - x @ w.T).abs() / (x.abs() @ w.abs().T)
    return {"rows": rows, "head": rows <= HEAD_ROWS, "weight_bytes": nbytes, "ms": step,
            "gb_per_s": {name: nbytes / t / 1e6 for name, t in step.items()},
            "gflop_per_s": {name: 2 * rows * n / t / 1e6 for name, t in step.items()},
            "speed_up": step["onednn"] / step["panel_gemm"],
            "max_rel_err_vs_float64": float(err.max()), "rounds_ms": ms}  # fmt: skip


def fma_peak(kind: str = "fma", steps: int = 50_000_000, repeats: int = 3) -> float | None:
    """GFLOP/s of ``fma_peak.c``'s independent chains on one core (best of ``repeats``): float32 FMAs
    (``fma``), or bfloat16 dot products (``dot``; None on a CPU without them)."""
    chains, per_step = (
        ("fma_chains", "fma_flops_per_step") if kind == "fma" else ("dpbf16_chains", "dot_flops_per_step")
    )
    signatures = {chains: ([ctypes.c_int64], ctypes.c_float), per_step: ([], ctypes.c_int)}
    lib = compile_c(Path(__file__).with_name("fma_peak.c"), signatures)
    if isinstance(lib, str):
        raise SystemExit(lib)
    if not getattr(lib, per_step)():
        return None
    best_ms = min(in_ms(lambda: getattr(lib, chains)(steps))() for _ in range(repeats))
    return steps * getattr(lib, per_step)() / best_ms / 1e6


def toggle(eng):
    """``use(on)``: the engine's products of 2+ rows by its panel kernel (on) or oneDNN (off); in
    bfloat16 one row by gemv.c (on) or oneDNN (off) too."""
    lin = eng.linears
    names = ["panel_gemm"] if lin.panel_gemm is not None else ["panel_gemm_bf16", "gemv"]
    kernels = {name: getattr(lin, name) for name in names}
    if None in kernels.values():
        raise SystemExit(f"the engine runs without {names} here")

    def use(on: bool) -> None:
        for name, kernel in kernels.items():
            setattr(lin, name, kernel if on else None)

    return use


def steps(model: str, batch: int, context: int, rounds: int, dtype: torch.dtype) -> dict:
    eng = decoding_engine(model, batch, context, rounds, dtype=dtype)
    eng.decode_layers = None  # the torch path around the kernel: what the arms differ in, and only that
    ab = toggled_steps(eng, toggle(eng), "panel_gemm", "onednn", rounds)
    return {"batch": batch, "context": context, **ab}


def prefills(model: str, sessions: int, tokens: int, rounds: int, dtype: torch.dtype, swiglu: bool) -> dict:
    """Median ms to prefill ``sessions`` fresh prompts of ``tokens`` in one engine, each arm in turn:
    the panel kernel against oneDNN, or (``swiglu``) its SiLU(gate) * up epilogue against gate and
    up written out and activated apart."""
    lm = load_model(model, dtype=dtype)
    eng = Engine(lm, None, EngineConfig(kv_pool_tokens=sessions * (tokens + 8), max_step_tokens=2048))
    eng.decode_layers = None  # the torch path in both arms (decode_layers.c calls the kernel either way)
    if not swiglu:
        return toggled_prefills(eng, toggle(eng), "panel_gemm", "onednn", sessions, tokens, rounds)
    lin = eng.linears

    def fused(on: bool) -> None:
        if on:
            lin.__dict__.pop("fuses_swiglu", None)
        else:
            lin.fuses_swiglu = lambda *a: False

    return toggled_prefills(eng, fused, "swiglu", "apart", sessions, tokens, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 1024, 2048])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="also time whole decode steps of this model (runs/smollm2)")
    p.add_argument("--batch", type=int, nargs="*", default=[8, 32], help="sessions decoding (none: no steps)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per session, for the steps")
    p.add_argument("--prefill", nargs="+", default=["1x128", "8x128", "1x1024"], help="SESSIONSxTOKENS")
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    settings = [products(r, a.rounds, dtype) for r in a.rows]
    for s in settings:
        print(f"{s['rows']:3d} rows: ms {s['ms']} speed-up {s['speed_up']:.2f}")
    whole = [steps(a.model, b, a.context, a.rounds, dtype) for b in a.batch] if a.model else []
    for s in whole:
        print(f"steps, batch {s['batch']:3d}: ms {s['ms_per_step']} speed-up {s['speed_up']:.2f}")
    shapes = [tuple(map(int, x.split("x"))) for x in a.prefill] if a.model else []
    fills = [prefills(a.model, n, t, a.rounds, dtype, False) for n, t in shapes]
    swiglu = [prefills(a.model, n, t, a.rounds, dtype, True) for n, t in shapes]
    for s in fills + swiglu:
        print(f"prefill {s['sessions']}x{s['tokens']}: ms {s['ms']} speed-up {s['speed_up']:.2f}")
    result = {"machine": machine_info(a.threads), "dtype": a.dtype, "rounds": a.rounds,
              "read_gb_per_s": read_bandwidth() / 1e9, "fma_peak_gflop_per_s": fma_peak(),
              "dot_peak_gflop_per_s": fma_peak("dot"),
              "settings": settings, "model": a.model, "steps": whole, "prefills": fills,
              "swiglu_prefills": swiglu}  # fmt: skip
    read, peak = result["read_gb_per_s"], result["fma_peak_gflop_per_s"]
    print(f"summing pass reads {read:.1f} GB/s; FMA peak {peak:.1f} GFLOP/s")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
