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
