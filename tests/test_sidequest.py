"""SideQuest's auxiliary thread (issue 16): a fork of the main thread names the cursors to delete;
its tokens never enter the main stream, and the deletions are evicted in place (stream) or
re-rendered away (reprefill). Episodes are demonstrations: the solver acts and the env's memory
oracle answers the auxiliary thread, both teacher-forced through the engine, so every token is
scored by the engine and checked against the trainer's one-pass forward."""

import asyncio
import copy
import json

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
from compactrl.masks import dense_mask, pack, streams
from compactrl.models.decoder import token_logprobs
from compactrl.models.loading import load_model
from compactrl.models.tiny import write_tiny_model
from compactrl.plot import load_metrics
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


def play(setup, mode, parallel=False, every=1, demo=True, seeds=SEEDS, **sidequest):
    engine, fmt, _ = setup
    cfg = SideQuestConfig(every=every, parallel=parallel, **sidequest)
    strategy = build_strategy(cfg) if mode != "full" else None
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
    bad_json = ('{"del_cursors": [1, ]}', '{"del_cursors": [1 2]}', '{"del_cursors": [0x1]}')  # sampled
    for bad in ("", "delete 0", '{"del_cursors": [true]}', '{"del_cursors": [-1]}', '{"del_cursors": ["0"]}',
                *bad_json):  # fmt: skip
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
        assert r.peak_live_kv < f.peak_live_kv and f.peak_kv_with_threads == f.peak_live_kv
        # the main thread waits while its thread runs: the episode's peak is its longest fork's
        thread_peaks = [int((a.evict_at >= len(a)).sum()) for a in r.aux_traces]
        assert r.peak_kv_with_threads == max(thread_peaks) > r.peak_live_kv and r.aux_kv_reads > 0
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
        # both threads hold KV at once: the episode holds at least what each one does
        assert r.peak_kv_with_threads >= max(
            [r.peak_live_kv, *(int((a.evict_at >= len(a)).sum()) for a in r.aux_traces)]
        )
        for e in set(t.evict_at[t.evict_at < len(t)].tolist()):
            assert any(f < e for f in forks) and e not in forks  # applied later, not at a fork point
            assert t.trainable[[f for f in range(forks[0], e)]].any()  # the main thread acted meanwhile
        assert logprob_gap(model, t) < 5e-5


class SlowBrowse(BrowseEnv):
    """The same worlds, each tool call taking 50 ms more (a slow tool, or a busy machine)."""

    def step(self, action):
        import time

        time.sleep(0.05)
        return super().step(action)


def test_where_a_parallel_threads_deletions_land_does_not_depend_on_machine_speed(setup):
    """The same config and seeds give the same streams, evictions included, whether the tools answer
    at once or slowly: the thread's answer lands at a boundary set by a token clock."""
    engine, fmt, _ = setup
    strategy = build_strategy(SideQuestConfig(every=1, parallel=True))
    settings = RolloutSettings(max_tokens=64, max_turns=16)
    rows = []
    for env in (make, lambda: SlowBrowse(world_size=40, min_hops=3, max_hops=4)):
        played = run_episodes(engine, fmt, env, strategy, "stream", settings, [3, 4, 5, 6], 4, demo=True)
        rows.append(asyncio.run(played))
    assert sum(r.deleted_cursors for r in rows[0]) > 0
    for fast, slow in zip(*rows, strict=True):
        assert np.array_equal(fast.traces[0].evict_at, slow.traces[0].evict_at)
        assert fast.aux_unfinished == slow.aux_unfinished


def beside_whole_deletions(setup, mode, **kept):
    """Each episode played with ``kept`` (what a deletion leaves), beside the same episode deleting
    cursors whole in stream mode: it solves, deletes the same cursors, and engine == trainer."""
    model = setup[2]
    for r, w in zip(play(setup, mode, **kept), play(setup, "stream"), strict=True):
        assert r.reward == 1.0 and r.deleted_cursors == w.deleted_cursors > 0
        assert max(logprob_gap(model, x) for x in r.traces + r.aux_traces) < 5e-5
        yield r, w


@pytest.mark.parametrize("mode", ["stream", "reprefill"])
def test_keep_calls_deletes_a_cursors_output_and_keeps_its_call(setup, mode):
    """keep_calls: the thread deletes what it would delete whole, but only the tool outputs go; the
    calls stay in the main thread (stream: not evicted; reprefill: rendered again), engine ==
    trainer; what stays live is the whole deletion's plus the kept calls."""
    _, fmt, model = setup
    for r, w in beside_whole_deletions(setup, mode, keep_calls=True):
        if mode == "reprefill":  # the last segment holds every call and no deleted output
            last, (s,) = r.traces[-1], w.traces
            gone = set(s.cursor[s.evict_at < len(s)].tolist())
            said = [x.tokens[np.array(x.role) == "assistant"].tolist() for x in (last, s)]
            assert fmt.tokenizer.decode(said[0]) == fmt.tokenizer.decode(said[1])
            assert len(last) < len(s) and gone
            continue
        (t,), role = r.traces, np.array(r.traces[0].role)
        assert np.array_equal(t.tokens, w.traces[0].tokens)
        gone = set(t.cursor[t.evict_at < len(t)].tolist())
        assert gone == set(w.traces[0].cursor[w.traces[0].evict_at < len(t)].tolist())
        for c in gone:
            assert (t.evict_at[(t.cursor == c) & (role == "user")] < len(t)).all()  # the output went
            assert (t.evict_at[(t.cursor == c) & (role == "assistant")] == len(t)).all()  # the call stayed
        calls = sum(int(((t.cursor == c) & (role == "assistant")).sum()) for c in gone)
        live, whole_live = (int((x.evict_at == len(x)).sum()) for x in (t, w.traces[0]))
        assert live == whole_live + calls and r.peak_live_kv >= w.peak_live_kv  # the calls cost their tokens
        assert logprob_gap(model, t, full_context(t)) > 1e-3  # negative control


