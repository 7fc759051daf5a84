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


def test_the_cuda_rng_state_is_saved_and_restored(tiny_lm, tmp_path, monkeypatch):
    """On CUDA the GPUs' RNG states go into the checkpoint and come back on resume (faked here on a
    CPU: the calls are what is checked); a CPU run writes none, and another device count skips it."""
    import json

    t = Trainer(copy.deepcopy(tiny_lm), TrainSettings())
    save_checkpoint(tmp_path / "cpu", 1, t.model, t.optimizer, {})
    written = json.loads((latest_checkpoint(tmp_path / "cpu") / "trainer_state.json").read_text())
    assert "cuda" not in written["rng"]

    saved = [torch.randint(0, 256, (16,), dtype=torch.uint8) for _ in range(2)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in saved])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    save_checkpoint(tmp_path, 1, t.model, t.optimizer, {})
    load_checkpoint(latest_checkpoint(tmp_path), t.model, t.optimizer)
    assert len(restored) == 2 and all(torch.equal(a, b) for a, b in zip(restored, saved, strict=True))
    restored.clear()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # resumed on a machine with one GPU
    load_checkpoint(latest_checkpoint(tmp_path), t.model, t.optimizer)
    assert restored == []
