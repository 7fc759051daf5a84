"""A run resumed from a checkpoint continues exactly as if it had never stopped."""

import copy

import numpy as np
import pytest
import torch
from test_trainer import engine_traces

from compactrl.rl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from compactrl.rl.critic import ValueHead
from compactrl.rl.trainer import Sample, Trainer, TrainSettings


def batch(traces, step):
    rng = np.random.default_rng(step)  # the data of step N depends only on N
    return [Sample(t, rng.normal(size=len(t)).astype(np.float32), i) for i, t in enumerate(traces)]


def test_resume_reproduces_the_uninterrupted_run(tiny_lm, tmp_path):
    traces = engine_traces(tiny_lm, n=3, seed=1)
    settings = TrainSettings(lr=1e-3)
    straight = copy.deepcopy(tiny_lm)
    t = Trainer(straight, settings)
    head = ValueHead(tiny_lm.config.hidden_size)
    for step in range(4):
        t.step(batch(traces, step))
        if step == 1:
            save_checkpoint(tmp_path, 2, straight, t.optimizer, {"data_position": 2}, {"value_head": head})
            after_save = torch.rand(3)  # what the RNG gives next, which a resumed run must give too
    final = [p.detach().clone() for p in straight.parameters()]

    resumed = copy.deepcopy(tiny_lm)  # a fresh process: initial weights, new optimizer
    t2 = Trainer(resumed, settings)
    head2 = ValueHead(tiny_lm.config.hidden_size)
    ckpt = latest_checkpoint(tmp_path)
    state = load_checkpoint(ckpt, resumed, t2.optimizer, {"value_head": head2})
    assert state == {"step": 2, "state": {"data_position": 2}}
    assert torch.equal(torch.rand(3), after_save)
    for step in range(2, 4):
        t2.step(batch(traces, step))
    for a, b in zip(final, resumed.parameters()):
        assert torch.equal(a, b)
    without = copy.deepcopy(tiny_lm)  # negative control: a fresh optimizer state is another run
    load_checkpoint(ckpt, without, Trainer(without, settings).optimizer)
    t3 = Trainer(without, settings)
    for step in range(2, 4):
        t3.step(batch(traces, step))
    assert any(not torch.equal(a, b) for a, b in zip(final, without.parameters()))


def test_checkpoints_rotate_and_bad_paths_are_named(tiny_lm, tmp_path):
    t = Trainer(copy.deepcopy(tiny_lm), TrainSettings())
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, t.model, t.optimizer, {}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(tmp_path, t.model, t.optimizer)