@pytest.mark.parametrize("mode", ["stream", "reprefill"])
def test_keep_titles_leaves_each_deleted_outputs_first_line(setup, mode):
    """keep_titles: the thread deletes what it would delete whole, but each deleted output's first
    line ("[Cursor c] <title>") stays in the main thread (stream: not evicted; reprefill: rendered
    again); engine == trainer; what stays live is the whole deletion's plus those lines."""
    _, fmt, model = setup
    for r, w in beside_whole_deletions(setup, mode, keep_titles=True):
        (s,) = w.traces
        gone = sorted(set(s.cursor[s.evict_at < len(s)].tolist()))
        if mode == "reprefill":  # the last segment still shows every deleted output's title line
            text = fmt.tokenizer.decode(r.traces[-1].tokens.tolist())
            for c in gone:
                assert f"[Cursor {c}]" in text
            assert len(r.traces[-1]) < len(s)
            continue
        (t,) = r.traces
        assert np.array_equal(t.tokens, s.tokens)
        kept = (t.evict_at == len(t)) & (s.evict_at < len(s))  # deleted whole there, live here
        lines = [x for x in fmt.tokenizer.decode(t.tokens[kept].tolist()).splitlines() if x.strip()]
        assert len(lines) == len(gone)  # one line per deleted cursor, and it is its first line
        for c, line in zip(gone, lines, strict=True):
            assert line.lstrip().startswith(f"[Cursor {c}]")
            first = fmt.tokenizer.decode(s.tokens[(s.cursor == c) & (np.array(s.role) == "user")].tolist())
            assert line.strip() == first.split("\n")[1].strip()  # (line 0 is the chat header)
        assert (t.cursor[kept] == NO_CURSOR).all()  # a title is no part of what its cursor's deletion removes
        live, whole_live = (int((x.evict_at == len(x)).sum()) for x in (t, s))
        assert live == whole_live + int(kept.sum()) and r.peak_live_kv >= w.peak_live_kv
        assert logprob_gap(model, t, full_context(t)) > 1e-3  # negative control


def name_every_cursor(monkeypatch):
    """Threads that name cursors 0-40, open or not, seen or not (the runner must sort them out)."""
    import compactrl.agent.compactors as compactors

    monkeypatch.setattr(compactors, "aux_answer", lambda info: json.dumps({"del_cursors": list(range(41))}))


def deleted_whole(t) -> bool:
    """Every cursor's tokens (its call and its output) are all evicted, or none is: nothing orphaned."""
    cursors = set(t.cursor.tolist()) - {NO_CURSOR}
    return all(len(set((t.evict_at[t.cursor == c] < len(t)).tolist())) == 1 for c in cursors)


def test_a_parallel_thread_deletes_only_cursors_it_saw_open_at_its_fork(setup, monkeypatch):
    """A thread forked before cursor c was made, whose answer names c, must not delete it: c is
    counted as unseen, and every cursor a thread deletes had its output in before that fork."""
    name_every_cursor(monkeypatch)
    results = play(setup, "stream", parallel=True, seeds=[3, 4, 5, 6])
    assert sum(r.aux_unseen_cursors for r in results) > 0 and sum(r.deleted_cursors for r in results) > 0
    for r in results:
        (t,) = r.traces
        assert r.error is None and deleted_whole(t)
        forks = sorted(a.meta["fork_at"] for a in r.aux_traces)
        for e in set(t.evict_at[t.evict_at < len(t)].tolist()):
            fork = max(f for f in forks if f < e)  # one thread in flight at a time: the latest fork
            gone = set(t.cursor[t.evict_at == e].tolist())
            for c in gone:
                assert np.flatnonzero(t.cursor == c).max() < fork  # its call and output before the fork
        assert logprob_gap(setup[2], t) < 5e-5


@pytest.mark.parametrize("keep_calls", [False, True])
def test_a_thread_forked_after_the_call_never_deletes_the_cursor_whose_output_is_pending(
    setup, monkeypatch, keep_calls
):
    """at = "call": the newest cursor's output has not landed at the fork. A thread naming it leaves
    it (counted as unseen) instead of deleting the call and orphaning the output that follows."""
    name_every_cursor(monkeypatch)
    for r in play(setup, "stream", at="call", keep_calls=keep_calls):
        (t,) = r.traces
        assert r.error is None and r.reward == 1.0
        assert r.aux_unseen_cursors == r.aux_calls > 0 and r.deleted_cursors > 0  # the pending one, each call
        if keep_calls:  # outputs go whole, calls stay
            role = np.array(t.role)
            for c in set(t.cursor[t.evict_at < len(t)].tolist()):
                assert (t.evict_at[(t.cursor == c) & (role == "user")] < len(t)).all()
        else:
            assert deleted_whole(t)
        assert logprob_gap(setup[2], t) < 5e-5


@pytest.mark.parametrize("at", ["output", "call"])
def test_keep_unread_never_deletes_an_output_no_action_has_read(setup, monkeypatch, at):
    """A thread that names every open cursor: with keep_unread the output of the action it was
    called after survives (counted), so every cursor outlives the action after the one that made
    it; without, that output goes before any action read it (the negative control)."""
    from compactrl.agent.hindsight import actions_of

    monkeypatch.setattr(BrowseEnv, "demo_deletions", lambda self, live: list(live))

    def read_before_deleted(r) -> bool:
        (t,) = r.traces
        acts = actions_of(t)
        for a, after in zip(acts, acts[1:]):
            gone = t.evict_at[t.cursor == a.cursor] if a.cursor is not None else np.array([])
            if len(gone) and gone.min() <= after.end:
                return False
        return True

    kept = play(setup, "stream", keep_unread=True, at=at)
    bare = play(setup, "stream", at=at)
    for k, b in zip(kept, bare, strict=True):
        assert b.aux_kept_unread == 0 and read_before_deleted(k)
        if at == "output":
            assert k.aux_kept_unread == k.aux_calls > 0 and not read_before_deleted(b)
        else:  # the unread output is not in at the fork: no thread can delete it, kept or not
            assert k.aux_kept_unread == 0 and read_before_deleted(b)


