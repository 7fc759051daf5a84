"""Tool outputs as cursors in the stream (issue 15): the browse env's cursor ids label each step's
tokens in the trace, and the cursor rules delete whole cursors, in place (stream) or by
re-prefilling the rest (reprefill). Episodes are the scripted solver's (SFT demonstrations, rendered
by the rollout runner as rollouts are)."""

import asyncio

import numpy as np
import pytest

from compactrl.agent.batch import run_episodes, summarize
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import NON_COMPLETION, RolloutSettings
from compactrl.compaction import (
    Context,
    DropOpenedSearchConfig,
    KeepLastCursorsConfig,
    RandomCursorsConfig,
    StepView,
    build_strategy,
)
from compactrl.compaction.cursors import cursor_steps
from compactrl.engine import Engine
from compactrl.envs.browse import BrowseEnv
from compactrl.models.tiny import write_tiny_model
from compactrl.trace import NO_CURSOR

SEEDS = [3, 4]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    engine = Engine.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("m") / "m"))
    return engine, ChatFormat.from_tokenizer(engine.tokenizer)


def make():
    return BrowseEnv(world_size=40, min_hops=3, max_hops=4)


def play(setup, strategy_cfg, mode):
    engine, fmt = setup
    strategy = build_strategy(strategy_cfg) if strategy_cfg is not None else None
    settings = RolloutSettings(max_tokens=64, max_turns=16)
    results = asyncio.run(run_episodes(engine, fmt, make, strategy, mode, settings, SEEDS, 2, demo=True))
    for r in results:
        assert r.error is None and r.reward == 1.0, r.error
    return results, fmt


def spans(trace) -> dict[int, np.ndarray]:
    """cursor id -> its token indices."""
    return {int(c): np.flatnonzero(trace.cursor == c) for c in set(trace.cursor.tolist()) - {NO_CURSOR}}


def test_every_step_with_a_tool_output_is_its_cursor(setup):
    results, fmt = play(setup, None, "full")
    for r in results:
        (t,) = r.traces
        cur = spans(t)
        assert sorted(cur) == list(range(len(cur))) and len(cur) == r.turns - 1  # every call but the answer
        for c, idx in cur.items():
            assert (np.diff(idx) == 1).all()  # one contiguous span: the call, then its output
            text = fmt.tokenizer.decode(t.tokens[idx].tolist())
            assert ("search(" in text or "open(" in text) and f"[Cursor {c}]" in text
            assert text.index("(") < text.index(f"[Cursor {c}]")  # the call comes before its output


def test_solver_traces_render_as_the_rollout_runner_renders_them(setup):
    """The SFT warm-up's full-context demonstrations (demo_trace) are token for token the episodes
    the rollout runner plays when the solver writes each call, trained tokens included."""
    from compactrl.rl.demos import demo_trace

    results, fmt = play(setup, None, "full")
    for r in results:
        (t,) = r.traces
        ref = demo_trace(fmt, make(), r.seed)
        assert np.array_equal(t.tokens, ref.tokens) and np.array_equal(t.trainable, ref.trainable)
        assert np.array_equal(t.role, ref.role) and r.info["correct"]
    other = demo_trace(fmt, make(), SEEDS[0] + 100)  # a negative control: another question differs
    assert not np.array_equal(other.tokens[: len(t)], t.tokens[: len(other)])


def test_keep_last_cursors_evicts_exactly_the_older_cursors_in_place(setup):
    results, _ = play(setup, KeepLastCursorsConfig(n=2), "stream")
    full, _ = play(setup, None, "full")
    for r, f in zip(results, full, strict=True):
        (t,) = r.traces
        assert (t.tokens == f.traces[0].tokens).all()  # the same stream: eviction renders nothing
        cur = spans(t)
        evicted = np.flatnonzero(t.evict_at < len(t))
        kept_cursors = sorted(cur)[-2:]
        assert set(t.cursor[evicted].tolist()) == set(cur) - set(kept_cursors)  # only whole old cursors
        for c, idx in cur.items():
            assert (t.evict_at[idx] < len(t)).all() == (c not in kept_cursors)
        assert r.compactions == len(cur) - 2 and r.reprefilled_tokens == 0


