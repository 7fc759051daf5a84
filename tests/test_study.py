"""A study trains a grid of runs (two at once), evaluates each several ways, and resumes."""

import json

import pytest

from compactrl.config import ConfigError
from compactrl.stats import fmt_paired
from compactrl.study import markdown, run_study

STUDY = """
out = "{out}/runs"
results = "{out}/results.json"
parallel = 2
columns = {{ seed = "seed", steps = "steps", mode = "mode" }}

[[run]]
config = "configs/quickstart.toml"
name = "q_seed{{seed}}"
set = ["steps=2", "prompts=2", "group_size=2", "checkpoint_every=1"]
grid = {{ seed = [0, 1] }}

[[eval]]
name = "in-distribution"
episodes = 3

[[eval]]
name = "reprefill"
set = ["mode=reprefill"]
episodes = 3
"""


def test_a_study_trains_its_grid_evaluates_and_resumes(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(STUDY.format(out=tmp_path))
    rows = run_study(path, echo=lambda m: None)
    assert [(r["run"], r["eval"]) for r in rows] == [
        ("q_seed0", "in-distribution"), ("q_seed0", "reprefill"),
        ("q_seed1", "in-distribution"), ("q_seed1", "reprefill"),
    ]  # fmt: skip
    assert [r["seed"] for r in rows] == [0, 0, 1, 1] and all(r["steps"] == 2 for r in rows)
    assert all(r["mode"] == "stream" for r in rows)  # a column is the run's field, not the eval's --set
    assert all(r["episodes"] == 3 and r["checkpoint"].endswith("step_00000002") for r in rows)
    assert rows[0]["cpu_s"] > 0 and rows[0]["stderr"] >= 0
    for r in rows:  # 95% intervals over the evaluation's 3 episodes
        assert r["accuracy_ci"][0] <= r["accuracy"] <= r["accuracy_ci"][1] and r["accuracy_ci"][1] > 0
        assert r["mean_reward_ci"][0] <= r["mean_reward"] <= r["mean_reward_ci"][1]
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert saved == json.loads(json.dumps(rows))
    table = markdown({"study": str(path), "rows": saved}).splitlines()  # what the docs render
    head = "| run | seed | steps | mode | in-distribution [95% CI] | reprefill [95% CI] |"
    assert table[0].startswith(head)
    assert [line.split(" | ")[0] for line in table[2:]] == ["| q_seed0", "| q_seed1"]  # a line per run
    lo, hi = rows[0]["accuracy_ci"]
    assert f"{rows[0]['accuracy']:.2f} [{lo:.2f}, {hi:.2f}]" in table[2]
    # run again: nothing is trained or evaluated twice (the logs and eval files stay as they were)
    log = (tmp_path / "runs" / "q_seed0.log").read_text()
    evals = sorted(p.name for p in (tmp_path / "runs" / "q_seed0" / "eval").iterdir())
    assert run_study(path, echo=lambda m: None) == rows
    assert (tmp_path / "runs" / "q_seed0.log").read_text() == log
    assert sorted(p.name for p in (tmp_path / "runs" / "q_seed0" / "eval").iterdir()) == evals
    # more steps for one run: it resumes from its checkpoint; the other run's rows are kept
    path.write_text(STUDY.format(out=tmp_path).replace('"steps=2"', '"steps=3"'))
    more = run_study(path, only=["q_seed1"], echo=lambda m: None)
    assert [r["checkpoint"].endswith("step_00000003") for r in more] == [True, True]
    steps = [
        json.loads(x)["step"]
        for x in (tmp_path / "runs" / "q_seed1" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["run"] for r in saved] == ["q_seed0", "q_seed0", "q_seed1", "q_seed1"]


STAGED = """
out = "{out}/runs"
results = "{out}/results.json"
parallel = 2
rows = "per_run"
columns = {{ mode = "mode" }}
compare = [["tuned_stream", "base"], ["tuned_reprefill", "tuned_stream"]]

[[run]]
config = "configs/quickstart.toml"
name = "base"
set = ["steps=2", "checkpoint_every=2"]

[[run]]
config = "configs/quickstart.toml"
name = "tuned_{{mode}}"
stage = 1
set = ["steps=1", "model.path={out}/runs/base/checkpoints/step_00000002/model"]
grid = {{ mode = ["stream", "reprefill"] }}

[[eval]]
name = "final"
episodes = 2
traces = true

[[eval]]
name = "full"
set = ["mode=full"]
episodes = 2
"""


def test_a_later_stage_starts_from_an_earlier_runs_checkpoint_and_rows_can_be_per_run(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(STAGED.format(out=tmp_path))
    rows = run_study(path, echo=lambda m: None)
    assert [(r["run"], r["mode"]) for r in rows] == [
        ("base", "stream"), ("tuned_stream", "stream"), ("tuned_reprefill", "reprefill")
    ]  # fmt: skip
    for r in rows:  # one row per run: each eval's success and stderr side by side
        assert {"final_success", "final_stderr", "full_success", "full_stderr"} <= set(r)
        assert r["final_success_ci"][0] <= r["final_success"] <= r["final_success_ci"][1]
        assert "eval" not in r and "accuracy" not in r and "accuracy_ci" not in r
        assert r["gen_s"] > 0 and r["train_s"] > 0 and r["wall_s"] >= r["gen_s"] + r["train_s"]
    kept = tmp_path / "runs" / "tuned_stream" / "eval" / "step_00000001-greedy-study-final.traces.jsonl"
    assert kept.is_file() and not list(
        (tmp_path / "runs" / "tuned_stream" / "eval").glob("*full.traces.jsonl")
    )
    by_run = {r["run"]: r for r in rows}  # the re-prefill overhead, in tokens per rollout
    assert by_run["tuned_reprefill"]["reprefilled_tokens"] > 0 == by_run["tuned_stream"]["reprefilled_tokens"]
    assert by_run["tuned_stream"]["tokens"] > 0
    for a, b in (("tuned_stream", "base"), ("tuned_reprefill", "tuned_stream")):  # paired, per eval
        for ev in ("final", "full"):
            d = by_run[a][f"{ev}_vs_{b}"]
            assert d["compared_to"] == f"{b} / {ev}" and d["paired_diff_ci"][0] <= d["paired_diff"]
            assert d["paired_diff"] == pytest.approx(by_run[a][f"{ev}_success"] - by_run[b][f"{ev}_success"])
    assert not any(k.startswith("final_vs") for k in by_run["base"])
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert saved == json.loads(json.dumps(rows))
    table = markdown({"study": str(path), "rows": saved})  # each comparison a column, with its verdict
    assert "| final vs base, paired |" in table.splitlines()[0]
    assert fmt_paired(by_run["tuned_stream"]["final_vs_base"], "tuned_stream") in table
    base = tmp_path / "runs" / "base" / "checkpoints" / "step_00000002" / "model" / "model.safetensors"
    tuned = json.loads((tmp_path / "runs" / "tuned_stream" / "config.json").read_text())
    assert tuned["model"]["path"] == str(base.parent) and base.is_file()


def test_a_bad_study_is_refused_before_training(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(STUDY.format(out=tmp_path).replace('name = "q_seed{seed}"', 'name = "q"'))
    with pytest.raises(ConfigError, match="run names repeat"):
        run_study(path)
    path.write_text(STUDY.format(out=tmp_path).replace('set = ["mode=reprefill"]', 'set = ["mode=bogus"]'))
    with pytest.raises(ConfigError, match="eval reprefill: .*mode"):
        run_study(path)
    path.write_text('compare = [["q_seed1", "q_seed2"]]\n' + STUDY.format(out=tmp_path))
    with pytest.raises(ConfigError, match=r"compare names \['q_seed2'\]"):
        run_study(path)
    assert not (tmp_path / "runs").exists()


def test_the_studies_in_configs_are_valid():
    """Every study config expands and every run and evaluation config validates (no training)."""
    import tomllib
    from pathlib import Path

    from compactrl.study import StudyConfig, expand

    studies = sorted(Path("configs/studies").glob("*.toml"))
    assert studies
    for path in studies:
        assert expand(StudyConfig.model_validate(tomllib.loads(path.read_text())))