def test_an_unparsable_answer_deletes_nothing_and_is_counted(setup):
    results = play(setup, "stream", demo=False)  # a random model: neither calls nor JSON parse
    s = summarize(results)
    assert s["errors"] == 0 and s["aux_calls"] > 0 and s["aux_parse_failures"] == s["aux_calls"]
    assert s["deleted_cursors"] == 0 and s["evicted_tokens"] == 0 and s["aux_unfinished"] == 0
    # in parallel, a thread still writing when its episode ends is counted apart, never dropped
    s = summarize(play(setup, "stream", demo=False, parallel=True))
    assert s["aux_parse_failures"] + s["aux_unfinished"] == s["aux_calls"] > 0 and s["deleted_cursors"] == 0


# ---- hindsight labels -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "at, keep_calls, keep_titles",
    [(a, k, False) for k in (False, True) for a in ("output", "call")]
    + [("output", False, True), ("call", True, True)],
)
def test_hindsight_labels_equal_the_runners_sequential_demonstrations(setup, at, keep_calls, keep_titles):
    """The labeller on a full-context solver trace, with D = what expired at earlier calls, builds
    the runner's sequential SideQuest forks token for token, mask for mask, trained tokens included;
    so does it on the SideQuest stream itself (what earlier calls deleted is already out of it);
    forked after the tool's output or after the call, before its output; D deleted whole or
    (keep_calls) its outputs only, and (keep_titles) less each output's first line."""
    import random

    from compactrl.rl.sidequest import hindsight_samples

    _, fmt, _ = setup
    label = dict(split="history", at=at, keep_calls=keep_calls, keep_titles=keep_titles)
    for every in (1, 2):
        full = play(setup, "full", every=every)
        seq = play(
            setup,
            "stream",
            every=every,
            at=at,
            keep_calls=keep_calls,
            keep_unread=keep_calls,
            keep_titles=keep_titles,
        )
        for f, s in zip(full, seq, strict=True):
            samples = hindsight_samples(f.traces[0], fmt, every, random.Random(0), **label)
            again = hindsight_samples(s.traces[0], fmt, every, random.Random(0), **label)
            assert len(samples) == len(again) == len(s.aux_traces) == s.aux_calls > 0
            for x, a in [*zip(samples, s.aux_traces, strict=True), *zip(again, s.aux_traces, strict=True)]:
                assert np.array_equal(x.tokens, a.tokens) and np.array_equal(x.evict_at, a.evict_at)
                assert np.array_equal(x.trainable, a.trainable) and x.role == a.role
                assert np.array_equal(x.turn, a.turn)
            said = [x.meta for x in samples]
            assert any(m["deleted"] for m in said) and any(m["target"] for m in said)  # both parts used
            if keep_titles:  # negative control: a labeller that deletes the titles too builds other masks
                untitled = label | {"keep_titles": False}
                bare = hindsight_samples(f.traces[0], fmt, every, random.Random(0), **untitled)
                assert any(not np.array_equal(x.evict_at, a.evict_at) for x, a in zip(bare, s.aux_traces))


def hand_made_trace():
    """system+task, then 3 tool calls (cursors 0, 1, 2; each opens from the one before) and an
    answer citing cursor 2: three tokens per message."""
    from compactrl.trace import Trace

    turns = np.repeat(np.arange(10), 3)  # turn 0 system, 1 task, 2.. action/observation pairs
    cursor = np.full(30, -1)
    for c in range(3):
        cursor[6 + 6 * c : 12 + 6 * c] = c
    role = ["system"] * 3 + ["user"] * 3 + (["assistant"] * 3 + ["user"] * 3) * 4
    facts = [[8, 0, [], "search"], [14, 1, [0], "open"], [20, 2, [1], "open"], [26, None, [2], "answer"]]
    return Trace.from_tokens(np.arange(30) + 5, turn=turns, cursor=cursor, role=role,
                             meta={"action_facts": facts})  # fmt: skip


def test_last_use_expiry_and_calls_on_a_hand_made_trace():
    from compactrl.agent.hindsight import actions_of, aux_calls, boundary, fork_point, last_use

    t = hand_made_trace()
    acts = actions_of(t)
    assert last_use(acts) == {0: 2, 1: 3, 2: 4}  # read by the next action, cited by the answer
    assert aux_calls(4, 1) == [2, 3, 4] and aux_calls(4, 2) == [3] and aux_calls(4, 4) == []
    assert [boundary(t, a) for a in acts] == [6, 12, 18, 24]
    assert [fork_point(t, acts, n) for n in (2, 3, 4)] == [12, 18, 24]  # after the output of n - 1
    assert [fork_point(t, acts, n, "call") for n in (2, 3, 4)] == [9, 15, 21]  # after its call
    with pytest.raises(ValueError, match="no meta\\['action_facts'\\]"):
        actions_of(type(t).from_tokens([1, 2]))


def test_the_split_masks_d_from_the_input_and_asks_for_s(setup):
    import random

    from compactrl.rl.sidequest import hindsight_samples

    _, fmt, _ = setup
    t = hand_made_trace()
    s2, s3, s4 = hindsight_samples(t, fmt, 1, random.Random(0), split="history")
    assert (s2.meta["deleted"], s2.meta["target"]) == ([], [])  # nothing expired before action 2
    assert (s3.meta["deleted"], s3.meta["target"]) == ([], [0])
    assert (s4.meta["deleted"], s4.meta["target"]) == ([0], [1])
    T = len(s4)
    assert (s4.evict_at[6:12] == 18).all()  # cursor 0, deleted at the call it expired at (action 3)
    assert (s4.evict_at[12:] == T).all() and (s4.evict_at[:6] == T).all()
    said = fmt.tokenizer.decode(s4.tokens[s4.trainable].tolist())
    assert said.startswith("Cursor 1 is a page, last used at action 3") and '{"del_cursors": [1]}' in said
    assert not s4.trainable[: 24 + 1].any() and s4.trainable[-1]  # only the answer is trained
    assert parse_deletions(fmt.tokenizer.decode(s2.tokens[s2.trainable].tolist())) == []
    seen = set()
    for seed in range(40):  # the paper's random split: D and S partition the expired set
        s = hindsight_samples(t, fmt, 1, random.Random(seed))[2]
        d, keep = s.meta["deleted"], s.meta["target"]
        assert sorted(d + keep) == [0, 1] and not set(d) & set(keep)
        for c in d:  # D is out of the input: nothing after its deletion point reads it
            assert (s.evict_at[:24][t.cursor[:24] == c] <= 24).all()
        for c in keep:
            assert (s.evict_at[:24][t.cursor[:24] == c] == len(s)).all()
        seen.add(tuple(sorted(d)))
    assert seen == {(), (0,), (1,), (0, 1)}


