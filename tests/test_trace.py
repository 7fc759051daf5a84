import numpy as np
import pytest
from conftest import random_stream

from compactrl.trace import Trace, TraceError, load_traces, save_traces


def test_jsonl_round_trip(tmp_path):
    traces = [random_stream(s) for s in range(3)]
    traces[0].logprobs[traces[0].trainable] = -0.5
    traces[1].meta["env"] = "recall"
    save_traces(tmp_path / "t.jsonl", traces)
    back = load_traces(tmp_path / "t.jsonl")
    for a, b in zip(traces, back):
        for f in ("tokens", "evict_at", "trainable", "turn", "segment", "cursor"):
            assert np.array_equal(getattr(a, f), getattr(b, f))
        assert np.array_equal(np.isnan(a.logprobs), np.isnan(b.logprobs))
        assert np.allclose(np.nan_to_num(a.logprobs), np.nan_to_num(b.logprobs))
        assert a.role == b.role and a.rollout_id == b.rollout_id and a.meta == b.meta


def test_live_counts_and_visibility_follow_the_invariant():
    t = random_stream(4, T=80)
    for i in range(len(t)):
        brute = [j for j in range(i + 1) if i < t.evict_at[j]]
        assert t.visible(i).tolist() == brute
        assert t.live_counts()[i] == len(brute)
    evicted = sum(len(idx) for _, idx in t.eviction_events())
    assert evicted == t.num_evicted > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(evict_at=[1, 1, 3]), r"evict_at\[1\] = 1 is outside"),
        (dict(evict_at=[3, 4, 3]), r"evict_at\[1\] = 4"),
        (dict(trainable=[1, 0, 0]), "token 0 is marked trainable"),
        (dict(turn=[0, 1, 0]), "turn decreases at token 2"),
        (dict(role=["user", "bot", "user"]), "unknown role"),
        (dict(evict_at=[3, 3]), "evict_at has 2 entries but tokens has 3"),
        (dict(trainable=[0, 1, 1], logprobs=[0, 0.5, -1]), "positive"),
    ],
)
def test_validation_names_the_problem(kwargs, match):
    with pytest.raises(TraceError, match=match):
        Trace.from_tokens([5, 6, 7], **kwargs)


def test_bad_files_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    save_traces(p, [random_stream(0, T=20)])
    with p.open("a") as f:
        f.write(
            '{"tokens": [1, 2], "evict_at": [0, 2], "trainable": [0, 0], "role": ["user", "user"], '
            '"turn": [0, 0]}\n'
        )
        f.write("not json\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:2: .*evict_at\[0\]"):
        load_traces(p)
    p.write_text('{"tokens": [1], "colour": 3}\n')
    with pytest.raises(TraceError, match="unknown trace field"):
        load_traces(p)
    p.write_text('{"tokens": [1, 2], "evict_at": [2, 2], "trainable": [0, 1], "turn": [0, 0]}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: a trace record needs \['role'\]"):
        load_traces(p)  # a defaulted role would make the trainable token a user token
    with pytest.raises(TraceError, match="does not exist"):
        load_traces(tmp_path / "missing.jsonl")
