import numpy as np
import pytest

from compactrl.bench.synthetic import STRATEGIES, kept_per_compaction, synthetic_rollout
from compactrl.rl.forward import reprefill_segments


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_schedules_respect_budget_and_keep_a_constant_r(strategy):
    t = synthetic_rollout(strategy, 6000, budget=1024, turn_len=128)
    assert len(t) == 6000 and t.live_counts().max() <= 1024
    kept = kept_per_compaction(t)
    assert len(kept) >= 4 and len(set(kept)) == 1
    assert kept[0] == {"sliding_window": 1024 - 128, "markovian": 512, "summary": 128 + 64}[strategy]
    assert (t.evict_at[:128] == len(t)).all()  # the system prompt is protected
    assert np.array_equal(t.segment[1:] >= t.segment[:-1], np.ones(len(t) - 1, bool))
    segs = reprefill_segments(t)
    assert len(segs) == len(kept) + 1 and [s.num_kept for s in segs[1:]] == kept


def test_summary_tokens_are_trainable_and_survive_their_compaction():
    t = synthetic_rollout("summary", 4000)
    summary = np.array([r == "summary" for r in t.role])
    assert summary.any() and t.trainable[summary].all()
    first_event, evicted = t.eviction_events()[0]
    assert not summary[evicted].any() and t.evict_at[np.flatnonzero(summary)[0]] > first_event
