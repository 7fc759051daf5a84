"""Sampling ahead (max_lag > 0): weights handed to the engine in flight, stale batches dropped,
and the quickstart still learns."""

import copy
import json
import threading
import time

import pytest
import torch

from compactrl.agent.chat import ChatFormat
from compactrl.compaction import build_strategy
from compactrl.config import load_config
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.rl.loop import TrainConfig, train
from compactrl.rl.sampler import BackgroundSampler


def test_staged_weights_load_between_steps_and_sessions_keep_their_kv(tiny_lm):
    model = copy.deepcopy(tiny_lm)
    eng = Engine(model, None, EngineConfig(kv_pool_tokens=4096))
    s = eng.session("a")
    s.append(list(range(3, 40)))
    gen = s.generate(SamplingParams(max_tokens=12, seed=0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    prefilled = s.metrics.prefill_tokens
    new = {n: p.detach() + 0.05 for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="unknown tensors"):
        eng.stage_weights({"nope": torch.zeros(1)}, 1)
    t = threading.Thread(target=eng.stage_weights, args=(new, 7))  # handed over from another thread
    t.start()
    t.join()
    assert eng.weights_version == 0 and not torch.equal(model.model.norm.weight, new["model.norm.weight"])
    eng.run([gen])
    assert eng.weights_version == 7 and torch.equal(model.model.norm.weight, new["model.norm.weight"])
    assert s.metrics.prefill_tokens == prefilled and len(gen.tokens) == 12  # no re-prefill, no flush


ASYNC = ["checkpoint_every=4", "max_lag=1"]


class Crash(Exception):
    pass


def test_sampling_ahead_learns_with_bounded_lag_and_resumes(tmp_path):
    # at the quickstart's high learning rate one update moves the policy far, so PPO's clip would
    # zero most stale tokens; widened here, the importance ratio alone corrects the lag
    # (the quickstart's 40 steps: under load its rise, usually near step 10, came after step 24)
    wide = ["steps=40", "train.clip_low=0.99", "train.clip_high=100"]
    cfg = load_config(TrainConfig, "configs/quickstart.toml", [f"out={tmp_path / 'a'}", *ASYNC, *wide])
    rows = []
    train(cfg, on_step=rows.append)
    assert all(r["lag"] <= 1 and r["errors"] == 0 for r in rows)
    assert any(r["lag"] == 1 for r in rows)  # batches were sampled while the trainer trained
    assert all(r["mismatch_kl"] < 1e-6 for r in rows if r["lag"] == 0)  # the pushed weights arrived exactly
    assert max(r["mismatch_kl"] for r in rows if r["lag"] == 1) > 1e-4  # stale rollouts show it
    # thread timing (which weights sample which token, which batches are dropped) varies the pace
    assert max(r["reward"] for r in rows[-10:]) > rows[0]["reward"] + 0.2
    assert all(r["sync_s"] > 0 for r in rows)  # weights were handed over after every step

    crashing = load_config(
        TrainConfig, "configs/quickstart.toml", [f"out={tmp_path / 'b'}", *ASYNC, "steps=6"]
    )

    def crash(m):
        if m["step"] == 5:
            raise Crash

    with pytest.raises(Crash):
        train(crashing, on_step=crash)
    train(crashing, resume=True)  # from the step-4 checkpoint, its data position, a fresh sampler
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 7))
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["state"]["data_position"] >= 6


def test_batches_older_than_the_lag_bound_are_dropped(tmp_path, tiny_lm):
    cfg = load_config(TrainConfig, "configs/quickstart.toml", [f"out={tmp_path}", *ASYNC])
    from compactrl.agent.batch import load_engine

    engine = load_engine(cfg.model, cfg.engine, tmp_path)
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    sampler = BackgroundSampler(cfg, engine.model, engine.tokenizer, fmt, build_strategy(cfg.strategy), 1)
    try:
        while sampler.ready.qsize() < 1:
            time.sleep(0.01)
        sampler.push(engine.model)
        sampler.push(engine.model)  # two updates since batch 1 began: it is out of the bound
        batch, dropped = sampler.get()
        assert dropped >= 1 and batch.index == 1 + dropped
        assert sampler.pushed - batch.version <= cfg.max_lag
    finally:
        sampler.close()