def test_random_cursor_deletion_at_rate_one_every_action_is_keep_the_newest(setup):
    """The random control's edges: rate 1 after every action deletes every cursor but the one about
    to be read (keep_last_cursors n = 1, token for token); rate 0 deletes nothing."""
    every, _ = play(setup, RandomCursorsConfig(rate=1.0, every=1), "stream")
    newest, _ = play(setup, KeepLastCursorsConfig(n=1), "stream")
    for r, k in zip(every, newest, strict=True):
        assert np.array_equal(r.traces[0].evict_at, k.traces[0].evict_at) and r.compactions > 0
    none, _ = play(setup, RandomCursorsConfig(rate=0.0, every=1), "stream")
    assert all(r.compactions == 0 and r.evicted_tokens == 0 for r in none)


def test_random_cursor_deletion_is_seeded_and_deletes_at_its_rate(setup):
    """At rate 0.5 the same seed deletes the same cursors, another seed others; over nine seeds
    between a quarter and three quarters of the cursors go; they go whole and engine == trainer."""
    import torch

    from compactrl.rl.forward import stream_logprobs

    def deleted(seed):
        results, _ = play(setup, RandomCursorsConfig(rate=0.5, every=1, seed=seed), "stream")
        return results, [sorted(set(r.traces[0].cursor[r.traces[0].evict_at < len(r.traces[0])].tolist()))
                         for r in results]  # fmt: skip

    (results, a), (_, again) = deleted(0), deleted(0)
    draws = [deleted(s)[1] for s in range(1, 9)]
    assert a == again and any(d != a for d in draws)
    offered = sum(len(spans(r.traces[0])) - 1 for r in results)  # every cursor but the last is offered
    gone = [sum(map(len, d)) for d in [a, *draws]]
    assert 0.25 < sum(gone) / (len(gone) * offered) < 0.75
    model = setup[0].model
    for r in results:
        (t,) = r.traces
        for idx in spans(t).values():
            assert len(set((t.evict_at[idx] < len(t)).tolist())) == 1  # whole or not at all
        with torch.no_grad():
            (lp,) = stream_logprobs(model, [t])
        assert np.abs(lp.double().numpy()[t.trainable] - t.logprobs[t.trainable]).max() < 5e-5


def test_reprefill_renders_the_kept_cursors_again_without_the_deleted_ones(setup):
    stream, _ = play(setup, KeepLastCursorsConfig(n=2), "stream")
    results, _ = play(setup, KeepLastCursorsConfig(n=2), "reprefill")
    for r, s in zip(results, stream, strict=True):
        assert r.segments == len(r.traces) == r.compactions + 1 and r.reprefilled_tokens > 0
        last, (st,) = r.traces[-1], s.traces
        live = spans(st)
        for c in sorted(spans(last)):  # the last segment holds the last cursors, labelled as in the stream
            assert (last.tokens[last.cursor == c] == st.tokens[live[c]]).all()
        assert sorted(spans(last)) == sorted(live)[-2:]


def test_drop_opened_search_deletes_a_search_once_a_link_from_it_is_opened(setup):
    results, fmt = play(setup, DropOpenedSearchConfig(), "stream")
    for r in results:
        (t,) = r.traces
        for idx in spans(t).values():
            search = "Search results" in fmt.tokenizer.decode(t.tokens[idx].tolist())
            assert (t.evict_at[idx] < len(t)).all() == search  # the solver opens from every search


def test_a_cursor_that_is_not_live_is_named():
    ctx = Context([StepView(0, 10, "", cursor=0), StepView(1, 10, "", cursor=2)], 5, 0, 2, 1, "")
    assert cursor_steps(ctx, [2]) == [1]
    with pytest.raises(ValueError, match=r"cursor\(s\) \[1\] are not live; live cursors: \[0, 2\]"):
        cursor_steps(ctx, [1, 2])


def test_the_summary_reports_accuracy_and_non_completion_by_cause(setup):
    solved, _ = play(setup, KeepLastCursorsConfig(n=2), "stream")
    s = summarize(solved)
    assert s["accuracy"] == 1.0 and s["non_completion"] == dict.fromkeys(NON_COMPLETION, 0.0)
    # a random model's calls do not parse: error observations until the turn limit, no crash
    engine, fmt = setup
    settings = RolloutSettings(max_tokens=16, max_turns=3)
    sampled = asyncio.run(run_episodes(engine, fmt, make, None, "stream", settings, SEEDS, 2))
    s = summarize(sampled)
    assert s["errors"] == 0 and s["accuracy"] == 0.0 and s["non_completion"]["turn_limit"] == 1.0
    assert all(r.info["error"] in ("malformed", "unknown_tool") and r.info["cursor"] is None for r in sampled)
    assert all(
        r.info["malformed_calls"] == 3 and r.info["hops"] >= 3 for r in sampled
    )  # counted at the limit