# ---- the objective ------------------------------------------------------------------------------------
def test_step_parts_accumulate_the_scaled_sum_of_the_parts(setup):
    from compactrl.rl.trainer import Sample, Trainer, TrainSettings

    _, _, model = setup
    full = play(setup, "full")
    a = [Sample(r.traces[0], np.zeros(len(r.traces[0]), np.float32), i) for i, r in enumerate(full)]
    aux = play(setup, "stream")[0].aux_traces
    b = [Sample(x, np.zeros(len(x), np.float32), i) for i, x in enumerate(aux)]
    trainer = Trainer(model, TrainSettings(lr=1e-3))

    def grads():
        return [p.grad.clone() for p in trainer.params]

    trainer.backward(a, "sft")
    ga = grads()
    trainer.backward(b, "sft")
    gb = grads()
    trainer.backward(a, "sft")
    trainer.backward(b, "sft", scale=3.0, zero=False)
    for g, x, y in zip(grads(), ga, gb, strict=True):
        torch.testing.assert_close(g, x + 3 * y, rtol=1e-5, atol=1e-6)
    assert any((x - y).abs().max() > 1e-6 for x, y in zip(ga, gb, strict=True))  # the parts differ


def test_the_sidequest_objective_learns_the_thread_and_stays_near_the_reference(tmp_path):
    from compactrl.config import load_config
    from compactrl.rl.loop import TrainConfig, train

    sets = [f"out={tmp_path}", "steps=12", "prompts=2", "threads=1", "model.path=", "model.size=tiny",
            "env.world_size=40", "env.max_hops=3", "strategy.every=1", "train.lora=", "train.lr=3e-3",
            "objective.kl=5.0", "checkpoint_every=6"]  # fmt: skip
    cfg = load_config(TrainConfig, "configs/sidequest/train.toml", sets)
    train(cfg)
    rows = load_metrics(tmp_path)
    assert all(r["phase"] == "sidequest" and r["aux_samples"] > 0 and r["correct"] == 1.0 for r in rows)
    assert np.mean([r["aux_ce"] for r in rows[-3:]]) < 0.5 * np.mean([r["aux_ce"] for r in rows[:3]])
    assert rows[0]["main_kl"] < 1e-6 and all(r["main_kl"] >= 0 for r in rows)  # it starts at the reference
    assert max(r["main_kl"] for r in rows) > 0  # and the KL term sees the drift
    assert (tmp_path / "reference" / "config.json").is_file()
    with pytest.raises(ValueError, match="strategy.name = 'sidequest'"):
        load_config(TrainConfig, "configs/sidequest/train.toml", [*sets[:7], "strategy="])


def test_deletion_scores_against_the_hindsight_labels(setup):
    """The memory oracle deletes exactly the expired cursors: precision and recall 1. A thread that
    names every live cursor keeps its recall and loses precision."""
    import copy

    from compactrl.agent.hindsight import deletion_scores

    for r in play(setup, "stream"):
        s = deletion_scores(r.traces[0], r.aux_traces)
        assert s["calls"] == r.aux_calls
        assert s["named"] == s["expired"] == s["correct"] == r.deleted_cursors > 0
        greedy = copy.deepcopy(r.aux_traces)
        for x in greedy:
            x.meta["named"] = list(range(20))
        g = deletion_scores(r.traces[0], greedy)
        assert g["correct"] == s["correct"] and g["named"] > g["correct"]
    for r in play(setup, "stream", keep_calls=True):  # a kept call does not hold its cursor open
        s = deletion_scores(r.traces[0], r.aux_traces)
        assert s["named"] == s["expired"] == s["correct"] == r.deleted_cursors > 0
        for x in r.aux_traces:
            x.meta["keep_calls"] = False  # negative control: judged by the calls, deleted cursors look open
        assert deletion_scores(r.traces[0], r.aux_traces)["expired"] > s["expired"]


def test_a_thread_still_running_when_its_episode_ends_is_flagged_and_not_scored(setup):
    """A parallel thread whose answer was not due before the episode ended deleted nothing: its trace
    is kept, flagged ``unfinished``, counted, and left out of the deletion scores."""
    from compactrl.agent.hindsight import deletion_scores

    results = play(setup, "stream", parallel=True, seeds=[3, 4, 5, 6])
    assert sum(r.aux_unfinished for r in results) > 0
    for r in results:
        flagged = [x for x in r.aux_traces if x.meta.get("unfinished")]
        assert len(flagged) == r.aux_unfinished and len(r.aux_traces) == r.aux_calls
        s = deletion_scores(r.traces[0], r.aux_traces)
        assert s["calls"] == r.aux_calls - r.aux_unfinished
        for x in flagged:  # forked after every deletion the episode saw land
            (t,) = r.traces
            assert not (t.evict_at[t.evict_at < len(t)] > x.meta["fork_at"]).any()


