"""Benchmark hygiene (issue 12, items 11-14): onsets found exactly, every arm warmed and
interleaved, repeats with a spread, and the eviction cost measured with and without the lazy
row compaction. Behaviour only, no timings."""

import numpy as np

from compactrl.bench import trainer
from compactrl.bench.engine import evict_span, eviction_cost
from compactrl.engine import Engine, EngineConfig


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
