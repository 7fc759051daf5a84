"""The CLI where a new user trips: used run folders, failed starts, resumes, wrong kinds of config,
misspelt keys, Ctrl-C, empty trace files, the version."""

import json
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

import compactrl.cluster
from compactrl.cli import app

runner = CliRunner()
ROLLOUT = ["rollout", "configs/rollout/rooms.toml", "--set", "episodes=1", "--set", "env.n_rooms=3"]
TRAIN = ["train", "configs/quickstart.toml", "--set", "threads=1"]


def test_rollout_refuses_a_folder_that_holds_a_run_unless_overwritten(tmp_path):
    args = [*ROLLOUT, "--set", f"out={tmp_path}", "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already holds a run" in again.output and "--overwrite" in again.output
    assert "--resume" not in again.output  # a rollout has nothing to resume
    replaced = runner.invoke(app, [*args, "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(replaced.output)["episodes"] == 1


def test_what_a_failed_start_left_does_not_block_the_corrected_command(tmp_path):
    """A folder holding only what a start writes before its first step is reused; a logged step or
    a file a start does not write keeps it refused."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "model").mkdir()
    for name in ("config.json", "provenance.jsonl", "metrics.jsonl"):
        (out / name).write_text("")
    r = runner.invoke(app, [*TRAIN, "--set", f"out={out}", "--set", "steps=1"])
    assert r.exit_code == 0, r.output
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 1
    for leftover, body in (("metrics.jsonl", '{"step": 1}\n'), ("notes.txt", "mine")):
        other = tmp_path / leftover
        other.mkdir()
        (other / "config.json").write_text("")
        (other / leftover).write_text(body)
        refused = runner.invoke(app, [*TRAIN, "--set", f"out={other}", "--set", "steps=1"])
        assert refused.exit_code == 2 and "already holds a run" in refused.output
        assert (other / leftover).read_text() == body  # nothing deleted


def test_resume_keeps_the_runs_own_steps_and_says_where_it_resumes(tmp_path):
    out = ["--set", f"out={tmp_path}", "--set", "checkpoint_every=1"]
    assert runner.invoke(app, [*TRAIN, *out, "--set", "steps=2"]).exit_code == 0
    more = runner.invoke(app, [*TRAIN, *out, "--set", "steps=3", "--resume"])
    assert more.exit_code == 0, more.output
    assert "resuming from step 2 of 3" in more.output
    # no --set steps: the run's own 3, not the file's 40
    same = runner.invoke(app, [*TRAIN, *out, "--resume"])
    assert same.exit_code == 0, same.output
    assert "already at step 3" in same.output
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_ctrl_c_says_exactly_what_to_type_and_is_no_error(tmp_path, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(compactrl.cluster, "launch", interrupted)
    r = runner.invoke(app, [*TRAIN, "--set", f"out={tmp_path / 'x y'}"])
    assert r.exit_code == 130 and "error" not in r.output
    typed = f"compactrl train configs/quickstart.toml --set threads=1 --set 'out={tmp_path / 'x y'}' --resume"
    assert typed in " ".join(r.output.split())  # quoted for a shell


def test_a_config_of_another_kind_names_the_command_that_runs_it():
    r = runner.invoke(app, ["train", "configs/rollout/rooms.toml"])
    assert r.exit_code == 2 and "is a rollout config: run it with compactrl rollout" in r.output
    r = runner.invoke(app, ["rollout", "configs/quickstart.toml"])
    assert r.exit_code == 2 and "is a train config: run it with compactrl train" in r.output
    r = runner.invoke(app, ["rollout", "configs/rollout/rooms.toml", "--set", "train.lr=1"])
    assert "is a train config" not in r.output  # a rollout config with a bad key is no train config


@pytest.mark.parametrize(
    "key, meant",
    [("train.lrr=1", "lr"), ("stepz=3", "steps"), ("strategy.max_turnz=3", "max_turns"),
     ("objective.advantag=loo", "advantage")],
)  # fmt: skip
def test_a_misspelt_key_gets_a_did_you_mean(key, meant):
    r = runner.invoke(app, ["train", "configs/quickstart.toml", "--set", key, "--set", "threads=1"])
    assert r.exit_code == 2 and f"did you mean {meant!r}?" in r.output
    assert f"with --set {key} --set threads=1 is invalid" in " ".join(r.output.split())  # every flag echoed
    far = runner.invoke(app, ["train", "configs/quickstart.toml", "--set", "zzzzzz=1"])
    assert far.exit_code == 2 and "did you mean" not in far.output


def test_rollout_errors_are_one_line(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    r = runner.invoke(app, [*ROLLOUT, "--set", f"model.path={folder}", "--set", f"out={tmp_path / 'o'}"])
    assert r.exit_code == 2 and r.output.startswith("error:") and "Traceback" not in r.output


def test_trace_show_and_verify_run_agree_on_an_empty_file(tmp_path):
    r = runner.invoke(app, [*ROLLOUT, "--set", f"out={tmp_path}", "--json"])
    assert r.exit_code == 0, r.output
    (tmp_path / "traces.jsonl").write_text("")
    shown = runner.invoke(app, ["trace", "show", str(tmp_path / "traces.jsonl")])
    verified = runner.invoke(app, ["verify", "run", str(tmp_path)])
    assert shown.exit_code == verified.exit_code == 2
    assert "holds no traces" in shown.output and "holds no traces" in verified.output


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"compactrl {version('compactrl')}"


def test_a_missing_model_names_the_config_that_makes_it(tmp_path, monkeypatch):
    rooms = str(Path("configs/rollout/rooms.toml").resolve())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs" / "sft").mkdir(parents=True)
    (tmp_path / "configs" / "sft" / "base.toml").write_text('out = "runs/sft"\n')
    (tmp_path / "configs" / "sft" / "grid.toml").write_text('out = "runs"\n[[run]]\nname = "x"\n')
    args = ["rollout", rooms, "--set", "model.path=runs/sft/checkpoints/step_00000004/model"]
    made = runner.invoke(app, args)
    assert made.exit_code == 2  # the deepest run folder that holds it, not the grid's
    assert "it is made by `compactrl train configs/sft/base.toml`" in " ".join(made.output.split())
    elsewhere = runner.invoke(app, ["rollout", rooms, "--set", "model.path=models/nothing"])
    assert elsewhere.exit_code == 2 and "made by" not in elsewhere.output
    assert "import-gguf" in elsewhere.output
