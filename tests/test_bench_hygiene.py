"""Benchmark hygiene (issue 12, items 11-14): onsets found exactly, every arm warmed and
interleaved, repeats with a spread, and the eviction cost measured with and without the lazy
row compaction. Behaviour only, no timings."""

from types import SimpleNamespace

import numpy as np

from compactrl.agent.rollout import EpisodeResult, RolloutSettings
from compactrl.bench import modes, trainer
from compactrl.bench.engine import evict_span, eviction_cost
from compactrl.compaction import SlidingWindow
from compactrl.engine import Engine, EngineConfig
from compactrl.envs.rooms import RoomsEnv
from compactrl.models.tiny import write_tiny_model


def test_eviction_cost_measures_an_eviction_that_compacts_the_row(tiny_lm):
    eng = Engine(tiny_lm, None, EngineConfig(kv_pool_tokens=1024))
    s = eng.session()
    s.append(np.random.default_rng(0).integers(3, 300, 160).tolist())
    eng.run()
    row, holes = s.row, []
    for a in range(1, 160, 4):
        _, compacted = evict_span(eng, s, a, 4)
        if compacted:
            break
        holes.append(eng.kv.dead[row])
    # the evictions before it only left holes (below the threshold); this one moved the live entries up
    assert compacted and holes and holes == list(range(4, 4 * len(holes) + 1, 4))
    assert holes[-1] <= max(32, eng.config.compact_holes * 160) < holes[-1] + 4
    assert eng.kv.dead[row] == 0 and eng.kv.used[row] == s.live == 160 - 4 * (len(holes) + 1)
    assert bool(eng.kv.valid[row, : s.live].all()) and not bool(eng.kv.valid[row, s.live :].any())

    e = eviction_cost(tiny_lm, 160, sessions=2)
    assert e["compactions"] == 2 and e["evict_compact_s"] > 0 and e["evict_s"] > 0
    assert 0 < e["compacted_live_entries"] < 160
    short = eviction_cost(tiny_lm, 16, sessions=1)  # too few tokens to pass the threshold: none
    assert short["compactions"] == 0 and short["evict_compact_s"] is None


def test_trainer_bench_warms_every_arm_once_and_interleaves_them(tiny_lm, monkeypatch):
    calls = []

    def record(arm):
        def fake(model, trace, *args):
            calls.append(arm if arm == "reprefill" or len(trace) == 512 else "stream_2n")
            return len(trace)

        return fake

    monkeypatch.setattr(trainer, "stream_step", record("stream"))
    monkeypatch.setattr(trainer, "reprefill_step", record("reprefill"))
    row = trainer.bench_strategy(
        tiny_lm, "sliding_window", 512, budget=256, turn_len=32, repeats=3, chunk=64, max_batch_tokens=1024
    )
    assert calls == ["stream", "reprefill", "stream_2n"] * 4  # a warm-up round, then 3 timed rounds
    assert {arm: len(ts) for arm, ts in row["runs_s"].items()} == dict.fromkeys(
        ("stream", "reprefill", "stream_2n"), 3
    )


