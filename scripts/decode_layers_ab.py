"""Whole decode steps and prefills with all layers in one C call (``decode_layers.c``) and without
(the torch path around the same kernels), inside one engine, taking turns.

  python scripts/decode_layers_ab.py --model runs/smollm2 [--batch 1 8 32] [--context 128 1024]
                                     [--prefill 1x128 8x128 1x1024] [--dtype float32|bfloat16]
                                     [--rounds 7] [--threads 1] [--out FILE]

Decode: ``--batch`` sessions of ``--context`` prompt tokens, blocks of 4 steps; prefill: fresh
prompts ``SESSIONSxTOKENS`` (``--prefill``, none to skip), one timed ``run`` each; median
milliseconds of each arm and the speed-up. Toggling inside one engine keeps the cache, the process
and the minute the same for both arms, which runs in separate processes (``scripts/decode_ab.py``)
cannot.
"""

import argparse
import json
from pathlib import Path

import torch

from compactrl.bench.harness import decoding_engine, machine_info, toggled_prefills, toggled_steps
from compactrl.engine import Engine, EngineConfig
from compactrl.models.loading import load_model


def steps(model: str, batch: int, context: int, rounds: int, dtype: str) -> dict:
    eng = decoding_engine(model, batch, context, rounds, dtype=dtype)
    layers = eng.decode_layers
    if layers.why:
        raise SystemExit(f"the engine runs without decode_layers.c here: {layers.why}")

    def use(on: bool) -> None:
        eng.decode_layers = layers if on else None

    return {"batch": batch, "context": context, **toggled_steps(eng, use, "one_call", "torch", rounds)}


def prefills(model: str, sessions: int, tokens: int, rounds: int, dtype: str) -> dict:
    lm = load_model(model, dtype=dtype)
    eng = Engine(lm, None, EngineConfig(kv_pool_tokens=sessions * (tokens + 8), max_step_tokens=2048))
    layers = eng.decode_layers
    if layers.chunks is None:
        raise SystemExit("the engine prefills without decode_layers.c here (no chunk attention kernel)")

    def use(on: bool) -> None:
        eng.decode_layers = layers if on else None

    return toggled_prefills(eng, use, "one_call", "torch", sessions, tokens, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (runs/smollm2)")
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32], help="none: no decode steps")
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--prefill", nargs="*", default=["1x128", "8x128", "1x1024"], help="SESSIONSxTOKENS")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    whole = []
    for c in a.context:
        for b in a.batch:
            whole.append(steps(a.model, b, c, a.rounds, a.dtype))
            s = whole[-1]
            print(f"batch {b:3d} context {c:5d}: ms {s['ms_per_step']} speed-up {s['speed_up']:.2f}")
    fills = [prefills(a.model, *map(int, x.split("x")), a.rounds, a.dtype) for x in a.prefill]
    for s in fills:
        print(f"prefill {s['sessions']}x{s['tokens']}: ms {s['ms']} speed-up {s['speed_up']:.2f}")
    result = {
        "machine": machine_info(a.threads),
        "dtype": a.dtype,
        "rounds": a.rounds,
        "model": a.model,
        "steps": whole,
        "prefills": fills,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
