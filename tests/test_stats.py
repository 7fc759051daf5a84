"""Intervals and paired comparisons: known values, invariants, and the unpaired negative control."""

import json

import numpy as np
import pytest

from compactrl.stats import align, compare, mean_ci, paired_diff, verdict, wilson


def test_wilson_matches_the_hand_computed_interval_and_shrinks_with_n():
    # 38/100, z = 1.959964: centre (0.38 + z^2/200) / (1 + z^2/100), half-width
    # z * sqrt(0.38 * 0.62 / 100 + z^2 / 40000) / (1 + z^2/100)
    assert mean_ci([1] * 38 + [0] * 62) == pytest.approx([0.29098, 0.47790], abs=1e-5)
    assert wilson(38, 100) == mean_ci([True] * 38 + [False] * 62)
    widths = [np.diff(wilson(4 * n // 10, n))[0] for n in (10, 100, 1000)]
    assert widths[0] > widths[1] > widths[2] > 0
    lo, hi = mean_ci([0] * 20)  # at the edge the interval stays inside [0, 1] and is not a point
    assert lo == 0.0 < hi < 0.2
    assert mean_ci([]) is None


def test_real_valued_rewards_get_a_bootstrap_interval_around_the_mean():
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 1.0, size=400)
    lo, hi = mean_ci(x)
    assert lo < x.mean() < hi and hi - lo == pytest.approx(2 * 1.96 * x.std() / 20, rel=0.1)
    assert mean_ci([0.5] * 10) == [0.5, 0.5]
    assert mean_ci(x, level=0.5)[1] - mean_ci(x, level=0.5)[0] < hi - lo


def test_identical_rows_differ_by_exactly_zero():
    a = np.random.default_rng(2).integers(0, 2, 100)
    d = paired_diff(a, a)
    assert d.diff == 0.0 and d.ci == [0.0, 0.0] and d.mcnemar_p == 1.0
    assert verdict(d.ci) == "no difference measured"


def test_a_clearly_different_pair_excludes_zero():
    # 100 questions both get right, 80 only A, 20 only B, 100 neither
    a = np.array([1] * 100 + [1] * 80 + [0] * 20 + [0] * 100)
    b = np.array([1] * 100 + [0] * 80 + [1] * 20 + [0] * 100)
    d = paired_diff(a, b)
    assert d.diff == pytest.approx(0.2) and 0 < d.ci[0] < 0.2 < d.ci[1] and d.n == 300
    assert d.mcnemar_p < 1e-6
    # exact: two-sided binomial tail of <= 20 in 100 at 1/2
    from math import comb

    assert d.mcnemar_p == pytest.approx(2 * sum(comb(100, k) for k in range(21)) / 2**100, rel=1e-12)
    assert verdict(d.ci, "A", "B") == "A better" and verdict(paired_diff(b, a).ci) == "B better"
    assert json.loads(json.dumps(d.row_fields())) == d.row_fields()
    assert verdict(d.ci, "A", "B", d.mcnemar_p) == "A better"
    assert paired_diff([0.5, 0.7], [0.1, 0.2]).mcnemar_p is None  # real values: no McNemar
    few = paired_diff([1, 1, 1], [0, 0, 0])  # three questions all one way: a point interval, p 0.25
    assert few.ci == [1.0, 1.0] and few.mcnemar_p == 0.25
    assert verdict(few.ci, p=few.mcnemar_p) == "no difference measured"


def test_unpairing_correlated_rows_widens_the_interval():
    """Negative control: the same values with the pairing broken (B shuffled over the questions)
    give the same mean difference but a wider interval; pairing is what narrows it."""
    rng = np.random.default_rng(3)
    easy = rng.random(200) < 0.5  # the question's difficulty drives both rows
    a = (easy | (rng.random(200) < 0.15)).astype(float)
    b = (easy & (rng.random(200) < 0.9)).astype(float)
    paired, unpaired = paired_diff(a, b), paired_diff(a, rng.permutation(b))
    assert paired.diff == pytest.approx(unpaired.diff)
    assert np.diff(unpaired.ci)[0] > 1.5 * np.diff(paired.ci)[0]


def test_rows_on_other_seeds_are_not_compared():
    a, b = {1: 1.0, 2: 0.0, 3: 1.0}, {3: 0.0, 1: 1.0, 2: 0.0}
    x, y = align(a, b)
    assert x.tolist() == [1.0, 0.0, 1.0] and y.tolist() == [1.0, 0.0, 0.0]  # in seed order
    with pytest.raises(ValueError, match=r"rows 'window' and 'full' .* \[4\].* \[3\]"):
        compare({1: 1.0, 2: 0.0, 4: 1.0}, b, "window", "full")
    assert compare(a, b, "window", "full")["compared_to"] == "full"


def test_the_same_inputs_give_the_same_numbers():
    rng = np.random.default_rng(4)
    a, b = rng.random(150), rng.random(150)
    assert paired_diff(a, b) == paired_diff(a.copy(), b.copy())
    assert mean_ci(a) == mean_ci(list(a))


def test_a_rollout_summary_carries_its_intervals():
    from compactrl.agent.batch import summarize
    from compactrl.agent.rollout import EpisodeResult

    played = [EpisodeResult(i, i, "rooms", "full", "none", reward=float(i < 3), info={"correct": i < 3})
              for i in range(10)]  # fmt: skip
    s = summarize(played)
    assert s["accuracy_ci"] == wilson(3, 10) == s["mean_reward_ci"]
    assert summarize([])["accuracy_ci"] is None


def test_eval_reports_intervals_over_its_held_out_episodes(tmp_path):
    from typer.testing import CliRunner

    from compactrl.cli import app

    args = ["eval", "configs/quickstart.toml", "--set", f"out={tmp_path}", "--episodes", "4"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.output)
    saved = json.loads((tmp_path / "eval" / "initial.json").read_text())
    rewards = [e["reward"] for e in saved["episode_metrics"]]
    assert result["mean_reward_ci"] == mean_ci(rewards)
    assert result["success_rate_ci"] == mean_ci([float(x >= 1) for x in rewards])
    lo, hi = result["success_rate_ci"]
    assert lo <= result["success_rate"] <= hi and hi - lo > 0.3  # four episodes: a wide interval
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "(95% intervals)" in r.output