def test_bisected_onsets_follow_the_kv_demand_and_the_full_mode_prediction(tmp_path):
    """Real engine, tiny task: the smallest concurrency that preempts, bisected from a coarse sweep,
    is where the episodes' KV demand passes the pool. Full episodes (no holes) peak together at
    their last turn, so it is pool // (peak footprint) + 1 exactly; a stream row's footprint counts
    its holes too, which the peak live KV leaves out, so that is only the earliest onset there."""
    folder = write_tiny_model(tmp_path / "model", size="tiny")
    make = lambda: RoomsEnv(n_rooms=8, filler=4, action_tokens=4)  # noqa: E731
    settings = RolloutSettings(max_tokens=4, max_turns=9, ignore_eos=True)
    _, results, _ = modes._run(folder, make, SlidingWindow(), "full", settings, [0], 1, 1 << 20)
    pool = int(2.5 * results[0].peak_live_kv)
    window = SlidingWindow(max_turns=2, stride=1)

    def probe(mode, c, pool):
        run = modes._run(folder, make, window, mode, settings, list(range(c)), c, pool, demand=True)
        return modes._totals(*run)

    found = modes.sweep_onsets(probe, ("full", "stream"), (1, 2, 16), pool)
    for mode, o in found["onsets"].items():
        levels = {p["concurrency"]: p["preemptions"] > 0 for p in found["points"][mode]}
        assert levels[o["measured"]] and not levels[o["measured"] - 1], (mode, o)  # bisected exactly
        assert o["demand_below_onset"] <= pool < o["demand_at_onset"], (mode, o)
        assert o["predicted"] == pool // o["peak_kv_per_episode"] + 1 <= o["measured"], (mode, o)
    full, stream = found["onsets"]["full"], found["onsets"]["stream"]
    assert full["measured"] == full["predicted"] == 3
    # no holes in full mode (the footprint lacks only the last turn's closing tokens, never fed)
    assert 0 <= full["peak_live_kv_per_episode"] - full["peak_kv_per_episode"] < 8
    assert stream["bisected_at"] and stream["peak_kv_per_episode"] > stream["peak_live_kv_per_episode"]


def test_modes_bench_repeats_every_run_in_interleaved_rounds(monkeypatch, tmp_path):
    """The runs of part 1 take turns in every round (reversed every other round), each arm reports
    its median with min and max, and the ratio its per-round values; the sweep's onsets are
    bisected (a fake run: c episodes preempt when c x peak footprint > pool)."""
    calls = []

    def fake_run(folder, make_env, cfg, mode, settings, seeds, concurrency, pool, demand=False):
        calls.append((cfg.name, mode, concurrency))
        peak = {"full": 100, "reprefill": 50, "stream": 12}[mode]
        results = [EpisodeResult(i, s, "rooms", mode, cfg.name) for i, s in enumerate(seeds)]
        for r in results:
            r.peak_live_kv = peak if mode != "stream" else 10
            r.preemptions = int(concurrency * peak > pool)
        book = SimpleNamespace(peak_kv={r.seed: peak for r in results}, peak_pool=concurrency * peak)
        engine = SimpleNamespace(book=book)
        return 1.0 + 0.1 * len(calls), results, engine if demand else None

    monkeypatch.setattr(modes, "_run", fake_run)
    monkeypatch.setattr(modes, "write_tiny_model", lambda folder, size: write_tiny_model(tmp_path / "m"))
    result = modes.run_modes_bench(strategies=("sliding_window", "markovian"), plots=None)
    assert result["repeats"] == 3  # the default: a spread to report
    arms = [("sliding_window", "full")] + [(s, m) for s in ("sliding_window", "markovian")
                                           for m in ("reprefill", "stream")]  # fmt: skip
    part1 = [(name, mode) for name, mode, c in calls[1 : 1 + 3 * len(arms)]]
    assert part1 == arms + arms[::-1] + arms
    row = result["strategies"][0]
    assert len(row["wallclock_ratio_rounds"]) == 3 and len(row["stream"]["wall_s_runs"]) == 3
    assert row["stream"]["wall_s_min"] <= row["stream"]["wall_s"] <= row["stream"]["wall_s_max"]
    assert row["wallclock_ratio_min"] <= row["wallclock_ratio_max"]
    c = result["concurrency"]  # pool 250: full preempts from 3 (3 x 100), stream from 21 (21 x 12)
    assert c["pool_tokens"] == 250 and "2.5 x" in c["pool_sizing"]
    assert c["preemption_onset"] == c["predicted_onset"] == {"full": 3, "stream": 21}
    stream = c["onsets"]["stream"]
    assert stream["coarse"] == 24 and stream["bisected_at"] == [20, 22, 21]
    assert stream["predicted_from_live_kv"] == 26
    assert (stream["demand_below_onset"], stream["demand_at_onset"]) == (240, 252)
    assert c["concurrency_ratio"] == 7.0
