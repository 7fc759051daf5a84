"""One-row linear layers (decode at batch 1) and sampling alone: the engine's C kernels against
what ran before them, side by side in one run.

  python scripts/gemv_sampling_ab.py [--dtype float32 bfloat16] [--batch 1 8 32] [--rounds 7]
                                     [--threads 1] [--model runs/smollm2 [--context 128]] [--out FILE]

SmolLM2-135M's shapes, as a decode step at batch 1 calls them: per layer the fused q/k/v (960 x
576), o (576 x 576), gate and up (1536 x 576 each), down (576 x 1536), 30 layers each with its own
random weights, and the tied head (49,152 x 576, in float32 for a bfloat16 model). Each round runs
every contestant over all of them in turn (the order alternating); the JSON reports each one's
median milliseconds, the weight bytes it reads per second, its speed-up over torch's product
(``F.linear``, what a single row ran before), and a summing pass's read bandwidth in the same run
(the floor: a product cannot read its weights faster).

Sampling: ``--batch`` rows of SmolLM2's 49,152 logits (float32, scale 3), temperature 1, a seed
per row, model log-probs asked, through ``Sampler`` with ``sampling.c`` and with the torch path;
median milliseconds per call and whether both drew the same tokens.

Whole decode steps (with ``--model``): ``--batch`` sessions of ``--context`` prompt tokens in one
engine, decoding in blocks of 4 steps with both kernels in use and with both off (torch's
product and the torch sampling path, as before them), the blocks taking turns; median
milliseconds per step; the torch path around them (``decode_layers.c`` off, which would call gemv.c
either way). Toggling inside one engine keeps the cache, the process and the minute the
same for both, which whole runs in separate processes (``scripts/decode_ab.py``) cannot.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from compactrl.bench.engine import read_bandwidth
from compactrl.bench.harness import decoding_engine, in_ms, interleaved, machine_info, medians, toggled_steps
from compactrl.engine.linear import load_gemv
from compactrl.engine.sampling import Sampler, SamplingParams, make_generator

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
    ms = interleaved({name: in_ms(fn) for name, fn in runs.items()}, rounds, alternate=True)
    step = medians(ms)
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


def sampling(batch: int, rounds: int) -> dict:
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
    params = [SamplingParams(model_logprobs=True)] * batch
    samplers = {"kernel": Sampler(), "torch": Sampler(kernel=False)}
    if samplers["kernel"].kernel is None:
        raise SystemExit("sampling.c does not build here")
    tokens = {}

    def arm(name: str):
        def run() -> float:
            gens = [make_generator(b) for b in range(batch)]  # fresh, untimed: the same draws every run
            t = time.perf_counter()
            tokens[name] = samplers[name].sample(logits, params, gens).tokens
            return (time.perf_counter() - t) * 1e3

        return run

    ms = interleaved({name: arm(name) for name in samplers}, rounds, alternate=True)
    step = medians(ms)
    return {"batch": batch, "vocab": VOCAB, "ms": step, "kernel_speed_up": step["torch"] / step["kernel"],
            "same_tokens": bool(torch.equal(tokens["kernel"], tokens["torch"])), "rounds_ms": ms}  # fmt: skip


def steps(model: str, batch: int, context: int, rounds: int) -> dict:
    eng = decoding_engine(model, batch, context, rounds)
    eng.decode_layers = None  # the torch path around the kernels: what the arms differ in, and only that
    gemv, sample_rows = eng.linears.gemv, eng.sampler.kernel
    if gemv is None or sample_rows is None:
        raise SystemExit("the engine runs without gemv.c or sampling.c here")

    def use(on: bool) -> None:
        eng.linears.gemv, eng.sampler.kernel = (gemv, sample_rows) if on else (None, None)

    return {"batch": batch, "context": context, **toggled_steps(eng, use, "kernels", "torch", rounds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="rows sampled at once")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="also time whole decode steps of this model (runs/smollm2)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per session for the steps")
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    settings = []
    for dtype in a.dtype:
        s = setting(getattr(torch, dtype), a.rounds)
        settings.append(s)
        print(f"{dtype:8s} ms {s['ms']} GB/s {s['gb_per_s']} vs torch {s['vs_torch']}")
    rows = [sampling(b, a.rounds) for b in a.batch]
    for s in rows:
        print(f"sampling {s['batch']:3d} rows: ms {s['ms']} same tokens {s['same_tokens']}")
    whole = [steps(a.model, b, a.context, a.rounds) for b in a.batch] if a.model else []
    for s in whole:
        print(f"steps, batch {s['batch']:3d}: ms {s['ms_per_step']} speed-up {s['speed_up']:.2f}")
    result = {"machine": machine_info(a.threads), "rounds": a.rounds, "read_gb_per_s": read_bandwidth() / 1e9,
              "settings": settings, "sampling": rows, "model": a.model, "steps": whole}  # fmt: skip
    print(f"summing pass reads {result['read_gb_per_s']:.1f} GB/s")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
