"""How a run behaves around its folder: one run per folder, resume with safe changes, corrupt
checkpoints skipped and named, file-system errors in one line, Ctrl-C saves, no duplicate logs."""

import json
import os
import shutil
import signal

import pytest
from typer.testing import CliRunner

from compactrl.cli import app
from compactrl.config import load_config
from compactrl.rl.checkpoint import CheckpointError, CheckpointWriteError, check_checkpoint, latest_checkpoint
from compactrl.rl.evaluate import evaluate
from compactrl.rl.loop import Interrupted, TrainConfig, train
from compactrl.run_dir import RunDirError

SMALL = ["prompts=2", "group_size=2", "checkpoint_every=1"]


def config(out, *extra):
    return load_config(TrainConfig, "configs/quickstart.toml", [f"out={out}", *SMALL, *extra])


def steps_logged(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_used_run_folder_needs_resume_or_overwrite(tmp_path):
    cfg = config(tmp_path / "run", "steps=2")
    with pytest.raises(RunDirError, match="holds no run"):
        train(cfg, resume=True)  # nothing to resume, and nothing was written
    assert not (tmp_path / "run").exists()
    train(cfg)
    with pytest.raises(RunDirError, match="already holds a run.*--resume.*--overwrite"):
        train(cfg)  # a second run would mix its metrics and checkpoints with the first's
    with pytest.raises(RunDirError, match="pass one"):
        train(cfg, resume=True, overwrite=True)
    train(config(tmp_path / "run", "steps=1"), overwrite=True)
    assert steps_logged(tmp_path / "run") == [1]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000001"]
    with pytest.raises(RunDirError, match="which this run loads"):  # its model lives in the folder
        train(config(tmp_path / "run", f"model.path={tmp_path / 'run' / 'model'}", "steps=1"), overwrite=True)


def test_resume_names_the_changed_fields_and_allows_the_safe_ones(tmp_path):
    train(config(tmp_path / "a", "steps=2"))
    with pytest.raises(RunDirError, match=r"rollout\.max_turns: 64 -> 5; train\.lr: 0\.003 -> 0\.1"):
        train(config(tmp_path / "a", "steps=2", "train.lr=0.1", "rollout.max_turns=5"), resume=True)
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    del saved["log"]  # a run started before a field existed: its default is no change
    (tmp_path / "a" / "config.json").write_text(json.dumps(saved))
    shutil.move(tmp_path / "a", tmp_path / "moved")  # a moved folder and more steps: both safe
    train(config(tmp_path / "moved", "steps=4", "threads=2", "checkpoint_every=3"), resume=True)
    assert steps_logged(tmp_path / "moved") == [1, 2, 3, 4]
    assert json.loads((tmp_path / "moved" / "config.json").read_text())["steps"] == 4
    straight = []
    train(config(tmp_path / "b", "steps=4"), on_step=straight.append)
    extended = [json.loads(x) for x in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in extended] == [r["reward"] for r in straight]  # as if never stopped
    with pytest.raises(RunDirError, match="checkpoint is at step 4: resume with steps >= 4"):
        train(config(tmp_path / "moved", "steps=3"), resume=True)


def test_a_corrupt_newest_checkpoint_is_named_and_skipped(tmp_path, capsys):
    run = tmp_path / "run"
    train(config(run, "steps=3"))
    newest = run / "checkpoints" / "step_00000003"
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated, as by a full disk or a kill
    with pytest.raises(CheckpointError, match="model.safetensors has .* bytes, the manifest says"):
        check_checkpoint(newest)
    state = newest / "trainer_state.json"
    text = state.read_text()
    state.write_text(text.replace('"step": 3', '"step": 9'))  # same size, other content
    skipped = []
    assert latest_checkpoint(run, skipped) == run / "checkpoints" / "step_00000002"
    assert "model.safetensors" in skipped[0]
    weights.unlink()
    (newest / "model" / "model.safetensors").write_bytes(b"")
    shutil.copy(run / "checkpoints" / "step_00000002" / "model" / "model.safetensors", weights)
    with pytest.raises(CheckpointError, match="trainer_state.json does not match its SHA-256"):
        check_checkpoint(newest)
    (newest / "manifest.json").unlink()  # an unfinished write: no manifest
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        check_checkpoint(newest)
    capsys.readouterr()
    train(config(run, "steps=3"), resume=True)
    err = capsys.readouterr().err
    assert "skipping a checkpoint" in err and "resuming from step 2 of 3 (" in err and "step_00000002)" in err
    assert steps_logged(run) == [1, 2, 3]  # step 3 trained again from step 2's checkpoint
    check_checkpoint(newest)  # and written whole this time
    result = evaluate(config(run, "steps=3"), run / "checkpoints", episodes=2)  # `checkpoints/` also resolves
    assert result["checkpoint"] == str(newest)


def test_a_failed_checkpoint_write_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import compactrl.rl.checkpoint as ckpt

    def full_disk(tensors, path, **kw):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(
        CheckpointWriteError, match="cannot write checkpoint .*optimizer.safetensors: No space"
    ):
        train(config(tmp_path / "run", "steps=1"))
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []  # the .partial-* folder is gone
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(app, ["train", "configs/quickstart.toml", "--set", f"out={blocker}/run"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(blocker) in lines[0] and "Not a directory" in lines[0], result.output


def test_ctrl_c_finishes_the_step_saves_and_resumes(tmp_path):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (CI may ignore it)
    straight = []
    train(config(tmp_path / "a", "steps=4", "checkpoint_every=10"), on_step=straight.append)

    def ctrl_c(m):
        if m["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    run = tmp_path / "b"
    with pytest.raises(Interrupted, match="after step 2") as stop:
        train(config(run, "steps=4", "checkpoint_every=10"), on_step=ctrl_c)  # before any checkpoint
    assert stop.value.checkpoint == run / "checkpoints" / "step_00000002"
    check_checkpoint(stop.value.checkpoint)
    resumed = []
    train(config(run, "steps=4", "checkpoint_every=10"), resume=True, on_step=resumed.append)
    assert [r["reward"] for r in resumed] == [r["reward"] for r in straight[2:]]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["wall_s"] > summary["wall_s_this_part"] > 0  # the total counts both parts
    assert (
        summary["cpu_s"]
        > json.loads((stop.value.checkpoint / "trainer_state.json").read_text())["state"]["cpu_s"]
        > 0
    )

    def twice(m):
        if m["step"] == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the second stops at once, unsaved

    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "c", "steps=4", "checkpoint_every=10"), on_step=twice)
    assert not (tmp_path / "c" / "checkpoints").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with SIGINT ignored (nohup): left alone
    train(config(tmp_path / "d", "steps=1"))
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    signal.signal(signal.SIGINT, previous)


def test_tensorboard_has_each_step_once_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"

    def crash(m):
        if m["step"] == 3:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        train(
            config(run, "steps=4", "checkpoint_every=2"), on_step=crash
        )  # logs step 3 past step 2's checkpoint
    train(config(run, "steps=4", "checkpoint_every=2"), resume=True)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2, 3, 4]
    assert steps_logged(run) == [1, 2, 3, 4]


def test_monitoring_sinks_say_when_they_are_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)  # not installed
    train(config(tmp_path / "a", "steps=1"))
    assert "TensorBoard is off: pip install 'compactrl[monitor]'" in capsys.readouterr().err
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"compactrl\[wandb\]"):
        train(config(tmp_path / "b", "steps=1", "log.wandb=true"))
    assert not (tmp_path / "b").exists()  # refused before anything was written


def test_wandb_offline_logs_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(config(run, "steps=2", "log.wandb=true", "log.wandb_mode=offline"))
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and (run / "wandb_id").read_text().strip() in offline[0].name


def test_the_progress_bar_gets_the_reward_of_each_step(tmp_path):
    shown = []
    train(config(tmp_path / "run", "steps=2"), progress=lambda total: shown.append(total) or shown.append)
    assert shown[0] == 2 and all(s.startswith("reward ") for s in shown[1:]) and len(shown) == 3
