"""SideQuest's auxiliary thread (issue 16): a fork of the main thread names the cursors to delete;
its tokens never enter the main stream, and the deletions are evicted in place (stream) or
re-rendered away (reprefill). Episodes are demonstrations: the solver acts and the env's memory
oracle answers the auxiliary thread, both teacher-forced through the engine, so every token is
scored by the engine and checked against the trainer's one-pass forward."""

import asyncio

import numpy as np
import pytest
import torch

from compactrl.agent.batch import run_episodes, summarize
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import RolloutSettings
from compactrl.compaction import SideQuestConfig, build_strategy
from compactrl.compaction.sidequest import AuxThread, aux_answer, parse_deletions
from compactrl.engine import Engine
from compactrl.envs.browse import BrowseEnv
from compactrl.models.loading import load_model
from compactrl.models.tiny import write_tiny_model
from compactrl.rl.forward import full_context, stream_logprobs
from compactrl.trace import NO_CURSOR

SEEDS = [3, 4]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("m") / "m")
    engine = Engine.from_pretrained(folder)
    return engine, ChatFormat.from_tokenizer(engine.tokenizer), load_model(folder)


def make():
    return BrowseEnv(world_size=40, min_hops=3, max_hops=4)


def play(setup, mode, parallel=False, every=1, demo=True, seeds=SEEDS):
    engine, fmt, _ = setup
    strategy = build_strategy(SideQuestConfig(every=every, parallel=parallel)) if mode != "full" else None
    settings = RolloutSettings(max_tokens=64, max_turns=16)
    return asyncio.run(run_episodes(engine, fmt, make, strategy, mode, settings, seeds, 2, demo=demo))


def logprob_gap(model, trace, view=None) -> float:
    with torch.no_grad():
        (lp,) = stream_logprobs(model, [view or trace])
    m = trace.trainable
    return float(np.abs(lp.double().numpy()[m] - trace.logprobs[m]).max())


def test_the_answer_is_the_last_del_cursors_json():
    assert parse_deletions('Cursor 0 is stale.\n{"del_cursors": [2, 0, 2]}') == [0, 2]
    assert parse_deletions('{"del_cursors": [1]} then {"del_cursors": []}') == []
    for bad in ("", "delete 0", '{"del_cursors": [true]}', '{"del_cursors": [-1]}', '{"del_cursors": ["0"]}'):
        assert parse_deletions(bad) is None, bad
    assert parse_deletions(aux_answer([(3, "search", 2), (5, "open", 4)])) == [3, 5]
    thread = AuxThread("Memory management mode", 64, parallel=True)
    assert thread.split('{"del_cursors": [1, 4, 7]}', live={1, 2, 4}) == ([1, 4], [7])
    assert thread.split("no json", live={1}) == (None, [])


def test_sequential_deletions_evict_whole_cursors_and_the_aux_tokens_stay_out(setup):
    _, fmt, model = setup
    full = play(setup, "full")
    results = play(setup, "stream")
    for r, f in zip(results, full, strict=True):
        assert r.error is None and r.reward == 1.0 and r.aux_calls == r.turns - 1
        (t,) = r.traces
        assert np.array_equal(t.tokens, f.traces[0].tokens)  # the auxiliary threads wrote nothing here
        gone = set(t.cursor[t.evict_at < len(t)].tolist())
        assert NO_CURSOR not in gone and len(gone) == r.deleted_cursors > 0 and r.aux_parse_failures == 0
        for c in gone:  # a deleted cursor goes whole: its call and its output
            assert (t.evict_at[t.cursor == c] < len(t)).all()
        assert r.peak_live_kv < f.peak_live_kv
        for a in r.aux_traces:  # a fork: the main stream up to the boundary, then the thread's answer
            k = a.meta["fork_at"]
            assert np.array_equal(a.tokens[:k], t.tokens[:k]) and not a.trainable[:k].any()
            said = fmt.tokenizer.decode(a.tokens[a.trainable].tolist())
            assert parse_deletions(said) is not None
        assert max(logprob_gap(model, x) for x in [t, *r.aux_traces]) < 5e-5  # engine == trainer
        assert logprob_gap(model, t, full_context(t)) > 1e-3  # negative control: the deletions matter


def test_reprefill_renders_the_main_thread_again_without_the_deleted_cursors(setup):
    _, _, model = setup
    stream = play(setup, "stream")
    results = play(setup, "reprefill")
    for r, s in zip(results, stream, strict=True):
        assert r.reward == 1.0 and r.deleted_cursors == s.deleted_cursors
        assert len(r.traces) == r.compactions + 1 and r.reprefilled_tokens > 0
        gone = set(s.traces[0].cursor[s.traces[0].evict_at < len(s.traces[0])].tolist())
        assert not gone & set(r.traces[-1].cursor.tolist())
        assert max(logprob_gap(model, x) for x in r.traces + r.aux_traces) < 5e-5


def test_parallel_deletions_land_a_boundary_after_the_fork(setup):
    """In parallel the main thread acts while the thread runs: a deletion is applied at a later step
    boundary than the fork it was asked at, and never before the thread has answered."""
    _, _, model = setup
    results = play(setup, "stream", parallel=True, seeds=[3, 4, 5, 6])
    assert sum(r.deleted_cursors for r in results) > 0
    for r in results:
        (t,) = r.traces
        forks = sorted(a.meta["fork_at"] for a in r.aux_traces)
        for e in set(t.evict_at[t.evict_at < len(t)].tolist()):
            assert any(f < e for f in forks) and e not in forks  # applied later, not at a fork point
            assert t.trainable[[f for f in range(forks[0], e)]].any()  # the main thread acted meanwhile
        assert logprob_gap(model, t) < 5e-5


def test_an_unparsable_answer_deletes_nothing_and_is_counted(setup):
    results = play(setup, "stream", demo=False)  # a random model: neither calls nor JSON parse
    s = summarize(results)
    assert s["errors"] == 0 and s["aux_calls"] > 0 and s["aux_parse_failures"] == s["aux_calls"]
    assert s["deleted_cursors"] == 0 and s["evicted_tokens"] == 0
