"""`compactrl plot RUN_DIR`: a run's curves to PNG; bad input is one clear line before anything is drawn."""

import json

import matplotlib.image
import pytest
from typer.testing import CliRunner

from compactrl.cli import app
from compactrl.plot import DEFAULT_PANELS, PlotError, plot_run

runner = CliRunner()


def rl_row(step: int, **extra) -> dict:
    return {
        "step": step, "phase": "rl", "reward": 0.1 * step, "reward_max": 0.2 * step, "loss": 1e-8 * step,
        "mismatch_kl": 1e-12, "ref_kl": 0.01, "entropy": 0.5, "grad_norm": 1.0, "value_loss": 0.3,
        "generate_s": 0.2, "train_s": 0.1, "sync_s": 0.0, **extra,
    }  # fmt: skip


def write_run(d, rows, summary=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return d


@pytest.fixture
def run(tmp_path):
    """Two SFT steps, then RL with a critic and a KL reference; held-out evals in summary.json."""
    sft = [{"step": s, "phase": "sft", "loss": 2.0, "grad_norm": 1.0, "trained_tokens": 8, "train_s": 0.1}
           for s in (1, 2)]  # fmt: skip
    rows = sft + [rl_row(s) for s in range(3, 9)]
    summary = {"eval_before": {"mean_reward": 0.05}, "eval_after": {"mean_reward": 0.6}}
    return write_run(tmp_path / "run", rows, summary)


def decoded(path):
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert image.std() > 0.01  # something was drawn
    return image


def test_default_panels_to_the_run_dir(run):
    result = plot_run(run)
    assert result == {"png": str(run / "curves.png"), "steps": 8, "panels": list(DEFAULT_PANELS)}
    decoded(run / "curves.png")


def test_chosen_metrics_one_panel_each(run, tmp_path):
    out = tmp_path / "nested" / "grad.png"
    result = plot_run(run, out, ["grad_norm", "entropy", "grad_norm"])
    assert result["panels"] == ["grad_norm", "entropy"] and result["steps"] == 8
    decoded(out)


def test_a_run_without_kl_or_eval_still_plots(tmp_path):
    rows = [rl_row(s, ref_kl=0.0, mismatch_kl=0.0, value_loss=0) for s in range(1, 4)]
    assert plot_run(write_run(tmp_path / "r", rows))["panels"] == list(DEFAULT_PANELS)
    (tmp_path / "r" / "summary.json").write_text("{trunc")  # a run still writing it: no eval points
    decoded(plot_run(tmp_path / "r")["png"])


def test_bad_input_is_refused_before_plotting(tmp_path, run):
    with pytest.raises(PlotError, match="has no metrics.jsonl"):
        plot_run(tmp_path)
    with pytest.raises(PlotError, match="does not exist"):
        plot_run(tmp_path / "nowhere")
    with pytest.raises(PlotError, match="is empty"):
        plot_run(write_run(tmp_path / "empty", []))
    bad = write_run(tmp_path / "bad", [rl_row(1), rl_row(2)])
    with open(bad / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward": \n')
    with pytest.raises(PlotError, match=r"metrics.jsonl, line 3: not valid JSON"):
        plot_run(bad)
    (bad / "metrics.jsonl").write_text(json.dumps(rl_row(1)) + "\n[1, 2]\n")
    with pytest.raises(PlotError, match=r"line 2: not a metrics row"):
        plot_run(bad)
    with pytest.raises(PlotError, match=r"--metric nope not logged.*available: .*grad_norm.*reward"):
        plot_run(run, metrics=["reward", "nope"])
    assert not (run / "curves.png").exists() and not (bad / "curves.png").exists()


def test_cli_json_and_errors(run, tmp_path):
    out = tmp_path / "c.png"
    r = runner.invoke(app, ["plot", str(run), "--out", str(out), "--metric", "reward", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"png": str(out), "steps": 8, "panels": ["reward"]}
    r = runner.invoke(app, ["plot", str(run)])
    assert r.exit_code == 0 and str(run / "curves.png") in r.stdout
    for args, message in (
        ([str(tmp_path)], "has no metrics.jsonl"),
        ([str(run), "--metric", "rewrd"], "available:"),
    ):
        r = runner.invoke(app, ["plot", *args])
        text = " ".join(r.output.split())  # rich wraps at the test terminal's 80 columns
        assert r.exit_code == 2 and text.startswith("error: ") and message in text and "Traceback" not in text


def test_plots_a_real_training_run(tmp_path):
    run_dir = tmp_path / "qs"
    r = runner.invoke(app, ["train", "configs/quickstart.toml", "--set", "steps=3", "--set", f"out={run_dir}",
                            "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["plot", str(run_dir), "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["steps"] == 3 and result["panels"] == list(DEFAULT_PANELS)
    decoded(result["png"])


def test_comparing_runs_draws_success_against_training_time(tmp_path):
    """Several runs: held-out success against wall-clock, the warm-up's time left out of the x axis."""
    from compactrl.plot import plot_compare, success_curve

    sft = [{"step": 1, "phase": "sft", "loss": 2.0, "train_s": 5.0, "wall_s": 5.0}]
    runs = []
    for mode, pace in (("stream", 10.0), ("reprefill", 30.0)):
        rows = sft + [rl_row(s, wall_s=5.0 + pace * (s - 1)) for s in range(2, 6)]
        rows[2]["eval_success"], rows[4]["eval_success"] = 0.25, 0.5
        d = write_run(tmp_path / mode, rows, {"eval_before": {"success_rate": 0.125}})
        (d / "config.json").write_text(json.dumps({"mode": mode, "strategy": {"name": "sliding_window"}}))
        runs.append(d)
    assert success_curve(runs[0]) == [(0.0, 0.125), (20.0, 0.25), (40.0, 0.5)]
    assert success_curve(runs[1]) == [(0.0, 0.125), (60.0, 0.25), (120.0, 0.5)]
    result = runner.invoke(
        app, ["plot", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "c.png"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["runs"] == ["stream", "reprefill"]
    decoded(tmp_path / "c.png")
    bare = write_run(tmp_path / "bare", [rl_row(1)])  # no evaluations: nothing to compare
    result = runner.invoke(app, ["plot", str(runs[0]), str(bare)])
    assert result.exit_code != 0 and "eval_every" in result.output
    with pytest.raises(PlotError, match="config.json"):
        plot_compare([write_run(tmp_path / "noconf", [rl_row(1, eval_success=0.5, wall_s=1.0)])] * 2,
                     tmp_path / "x.png")  # fmt: skip