def test_threads_train_with_their_episodes_advantage_discounted_from_their_fork(setup):
    """An unfinished thread is no training sample; the others carry the episode's advantage times
    gamma ** (the main thread's action tokens from their fork on), as an action there would."""
    from compactrl.rl.objectives.rollouts import thread_samples

    results = play(setup, "stream", parallel=True, seeds=[3, 4, 5, 6])
    assert sum(r.aux_unfinished for r in results) > 0
    for r in results:
        (t,) = r.traces
        samples = thread_samples(r, 2.0, 7, 0.99)
        acted = [x for x in r.aux_traces if not x.meta.get("unfinished")]
        assert [s.trace for s in samples] == acted and all(s.sequence == 7 for s in samples)
        for s in samples:
            later = int(t.trainable[s.trace.meta["fork_at"] :].sum())
            assert np.allclose(s.advantages, 2.0 * 0.99**later) and later > 0
        assert [s.advantages[0] for s in thread_samples(r, 2.0, 7, 1.0)] == [2.0] * len(acted)


def test_a_thread_with_no_room_is_counted_apart_from_format_failures(setup, tmp_path):
    """A thread that reaches the model's position limit deletes nothing and is counted as
    ``aux_no_room``, not as an answer the runner could not read (the oracle's answers always parse).
    The main thread's stream is the same length whatever is deleted (positions are never renumbered),
    so a limit just above it leaves the main thread room and the last forks none."""
    (full,) = play(setup, "stream", seeds=[3])
    folder = write_tiny_model(tmp_path / "m", max_position_embeddings=full.tokens + 5)
    engine = Engine.from_pretrained(folder)
    (r,) = play((engine, setup[1], None), "stream", seeds=[3])
    assert r.error is None and r.tokens == full.tokens and r.reward == 1.0
    assert r.aux_parse_failures == 0 and 0 < r.aux_no_room < r.aux_calls == full.aux_calls
    assert [x.meta["no_room"] for x in r.aux_traces] == [x.meta["named"] is None for x in r.aux_traces]


def test_rl_under_sidequest_trains_the_auxiliary_threads_with_their_episodes_advantage(tmp_path):
    """Beyond the paper: in an RL step both threads learn, the forks' tokens carrying the advantage
    of the episode whose memory they managed (a random model: the forks exist, their answers fail)."""
    from compactrl.config import ConfigError, load_config
    from compactrl.rl.loop import TrainConfig, train

    sets = [f"out={tmp_path}", "steps=1", "prompts=2", "group_size=2", "threads=1", "model.path=",
            "model.size=tiny", "env.world_size=40", "strategy.every=1", "strategy.max_tokens=16",
            "objective.name=rl", "mode=stream", "train.lora=", "rollout.max_turns=3",
            "rollout.temperature=1.0"]  # fmt: skip
    cfg = load_config(TrainConfig, "configs/sidequest/train.toml", sets)
    last = train(cfg)
    # the same batch again, from the initial model the run wrote: what the step trained on
    from compactrl.rl.sampler import sample_batch

    engine = Engine.from_pretrained(tmp_path / "model")
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    results = sample_batch(cfg, engine, fmt, build_strategy(cfg.strategy), 1)
    main = sum(int(t.trainable.sum()) for r in results for t in r.traces)
    aux = sum(int(t.trainable.sum()) for r in results for t in r.aux_traces if not t.meta.get("unfinished"))
    assert last["phase"] == "rl" and last["errors"] == 0 and aux > 0 and sum(r.aux_calls for r in results) > 0
    assert last["trained_tokens"] == main + aux
    by_hops = {k for k in last if k.startswith("reward_hops")}
    assert by_hops == {f"reward_hops{r.info['hops']}" for r in results}
    with pytest.raises(ConfigError, match="advantage = 'gae' values the main thread only"):
        load_config(TrainConfig, "configs/sidequest/train.toml", [*sets, "objective.advantage=gae"])


def test_an_rl_step_reports_its_reward_per_hop_count():
    """A batch of mixed difficulty: the step row splits the mean reward by the env's hop count, so
    a gain on two-hop questions cannot hide a loss on four-hop ones; episodes that name none are left out."""
    from compactrl.agent.rollout import EpisodeResult
    from compactrl.rl.objectives.rollouts import rewards_by_hops

    results = [EpisodeResult(i, 0, "browse", "stream", "sidequest", info={"hops": h} if h else {})
               for i, h in enumerate((2, 4, 2, 4, 3, None))]  # fmt: skip
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    want = {"reward_hops2": 1.0, "reward_hops3": 0.0, "reward_hops4": 0.5}
    assert rewards_by_hops(results, rewards) == want


# ---- the thread adapter ------------------------------------------------------------------------------
def test_a_memory_cost_prices_the_peak_into_the_advantage(tmp_path):
    """RL's optional memory term: of two equally correct episodes of a group, the one that held
    less KV (its threads' included) gets the higher advantage; without the term they tie."""
    from compactrl.agent.rollout import EpisodeResult
    from compactrl.config import ConfigError, load_config
    from compactrl.rl.loop import TrainConfig
    from compactrl.rl.objectives.rollouts import priced_rewards, step_advantages

    results = [
        EpisodeResult(0, 0, "browse", "stream", "sidequest", reward=w, peak_kv_with_threads=p)
        for w, p in ((1, 300), (1, 500), (0, 300), (0, 500))
    ]
    sets = ["group_size=2", "model.size=tiny", "model.path="]
    for cost, want in ((0.0, [1.0, 1.0, 0.0, 0.0]), (0.5, [0.85, 0.75, -0.15, -0.25])):
        cfg = load_config(TrainConfig, "configs/sidequest/rl.toml", [*sets, f"objective.memory_cost={cost}"])
        priced = priced_rewards(cfg.objective, results)
        assert np.allclose(priced, want)
        adv = step_advantages(cfg.objective, priced, cfg.group_size)
        assert (adv[0] > adv[1] and adv[2] > adv[3]) if cost else np.allclose(adv, 0)
    with pytest.raises(ConfigError, match="memory_cost prices the episode's peak KV"):
        load_config(
            TrainConfig,
            "configs/sidequest/rl.toml",
            [*sets, "objective.memory_cost=1", "objective.advantage=gae"],
        )


