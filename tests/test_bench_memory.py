"""`compactrl bench memory`: rows of rollout runs on one base config, resumed from their folders,
an evictor row at another row's realised peak."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from compactrl.bench.memory import MemoryBench, load_bench, markdown, run_memory_bench

BASE = """mode = "full"
episodes = 2
concurrency = 2
seed = 1000000000
[env]
name = "browse"
world_size = 40
[rollout]
max_tokens = 8
max_turns = 3
"""


def bench_file(tmp_path, rows: str):
    (tmp_path / "base.toml").write_text(BASE + '[model]\nsize = "tiny"\n')
    path = tmp_path / "bench.toml"
    head = {"base": tmp_path / "base.toml", "out": tmp_path / "runs", "results": tmp_path / "rows.json",
            "plot": tmp_path / "rows.png"}  # fmt: skip
    path.write_text("".join(f'{k} = "{v}"\n' for k, v in head.items()) + rows)
    return path


ROWS = """
[[row]]
name = "full"
[[row]]
name = "window"
set = ["mode=stream", "strategy.name=keep_last_cursors", "strategy.n=1"]
[[row]]
name = "h2o_at_full"
set = ["mode=stream", "evictor.name=h2o"]
budget_from = "full"
"""


def test_rows_run_resume_and_take_a_budget_from_another_row(tmp_path):
    bench = load_bench(bench_file(tmp_path, ROWS))
    table = run_memory_bench(bench)
    assert [r["row"] for r in table] == ["full", "window", "h2o_at_full"]
    assert table[2]["budget"] == round(table[0]["mean_peak_live_kv"]) and table[2]["evictor"] == "h2o"
    assert (
        json.loads((tmp_path / "rows.json").read_text()) == table and (tmp_path / "rows.png").stat().st_size
    )
    assert markdown(table).count("\n") == 4 and "(1.00x)" in markdown(table).splitlines()[2]
    for r in table:  # no auxiliary threads: the episode holds and reads its main thread only
        assert r["mean_peak_kv_with_threads"] == r["mean_peak_live_kv"]
        assert r["kv_reads_with_threads_per_episode"] == r["kv_reads_per_episode"]
    stamp = (tmp_path / "runs" / "window" / "summary.json").stat().st_mtime_ns
    again = run_memory_bench(bench, only=["window"])  # read back, not run again; the others kept
    assert again == table and (tmp_path / "runs" / "window" / "summary.json").stat().st_mtime_ns == stamp
    saved = tmp_path / "runs" / "window" / "config.json"
    old = json.loads(saved.read_text())
    saved.write_text(json.dumps({k: v for k, v in old.items() if k != "demo"}))  # before `demo` existed
    assert run_memory_bench(bench, only=["window"]) == table  # its default: the same run, read back
    saved.write_text(json.dumps(old | {"retired_field": 1}))  # a field since removed: not the same run
    run_memory_bench(bench, only=["window"])
    assert (tmp_path / "runs" / "window" / "summary.json").stat().st_mtime_ns != stamp
    stamp = (tmp_path / "runs" / "window" / "summary.json").stat().st_mtime_ns
    run_memory_bench(bench, sets=["rollout.max_turns=2"], only=["window"])  # another config: run again
    assert (tmp_path / "runs" / "window" / "summary.json").stat().st_mtime_ns != stamp


def test_an_overshoot_corrected_row_takes_the_evictors_overshoot_off_its_budget(tmp_path):
    rows = ROWS + "".join(
        f'[[row]]\nname = "{n}"\nset = ["mode=stream", "evictor.name=h2o"]\nbudget_from = "window"\n{x}'
        for n, x in (("at_window", ""), ("matched", 'overshoot_from = "at_window"\n'))
    )
    by = {r["row"]: r for r in run_memory_bench(load_bench(bench_file(tmp_path, rows)))}
    at = by["at_window"]
    assert at["budget"] == round(by["window"]["mean_peak_live_kv"])
    over = at["mean_peak_live_kv"] - at["budget"]
    assert by["matched"]["budget"] == round(by["window"]["mean_peak_live_kv"] - over)
    with pytest.raises(ValidationError, match="overshoot_from corrects budget_from's budget; set both"):
        load_bench(bench_file(tmp_path, ROWS + '[[row]]\nname = "x"\novershoot_from = "full"\n'))


def test_an_only_run_keeps_the_rows_a_parallel_run_wrote_meanwhile(tmp_path):
    bench = load_bench(bench_file(tmp_path, ROWS))
    first = run_memory_bench(bench, only=["full"])
    results = tmp_path / "rows.json"

    def meanwhile(n):  # another --only run finishes while this one plays its episodes
        results.write_text(json.dumps(first + [dict(first[0], row="h2o_at_full", accuracy=0.5)]))
        return lambda: None

    table = run_memory_bench(bench, only=["window"], progress=meanwhile)
    assert [r["row"] for r in table] == ["full", "window", "h2o_at_full"] and table[2]["accuracy"] == 0.5
    assert json.loads(results.read_text()) == table


def test_bad_bench_configs_are_refused_by_name(tmp_path):
    with pytest.raises(ValidationError, match="row 'a' appears twice"):
        load_bench(bench_file(tmp_path, '[[row]]\nname = "a"\n[[row]]\nname = "a"\n'))
    with pytest.raises(ValidationError, match="budget_from 'b' is not an earlier row"):
        load_bench(bench_file(tmp_path, '[[row]]\nname = "a"\nbudget_from = "b"\n[[row]]\nname = "b"\n'))
    with pytest.raises(ValueError, match=r"--only \['c'\]: no such row"):
        run_memory_bench(load_bench(bench_file(tmp_path, '[[row]]\nname = "a"\n')), only=["c"])
    with pytest.raises(ValidationError):
        MemoryBench(base="x", out="y", results="z", row=[])


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).parent.parent.glob("configs/bench/*.toml")), ids=lambda p: p.stem
)
def test_shipped_bench_configs_are_valid(path):
    """Every row's config validates (an earlier run's checkpoint path unset)."""
    from compactrl.agent.batch import RolloutConfig
    from compactrl.config import load_config

    bench = load_bench(path)
    for r in bench.row:
        budget = ["evictor.budget=300"] if r.budget_from else []  # the bench sets it from the other row
        cfg = load_config(RolloutConfig, bench.base, [*r.set, *budget, "model.path="])
        assert cfg.episodes >= 100 and (cfg.evictor is not None) == any("evictor" in s for s in r.set)


def test_bench_wide_overrides_apply_to_every_row_under_the_cli_and_the_rows_own(tmp_path):
    rows = '[[row]]\nname = "a"\n[[row]]\nname = "b"\nset = ["rollout.max_turns=1"]\n'
    path = bench_file(tmp_path, rows)
    path.write_text('set = ["rollout.max_turns=2", "episodes=1"]\n' + path.read_text())
    table = run_memory_bench(load_bench(path), sets=["concurrency=1"])
    saved = {r: json.loads((tmp_path / "runs" / r / "config.json").read_text()) for r in ("a", "b")}
    assert [saved[r]["rollout"]["max_turns"] for r in ("a", "b")] == [2, 1]
    assert all(saved[r]["concurrency"] == 1 for r in ("a", "b")) and [r["episodes"] for r in table] == [1, 1]


def test_rows_carry_intervals_and_a_paired_comparison_to_their_baseline(tmp_path):
    demo = 'set = ["demo=true", "rollout.max_turns=8", "rollout.max_tokens=64"]\ncompare_to = "window"\n'
    rows = ROWS + '[[row]]\nname = "demo"\n' + demo  # the env's solver plays: every answer right
    bench = load_bench(bench_file(tmp_path, rows))
    table = run_memory_bench(bench)
    by = {r["row"]: r for r in table}
    assert by["demo"]["accuracy"] == 1.0 and by["demo"]["accuracy_ci"][1] == 1.0  # the solver answers
    for r in table:
        lo, hi = r["accuracy_ci"]
        assert 0 <= lo <= r["accuracy"] <= hi <= 1 and hi - lo > 0.3  # two questions: a wide interval
    assert by["full"]["compared_to"] is None and by["full"]["paired_diff"] is None
    assert [by[n]["compared_to"] for n in ("window", "h2o_at_full", "demo")] == ["full", "full", "window"]
    for name in ("window", "h2o_at_full", "demo"):
        r, base = by[name], by[by[name]["compared_to"]]
        assert r["paired_diff"] == pytest.approx(r["accuracy"] - base["accuracy"])
        assert r["paired_diff_ci"][0] <= r["paired_diff"] <= r["paired_diff_ci"][1]
    demo = by["demo"]
    if by["window"]["accuracy"] == 0:  # the random model answers nothing: both questions discordant
        assert demo["paired_diff_ci"] == [1.0, 1.0] and demo["mcnemar_p"] == 0.5
    text = markdown(table)
    assert "[" in text.splitlines()[2] and "vs full (p " in text.splitlines()[3]
    assert "no difference measured" in text.splitlines()[5]  # McNemar's p 0.5: not enough questions
    # rows keep their per-question results: read back from the results file they compare as they did,
    # run folders gone; a row from before intervals and per-question results gets Wilson from k and n
    # and no comparison, nor do the rows compared to it
    results = tmp_path / "rows.json"
    drop = ("accuracy_ci", "compared_to", "paired_diff", "paired_diff_ci", "mcnemar_p", "episode_seeds",
            "episode_correct")  # fmt: skip
    results.write_text(json.dumps([{k: v for k, v in r.items() if k not in drop or r["row"] != "full"}
                                   for r in table]))  # fmt: skip
    for name in ("h2o_at_full", "demo"):
        for f in (tmp_path / "runs" / name).iterdir():
            f.unlink() if f.is_file() else None
    again = {r["row"]: r for r in run_memory_bench(bench, only=["window"])}
    assert again["full"]["accuracy_ci"] == by["full"]["accuracy_ci"] and again["full"]["compared_to"] is None
    assert again["window"]["paired_diff"] is None and again["h2o_at_full"]["compared_to"] is None
    assert again["demo"]["paired_diff"] == demo["paired_diff"] and again["demo"]["compared_to"] == "window"


def test_a_random_cursor_row_deletes_at_a_sidequest_rows_realised_rate(tmp_path):
    play = '"demo=true", "mode=stream", "rollout.max_turns=8", "rollout.max_tokens=64", "strategy.every=1"'
    rows = (f'[[row]]\nname = "sq"\nset = [{play}, "strategy.name=sidequest", "strategy.parallel=false"]\n'
            f'[[row]]\nname = "rand"\nset = [{play}, "strategy.name=random_cursors"]\nrate_from = "sq"\n')
    by = {r["row"]: r for r in run_memory_bench(load_bench(bench_file(tmp_path, rows)))}
    sq = by["sq"]
    assert sq["deleted_cursors"] > 0 and sq["aux_offered_cursors"] >= sq["deleted_cursors"]
    used = json.loads((tmp_path / "runs" / "rand" / "config.json").read_text())["strategy"]
    rate = round(sq["deleted_cursors"] / sq["aux_offered_cursors"], 4)
    assert used == {"name": "random_cursors", "rate": rate, "every": 1, "seed": 0}
    assert by["rand"]["compared_to"] == "sq"  # the bench's baseline: its first row
    with pytest.raises(ValidationError, match="rate_from 'b' is not an earlier row"):
        load_bench(bench_file(tmp_path, '[[row]]\nname = "a"\nrate_from = "b"\n[[row]]\nname = "b"\n'))


def test_a_row_on_other_questions_than_its_baseline_is_refused_before_it_runs(tmp_path):
    rows = '[[row]]\nname = "a"\n[[row]]\nname = "b"\nset = ["episodes=1"]\n'
    with pytest.raises(ValueError, match="rows 'b' and 'a' have different episode seeds"):
        run_memory_bench(load_bench(bench_file(tmp_path, rows)))
    assert not (tmp_path / "runs" / "b").exists()
    path = bench_file(tmp_path, rows)  # compared to itself: nothing to pair
    path.write_text('compare_to = "b"\n' + path.read_text())
    with pytest.raises(ValueError, match="rows 'a' and 'b' have different episode seeds"):
        run_memory_bench(load_bench(path))


def test_compare_to_names_an_earlier_row(tmp_path):
    with pytest.raises(ValidationError, match="compare_to 'b' is not an earlier row"):
        load_bench(bench_file(tmp_path, '[[row]]\nname = "a"\ncompare_to = "b"\n[[row]]\nname = "b"\n'))
    path = bench_file(tmp_path, '[[row]]\nname = "a"\n')
    path.write_text('compare_to = "z"\n' + path.read_text())
    with pytest.raises(ValidationError, match="compare_to 'z' is not a row"):
        load_bench(path)


def test_replicate_sets_pool_each_variant_over_every_sets_questions():
    """Rows '<set>-<variant>' on disjoint questions, each compared to its set's full row: pooled, a
    variant's difference is over all the questions (paired within each set), each set's beside."""
    from compactrl.bench.memory import pooled, pooled_markdown

    def row(name, seeds, right, base=None, diff=None, peak=100.0):
        return {"row": name, "episode_seeds": seeds, "episode_correct": [1] * right + [0] * (40 - right),
                "mean_peak_live_kv": peak, "compared_to": base, "paired_diff": diff}  # fmt: skip

    a, b = list(range(0, 40)), list(range(100, 140))
    table = [row("a-full", a, 20), row("a-x", a, 30, "a-full", 0.25, 60.0),
             row("b-full", b, 10), row("b-x", b, 10, "b-full", 0.0, 50.0)]  # fmt: skip
    (x,) = pooled(table)
    assert x["variant"] == "x" and x["sets"] == ["a", "b"] and x["questions"] == 80
    assert x["accuracy"] == 40 / 80 and x["baseline_accuracy"] == 30 / 80
    assert x["paired_diff"] == pytest.approx(10 / 80) and x["per_set_diff"] == [0.25, 0.0]
    assert x["mcnemar_p"] == pytest.approx(2 / 2**10) and x["paired_diff_ci"][0] > 0  # 10 discordant, one way
    assert x["mean_peak_live_kv_ratio"] == pytest.approx(0.55)
    assert "x better" in pooled_markdown([x])
    table.append(row("a-y", a, 25, "a-full", 0.125, 80.0))  # a contrast x - y: only set a holds both
    (_, _, xy) = pooled(table, [("x", "y")])
    assert xy["variant"] == "x" and xy["baseline"] == "y" and xy["sets"] == ["a"] and xy["questions"] == 40
    assert xy["paired_diff"] == pytest.approx(5 / 40) and xy["per_set_diff"] == [pytest.approx(5 / 40)]
    assert xy["mean_peak_live_kv_ratio"] == pytest.approx(60 / 80)
    assert "no difference measured" in pooled_markdown([xy])
    table.pop()
    table[2]["episode_seeds"] = a  # the sets overlap: not replicates
    with pytest.raises(ValueError, match="different episode seeds|same questions"):
        pooled(table)


def test_contrasts_name_rows_or_with_pool_sets_variants(tmp_path):
    from compactrl.bench.memory import contrasted

    rows = '[[row]]\nname = "a-full"\n[[row]]\nname = "a-x"\n'
    path = bench_file(tmp_path, rows)
    path.write_text('contrasts = [["a-x", "a-full"]]\n' + path.read_text())
    assert load_bench(path).contrasts == [("a-x", "a-full")]
    path.write_text("pool_sets = true\n" + path.read_text())
    with pytest.raises(ValidationError, match=r"\['a-x', 'a-full'\] is not a variant; they are \['full'"):
        load_bench(path)
    table = [{"row": n, "episode_seeds": [1, 2, 3], "episode_correct": c, "mean_peak_live_kv": 10.0}
             for n, c in (("p", [1, 1, 0]), ("q", [0, 1, 0]))]
    (pq,) = contrasted(table, [("p", "q"), ("p", "absent")])
    assert (pq["variant"], pq["baseline"], pq["questions"]) == ("p", "q", 3)
    assert pq["paired_diff"] == pytest.approx(1 / 3) and pq["mcnemar_p"] == 1.0


def test_with_replicate_sets_each_set_is_compared_to_its_own_first_row(tmp_path):
    rows = "".join(f'[[row]]\nname = "{n}"\n' for n in ("a-full", "a-x", "b-full", "b-x"))
    path = bench_file(tmp_path, rows)
    path.write_text("pool_sets = true\n" + path.read_text())
    bench = load_bench(path)
    assert [bench.baseline(r) for r in bench.row] == [None, "a-full", None, "b-full"]
    plain = load_bench(bench_file(tmp_path, rows))  # without pool_sets: the bench's first row
    assert [plain.baseline(r) for r in plain.row] == [None, "a-full", "a-full", "a-full"]
