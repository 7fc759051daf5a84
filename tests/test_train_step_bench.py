"""`bench train-step`: the re-prefill view of a stream rollout trains the same tokens, scored as
re-prefill mode scores them, from more forwarded tokens."""

import numpy as np
import torch

from compactrl.bench.train_step import run_train_step_bench, segment_traces
from compactrl.config import load_config
from compactrl.rl.forward import reprefill_logprobs, stream_logprobs
from compactrl.rl.loop import TrainConfig
from compactrl.rl.reference import random_eviction_stream

SMALL = ["prompts=1", "group_size=2", "env.n_rooms=8", "env.filler=4", "strategy.max_turns=3"]


def test_segment_traces_are_the_reprefill_samples(tiny_lm):
    trace = random_eviction_stream(3)
    segs = segment_traces(trace)
    assert len(segs) == len(trace.eviction_events()) + 1
    assert sum(int(s.trainable.sum()) for s in segs) == int(trace.trainable.sum())
    assert all(s.num_evicted == 0 for s in segs)
    with torch.no_grad():
        expected = reprefill_logprobs(tiny_lm, trace)
        got = torch.cat([lp[torch.as_tensor(s.trainable)] for s, lp in
                         zip(segs, stream_logprobs(tiny_lm, segs), strict=True)])  # fmt: skip
        stream = stream_logprobs(tiny_lm, [trace])[0]
    m = torch.as_tensor(trace.trainable)
    torch.testing.assert_close(got, expected[m], atol=5e-5, rtol=0)
    assert (stream[m] - expected[m]).abs().max() > 0.1  # negative control: the stream sees other KV


def test_bench_trains_the_same_tokens_from_more_forwarded_tokens(tmp_path):
    cfg = load_config(TrainConfig, "configs/train/rooms_window.toml", [f"out={tmp_path}", *SMALL])
    r = run_train_step_bench(cfg, repeats=1)
    assert r["compactions"] > 0 and r["reprefill_samples"] > r["stream_samples"] == 2
    assert r["reprefill_tokens"] > r["stream_tokens"] and np.isclose(
        r["token_ratio"], r["reprefill_tokens"] / r["stream_tokens"]
    )
    assert r["stream_s"] > 0 and r["reprefill_s"] > 0


def test_bench_splices_sidequest_forks_and_feeds_fewer_tokens_than_forks_apart(tmp_path):
    sets = ["mode=stream", "env.name=browse", "env.world_size=40", "strategy.name=sidequest",
            "strategy.every=1", "rollout.max_turns=6", "prompts=1", "group_size=2",
            f"out={tmp_path}"]  # fmt: skip
    r = run_train_step_bench(load_config(TrainConfig, None, sets), repeats=1)
    assert r["aux_threads"] > 0 and r["forks_apart_samples"] == r["stream_samples"] == 2 + r["aux_threads"]
    assert r["forks_apart_tokens"] > r["stream_tokens"]  # each fork's prefix fed again
    assert np.isclose(r["forks_token_ratio"], r["forks_apart_tokens"] / r["stream_tokens"])
    no_aux_cfg = load_config(TrainConfig, None, [*sets, "objective.train_aux=false"])
    no_aux = run_train_step_bench(no_aux_cfg, repeats=1)
    assert no_aux["aux_threads"] == 0 and "forks_apart_s" not in no_aux