def test_a_thread_adapter_acts_on_the_forks_only_and_the_trainer_replays_it(tmp_path):
    """Gated LoRA (sidequest.adapter = 'thread'): the main thread is the base model, the forks run
    the adapter over the KV the base wrote, and the one-pass trainer reproduces both (with a pool
    small enough that sessions are preempted and recomputed)."""
    from compactrl.engine import EngineConfig
    from compactrl.models.lora import LoraSettings, add_lora, gate_adapters

    folder = write_tiny_model(tmp_path / "m")
    base = load_model(folder)
    for pool, parallel in ((None, True), (1000, False)):
        engine = Engine.from_pretrained(folder, config=EngineConfig(kv_pool_tokens=pool) if pool else None)
        add_lora(engine.model, LoraSettings(r=4))
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        gate_adapters(engine.model)
        fmt = ChatFormat.from_tokenizer(engine.tokenizer)
        results = play((engine, fmt, None), "stream", parallel=parallel, seeds=[3, 4, 5, 6])
        assert sum(r.deleted_cursors for r in results) > 0
        if pool:
            assert sum(r.preemptions for r in results) > 0
        for r in results:
            (t,) = r.traces
            assert r.error is None and logprob_gap(base, t) < 5e-5  # the main thread is the base model
            assert max(logprob_gap(engine.model, x) for x in [t, *r.aux_traces]) < 5e-5  # engine == trainer
            assert min(logprob_gap(base, x) for x in r.aux_traces) > 1e-3  # the forks run the adapter
        engine.model.adapter_gate = None  # negative control: the adapter everywhere
        assert all(logprob_gap(engine.model, x) > 1e-3 for r in results for x in [*r.traces, *r.aux_traces])


def test_the_thread_adapter_objective_trains_the_thread_and_rolls_out_on_the_base(tmp_path):
    """sidequest.adapter = 'thread': CE on the thread's samples only (no KL: the main thread is the
    base exactly); the checkpoint's adapters then roll out on a base model (strategy.thread_adapter)
    and `verify run` replays them."""
    from compactrl.agent.batch import RolloutConfig, rollout
    from compactrl.config import load_config
    from compactrl.rl.loop import TrainConfig, train
    from compactrl.verify import verify_run

    sets = [f"out={tmp_path / 'train'}", "steps=6", "prompts=2", "threads=1", "model.path=",
            "model.size=tiny", "env.world_size=40", "env.max_hops=3", "strategy.every=1", "train.lr=5e-2",
            "objective.kl=0", "objective.adapter=thread", "checkpoint_every=6"]  # fmt: skip
    train(load_config(TrainConfig, "configs/sidequest/train.toml", sets))
    rows = load_metrics(tmp_path / "train")
    assert np.mean([r["aux_ce"] for r in rows[-2:]]) < 0.7 * np.mean([r["aux_ce"] for r in rows[:2]])
    ckpt, base = tmp_path / "train" / "checkpoints" / "step_00000006", tmp_path / "train" / "model"
    roll = [f"out={tmp_path / 'roll'}", f"model.path={base}", f"strategy.thread_adapter={ckpt}", "episodes=2",
            "concurrency=2", "threads=1", "env.world_size=40", "strategy.every=1", "strategy.max_tokens=16",
            "rollout.max_turns=3", "rollout.temperature=1.0"]  # fmt: skip
    s = rollout(load_config(RolloutConfig, "configs/rollout/sidequest.toml", roll))
    assert s["errors"] == 0 and s["aux_calls"] > 0
    assert verify_run(tmp_path / "roll")["ok"]  # the adapter on the forks, the base elsewhere
    from compactrl.trace import load_traces

    plain = load_model(base)
    traces = load_traces(tmp_path / "roll" / "traces.jsonl")
    assert max(logprob_gap(plain, t) for t in traces if not t.meta.get("aux")) < 5e-5
    assert min(logprob_gap(plain, t) for t in traces if t.meta.get("aux")) > 1e-3  # negative control
    for bad, match in (("objective.kl=500", "set objective.kl = 0"), ("train.lora=", "set train.lora")):
        with pytest.raises(ValueError, match=match):
            load_config(TrainConfig, "configs/sidequest/train.toml", [*sets, bad])
    with pytest.raises(ValueError, match="objective 'sidequest' trains its own thread adapter"):
        load_config(TrainConfig, "configs/sidequest/train.toml", [*sets, f"strategy.thread_adapter={ckpt}"])


def _random_adapter(model, name: str, seed: int) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n and f".{name}." in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed + len(n)))


