"""Whole decode steps with all layers in one C call (``decode_layers.c``) and without (the torch
path around the same kernels), inside one engine, blocks of 4 steps taking turns.

  python scripts/decode_layers_ab.py --model runs/smollm2 [--batch 1 8 32] [--context 128 1024]
                                     [--dtype float32|bfloat16] [--rounds 7] [--threads 1] [--out FILE]

``--batch`` sessions of ``--context`` prompt tokens; median milliseconds per step of each arm and
the speed-up. Toggling inside one engine keeps the cache, the process and the minute the same for
both arms, which runs in separate processes (``scripts/decode_ab.py``) cannot.
"""

import argparse
import json
from pathlib import Path

import torch

from compactrl.bench.harness import decoding_engine, machine_info, toggled_steps


def steps(model: str, batch: int, context: int, rounds: int, dtype: str) -> dict:
    eng = decoding_engine(model, batch, context, rounds, dtype=dtype)
    layers = eng.decode_layers
    if layers.why:
        raise SystemExit(f"the engine runs without decode_layers.c here: {layers.why}")

    def use(on: bool) -> None:
        eng.decode_layers = layers if on else None

    return {"batch": batch, "context": context, **toggled_steps(eng, use, "one_call", "torch", rounds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (runs/smollm2)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024])
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
    result = {
        "machine": machine_info(a.threads),
        "dtype": a.dtype,
        "rounds": a.rounds,
        "model": a.model,
        "steps": whole,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