def test_rl_under_a_frozen_thread_adapter_trains_the_policys_own_lora(tmp_path, monkeypatch):
    """Item 6 on the thread adapter: the policy's own LoRA acts on every token, the frozen thread
    adapter on the forks' tokens as well; the one-pass trainer replays both, the policy's merged
    checkpoint leaves the thread adapter out, and an RL step moves the policy, never the thread."""
    from safetensors.torch import load_file, save_file

    from compactrl.config import ConfigError, load_config
    from compactrl.models.lora import THREAD, Adapters, LoraSettings, add_lora, load_thread_adapter
    from compactrl.models.lora import merged_state_dict as merged
    from compactrl.rl.loop import TrainConfig, train
    from compactrl.rl.trainer import Trainer

    seen, step = [], Trainer.step
    monkeypatch.setattr(
        Trainer, "step", lambda self, samples, *a, **kw: seen.append(samples) or step(self, samples, *a, **kw)
    )
    folder, thread = write_tiny_model(tmp_path / "m"), tmp_path / "thread"
    model = load_model(folder)
    add_lora(model, LoraSettings(r=4))
    _random_adapter(model, "default", 0)
    thread.mkdir()
    adapters = Adapters(model, LoraSettings(r=4))
    save_file(adapters.state_dict(), thread / "lora.safetensors", metadata=adapters.metadata)

    engine = Engine.from_pretrained(folder)
    load_thread_adapter(engine.model, thread)
    add_lora(engine.model, LoraSettings(r=8))  # the policy's own, after the thread's
    _random_adapter(engine.model, "default", 1)
    policy = load_model(folder)  # the policy alone: its adapters merged, the thread adapter not
    policy.load_state_dict(merged(engine.model))
    results = play((engine, ChatFormat.from_tokenizer(engine.tokenizer), None), "stream", seeds=[3, 4, 5])
    assert sum(r.deleted_cursors for r in results) > 0
    for r in results:
        (t,) = r.traces
        assert r.error is None and logprob_gap(policy, t) < 5e-5  # the main thread: the policy alone
        assert max(logprob_gap(engine.model, x) for x in [t, *r.aux_traces]) < 5e-5  # engine == trainer
        assert min(logprob_gap(policy, x) for x in r.aux_traces) > 1e-3  # the forks: the thread adapter too
    engine.model.adapter_gate = None  # negative control: the thread adapter everywhere
    assert all(logprob_gap(engine.model, r.traces[0]) > 1e-3 for r in results)

    assert {n.split(".")[-2] for n, p in engine.model.named_parameters() if p.requires_grad} == {"default"}

    sets = [f"out={tmp_path / 'rl'}", "steps=1", "prompts=2", "group_size=2", "threads=1",
            f"model.path={folder}", "env.world_size=40", "strategy.every=1", "strategy.max_tokens=16",
            "rollout.max_turns=3", "objective.memory_cost=1", "objective.advantage=loo",
            f"strategy.thread_adapter={thread}",
            "checkpoint_every=1"]  # fmt: skip
    last = train(load_config(TrainConfig, "configs/sidequest/rl.toml", sets))
    ckpt = tmp_path / "rl" / "checkpoints" / "step_00000001"
    own = load_file(ckpt / "lora.safetensors")
    assert last["errors"] == 0 and own and not [k for k in own if THREAD in k]
    assert max(float(v.abs().max()) for k, v in own.items() if "lora_B" in k) > 0  # the policy moved
    replay = load_model(folder)  # the checkpoint's model is the base with the policy's adapters only
    add_lora(replay, LoraSettings(r=16))
    Adapters(replay).load_state_dict(own)
    saved = load_file(ckpt / "model" / "model.safetensors")
    assert all(torch.allclose(saved[k], v, atol=1e-6) for k, v in merged(replay).items() if k in saved)
    aux = lambda: [s for s in seen[-1] if s.trace.meta.get("aux")]  # noqa: E731
    assert aux() and all(s.trace.trainable.sum() for s in aux())  # the forks' own tokens train too

    # train_aux = false: the same step's rollouts (the same seeds and weights), the main threads only
    no_aux = train(
        load_config(
            TrainConfig,
            "configs/sidequest/rl.toml",
            [*sets, f"out={tmp_path / 'main'}", "objective.train_aux=false"],
        )
    )
    assert seen[-1] and not aux() and no_aux["reward"] == last["reward"]
    assert (
        no_aux["trained_tokens"]
        == sum(int(s.trace.trainable.sum()) for s in seen[-1])
        < last["trained_tokens"]
    )
    for bad, match in (
        ("train.lora=", "set train.lora"),
        ("objective.name=rft", "is for objective.name = 'rl'"),
    ):
        rl_only = ("objective.memory_cost", "objective.advantage")  # fields rft does not have
        with pytest.raises(ConfigError, match=match):
            load_config(
                TrainConfig,
                "configs/sidequest/rl.toml",
                [*(x for x in sets if not x.startswith(rl_only)), bad],
            )
    with pytest.raises(ConfigError, match="this run trains none"):  # no auxiliary threads to leave out
        load_config(TrainConfig, "configs/train/rooms_window.toml", ["objective.train_aux=false"])


def test_the_main_thread_learns_under_the_deletions_of_sequential_demonstrations(tmp_path, monkeypatch):
    """configs/sidequest/main_deleted.toml: SFT on the solver's demonstrations played under
    sequential SideQuest in stream mode. The trainer gets the main streams only, with the oracle's
    deletions as evictions (so the actions are trained on the contexts SideQuest leaves), and the
    loss falls."""
    from compactrl.config import load_config
    from compactrl.rl.loop import TrainConfig, train
    from compactrl.rl.trainer import Trainer

    seen = []
    step = Trainer.step

    def record(self, samples, **kw):
        seen.extend(samples)
        return step(self, samples, **kw)

    monkeypatch.setattr(Trainer, "step", record)
    sets = [f"out={tmp_path}", "steps=6", "sft_steps=6", "prompts=2", "threads=1", "model.path=",
            "model.size=tiny", "env.world_size=40", "env.max_hops=3", "train.lora=", "train.lr=3e-3",
            "checkpoint_every=6"]  # fmt: skip
    train(load_config(TrainConfig, "configs/sidequest/main_deleted.toml", sets))
    rows = load_metrics(tmp_path)
    assert [r["phase"] for r in rows] == ["sft"] * 6
    assert np.mean([r["loss"] for r in rows[-2:]]) < 0.7 * np.mean([r["loss"] for r in rows[:2]])
    assert len(seen) == 12 and not any(s.trace.meta.get("aux") for s in seen)
    for s in seen:
        t = s.trace
        gone = t.evict_at < len(t)
        assert gone.any() and (t.cursor[gone] != NO_CURSOR).any()  # tool outputs were deleted
        # and actions were trained after a deletion, on the context without it
        assert any((t.evict_at[:i] <= i).any() for i in np.flatnonzero(t.trainable))


def test_a_demo_rollout_is_the_solver_and_the_oracle_the_floor_a_policy_is_measured_against(tmp_path):
    """`rollout --set demo=true`: the solver plays (every answer right) and, under sequential
    SideQuest, the env's oracle deletes exactly the expired cursors, below full context's peak."""
    from compactrl.agent.batch import RolloutConfig, rollout
    from compactrl.config import load_config
    from compactrl.verify import verify_run

    sets = ["demo=true", "model.path=", "model.size=tiny", "episodes=2", "concurrency=2", "threads=1",
            "env.world_size=40", "env.min_hops=3", "env.max_hops=4", "rollout.max_turns=16"]  # fmt: skip

    def run(*more):
        return rollout(load_config(RolloutConfig, "configs/rollout/sidequest.toml", [*sets, *more]))

    full = run("mode=full", "strategy.name=none", f"out={tmp_path / 'full'}")
    seq = run("strategy.every=1", "strategy.parallel=false", f"out={tmp_path / 'seq'}")
    assert full["accuracy"] == seq["accuracy"] == 1.0 and full["aux_calls"] == 0
    assert seq["deleted_cursors"] > 0 and seq["deletion_precision"] == seq["deletion_recall"] == 1.0
    assert seq["mean_peak_live_kv"] < full["mean_peak_live_kv"]
    # forked after the call, the output the call was read from goes before the next one lands
    call = run("strategy.every=1", "strategy.parallel=false", "strategy.at=call", f"out={tmp_path / 'call'}")
    assert call["accuracy"] == 1.0 and call["deletion_precision"] == call["deletion_recall"] == 1.0
    assert (
        call["mean_peak_live_kv"] < seq["mean_peak_live_kv"]
        and call["deleted_cursors"] == seq["deleted_cursors"]
    )
    assert verify_run(tmp_path / "call")["ok"]  # engine == trainer on the stream and its forks
    assert full["mean_peak_kv_with_threads"] == full["mean_peak_live_kv"] and full["aux_kv_reads"] == 0
    assert seq["mean_peak_kv_with_threads"] > seq["mean_peak_live_kv"] and seq["aux_kv_reads"] > 0


CALL_KEEP_CALLS = {"at": "call", "keep_unread": True, "keep_calls": True}


@pytest.mark.parametrize(
    "mode,parallel,fork",
    [("stream", False, {}), ("stream", True, {}), ("stream", False, CALL_KEEP_CALLS), ("reprefill", 0, {})],
    ids=["sequential", "parallel", "at-call", "reprefill"],
)
def test_forks_train_spliced_into_their_main_trace_in_one_forward(setup, mode, parallel, fork):
    """Each fork's own tokens join its main trace's stream (evicted where they end): one forward
    gives every trace's log-probs and gradients as its own forward does, with fewer tokens fed."""
    _, _, model = setup
    results = play(setup, mode, parallel=parallel, seeds=[3, 4, 5], **fork)
    traces = [x for r in results for x in [*r.traces, *r.aux_traces]]
    ss = streams(traces)  # a re-prefill rollout's forks join the segment they forked from
    mains = sum(len(r.traces) for r in results)
    assert len(ss) == mains and sum(r.aux_calls for r in results) > len(results)  # all spliced
    fed = sum(len(t) - t.meta.get("fork_at", 0) for t in traces)  # each prefix once, not once a fork
    assert sum(map(len, ss)) == fed < 0.6 * sum(map(len, traces))
    params = [p for p in model.parameters() if p.requires_grad]

    def run(groups):  # log-probs of every trace, and the gradient of their trainable sum
        model.zero_grad()
        lps = [lp for g in groups for lp in stream_logprobs(model, g)]
        sum(lp[torch.as_tensor(t.trainable)].sum() for lp, t in zip(lps, traces, strict=True)).backward()
        return lps, [p.grad.clone() for p in params]

    (one, g1), (alone, g2) = run([traces]), run([[t] for t in traces])
    assert max(float((a - b).detach().abs().max()) for a, b in zip(one, alone, strict=True)) < 1e-5
    assert all((a - b).abs().max() <= 1e-5 * b.abs().max() for a, b in zip(g1, g2, strict=True))
    for lp, t in zip(one, traces, strict=True):  # engine == trainer, forks included
        assert np.abs(lp.detach().double().numpy()[t.trainable] - t.logprobs[t.trainable]).max() < 5e-5
    # the head on wanted rows only (the trainer's trained tokens): the same log-probs there, 0
    # elsewhere, the same gradients; forks want their whole shared prefix, which the main's rows give
    want = [np.ones(len(t), bool) if t.meta.get("fork_at") else t.trainable for t in traces]
    model.zero_grad()
    some = stream_logprobs(model, traces, wanted=want)
    sum(lp[torch.as_tensor(t.trainable)].sum() for lp, t in zip(some, traces, strict=True)).backward()
    for a, b, w in zip(some, one, want, strict=True):
        assert float((a - b).detach()[torch.as_tensor(w) | (a != 0)].abs().max()) < 1e-5
    assert any((b[a == 0] != 0).any() for a, b in zip(some, one, strict=True))  # rows were left out
    assert all((p.grad - g).abs().max() <= 1e-5 * g.abs().max() for p, g in zip(params, g1, strict=True))
    # negative control: a fork block left visible changes what the main thread after it sees
    s = ss[0]
    s.evict_at[s.thread] = len(s)
    packed = pack([s])
    with torch.no_grad():
        h = model.hidden_states(packed.tokens, packed.positions, dense_mask(packed.evict_at))[0]
        main = traces[s.members[0]]
        lp = token_logprobs(model, h[torch.as_tensor(s.index[0][:-1])], torch.as_tensor(main.tokens[1:]))
    assert float((lp - one[s.members[0]][1:].detach()).abs().max()) > 1e-3


def test_a_fork_whose_view_the_splice_cannot_reproduce_stays_a_stream_of_its_own(setup):
    _, _, model = setup
    (r,) = play(setup, "stream", seeds=[3])
    fork = copy.deepcopy(r.aux_traces[0])
    a = fork.meta["fork_at"]
    fork.evict_at[0] = a + 1  # lost the first token one step into the thread: no single evict_at does that
    ss = streams([r.traces[0], fork, *r.aux_traces[1:]])
    assert [len(s.members) for s in ss] == [len(r.aux_traces), 1]  # the others still spliced in
    with torch.no_grad():
        (together, _), (alone,) = stream_logprobs(model, [fork, r.traces[0]]), stream_logprobs(model, [fork])
    assert torch.equal(together, alone)
