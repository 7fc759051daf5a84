"""The engine against the trainer forward, under batching, forks, preemption and bad input."""

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactrl.engine import Engine, EngineConfig, SamplingParams, SessionError
from compactrl.models.tiny import init_random, tiny_config
from compactrl.rl.forward import stream_logprobs
from compactrl.verify import verify_engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine(lm, pool=100_000, step=256, tokenizer=None, attention="auto"):
    return Engine(lm, tokenizer, EngineConfig(kv_pool_tokens=pool, max_step_tokens=step, attention=attention))


def assert_matches_trainer(lm, sessions, tol=5e-5):
    traces = [s.trace() for s in sessions]
    with torch.no_grad():
        ours = stream_logprobs(lm, traces)
    for s, t, lp in zip(sessions, traces, ours):
        m = torch.as_tensor(t.trainable)
        assert m.any()
        logged = torch.tensor(s.model_logprobs, dtype=torch.float64)[m]
        assert (lp.double()[m] - logged).abs().max() < tol, s.id


def test_verify_engine_with_and_without_preemption():
    tight = verify_engine(n_sessions=12, seed=1)
    assert tight["ok"] and tight["preemptions"] > 0 and tight["forks"] > 0
    roomy = verify_engine(n_sessions=12, seed=1, pool_tokens=10**6)
    assert roomy["ok"] and roomy["preemptions"] == 0
    assert roomy["max_abs_logprob_diff"] < 5e-5 and roomy["reprefill_diff"] > 0.1


ops = st.lists(
    st.tuples(st.sampled_from(["append", "evict", "generate"]), st.integers(1, 9), st.integers(0, 10**6)),
    min_size=3,
    max_size=12,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ops, min_size=1, max_size=3), st.integers(80, 400))
def test_random_eviction_schedules_match_trainer(tiny_lm, schedules, pool):
    eng = engine(tiny_lm, pool=pool, step=32)
    sessions = []
    for k, sched in enumerate(schedules):
        s = eng.session(f"h{k}")
        s.append([k + 2] * 4, role="system")
        for op, n, r in sched:
            if op == "append":
                s.append([(r + i) % 300 for i in range(n)])
            elif op == "evict":
                live = [j for j, e in enumerate(s.evict_at) if e is None and j > 0]
                if live:
                    a = r % len(live)
                    s.evict(live[a : a + n])
            else:
                s.generate(SamplingParams(max_tokens=n, seed=r, ignore_eos=True, model_logprobs=True))
                eng.run()
        s.generate(SamplingParams(max_tokens=2, seed=k, ignore_eos=True, model_logprobs=True))
        sessions.append(s)
    eng.run()
    assert eng.metrics()["peak_kv_tokens"] <= pool
    assert_matches_trainer(tiny_lm, sessions)


def rollout(eng, k):
    s = eng.session(f"r{k}")
    s.append([(7 * k + i) % 300 for i in range(20 + k)], role="system")
    for turn in range(3):
        s.generate(SamplingParams(max_tokens=8, model_logprobs=True, **GREEDY))
        eng.run()
        s.evict([(1 + 5 * turn, 6 + 5 * turn)])
        s.append([(k + turn + i) % 300 for i in range(4)])
    return s


def test_oversubscribed_pool_completes_every_session_identically(tiny_lm):
    alone = [rollout(engine(tiny_lm), k).tokens for k in range(8)]
    eng = engine(tiny_lm, pool=160, step=64)
    sessions = [eng.session(f"r{k}") for k in range(8)]
    for k, s in enumerate(sessions):
        s.append([(7 * k + i) % 300 for i in range(20 + k)], role="system")
    for turn in range(3):
        gens = [s.generate(SamplingParams(max_tokens=8, model_logprobs=True, **GREEDY)) for s in sessions]
        eng.run()
        assert all(g.done and len(g.tokens) == 8 for g in gens)
        for k, s in enumerate(sessions):
            s.evict([(1 + 5 * turn, 6 + 5 * turn)])
            s.append([(k + turn + i) % 300 for i in range(4)])
    assert [s.tokens for s in sessions] == alone
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["reprefilled_tokens"] > 0 and m["peak_kv_tokens"] <= 160
    assert_matches_trainer(tiny_lm, sessions)


def test_an_eviction_made_while_preempted_is_not_recomputed_into_the_pool(tiny_lm):
    """A session preempted before it evicts asks for room for its live tokens only; its recompute
    must not put the evicted ones back (they once overshot the pool until the next drop)."""
    eng = Engine(tiny_lm, None, EngineConfig(kv_pool_tokens=100, max_step_tokens=64, idle_grace_s=0.0))
    a, b = eng.session("a"), eng.session("b")
    for k, s in enumerate((a, b)):
        s.append([(3 * k + i) % 300 for i in range(60)], role="system")
        s.generate(SamplingParams(max_tokens=2, model_logprobs=True, **GREEDY))
        eng.run()
    assert a.row is None  # b displaced it
    a.evict([(1, 50)])
    a.append([7, 8, 9, 10])
    a.generate(SamplingParams(max_tokens=2, model_logprobs=True, **GREEDY))
    eng.run()
    m = eng.metrics()
    assert a.metrics.preemptions == 1 and b.metrics.preemptions == 0  # both fit once a's 49 are gone
    assert m["peak_kv_tokens"] <= 100 and eng.kv.used[a.row] == a.live
    assert_matches_trainer(tiny_lm, [a, b])


def test_fork_shares_the_prefix_without_copying(tiny_lm):
    eng = engine(tiny_lm)
    parent = eng.session("p")
    parent.append(list(range(40)), role="system")
    eng.run()
    used = eng.kv_tokens_used()
    kids = [parent.fork(f"c{i}") for i in range(3)]
    assert eng.kv_tokens_used() == used  # three more readers, no new KV
    parent.evict([(3, 9)])  # the parent's eviction must not touch the children's view
    for i, s in enumerate([parent, *kids]):
        s.append([100 + i, 101 + i])
        s.generate(SamplingParams(max_tokens=6, seed=i, ignore_eos=True, model_logprobs=True))
    eng.run()
    grand = kids[0].fork("g")
    grand.append([5, 6, 7])
    grand.generate(SamplingParams(max_tokens=4, seed=9, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert_matches_trainer(tiny_lm, [parent, *kids, grand])
    assert parent.trace().num_evicted == 6 and kids[0].trace().num_evicted == 0
    for s in [parent, *kids, grand]:
        s.close()
    assert eng.kv_tokens_used() == 0 and not eng.book.segments


def test_a_prefix_no_fork_reads_any_more_folds_back_into_its_session(tiny_lm):
    """While a fork lives, parent and fork read the frozen prefix as a shared segment; once the fork
    closes, the parent's next step folds it back into one row of its own (live entries only, no
    recompute), so it decodes in the batched path again, and its log-probs still match."""
    eng = engine(tiny_lm)
    p = eng.session("p")
    p.append(list(range(30)))
    eng.run()
    kid = p.fork("k")
    kid.append([7, 8])
    for i, s in enumerate((p, kid)):
        s.generate(SamplingParams(max_tokens=5, seed=i, ignore_eos=True, model_logprobs=True))
    eng.run()
    p.evict([(2, 5)])  # in the shared prefix, for the parent only
    p.generate(SamplingParams(max_tokens=3, seed=2, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert len(p.chain) == 1 and len(eng.book.segments) == 1  # the kid still reads it: no fold
    assert_matches_trainer(tiny_lm, [kid])
    kid.close()
    p.generate(SamplingParams(max_tokens=4, seed=3, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert p.chain == [] and not eng.book.segments and eng.kv.used[p.row] == p.live  # one row, no holes
    assert_matches_trainer(tiny_lm, [p])
    p.close()
    assert eng.kv_tokens_used() == 0


def test_a_familys_footprint_counts_each_shared_token_once(tiny_lm):
    """A session and its forks hold their shared prefix once: a prefix token leaves the footprint
    when the last of them evicts it or closes, and the family's peak can exceed every member's."""
    eng = engine(tiny_lm)
    parent = eng.session("p")
    parent.append(list(range(40)))
    eng.run()
    kid = parent.fork("k")
    fp = parent.footprint
    assert kid.footprint is fp and fp.live == 40
    parent.evict([(3, 9)])
    assert parent.live == 34 and fp.live == 40  # the kid still reads them
    kid.evict([(3, 7)])
    assert fp.live == 36  # 3..6 are gone from both; 7, 8 stay in the kid
    parent.append([1, 2, 3, 4, 5])
    kid.append([6, 7, 8])
    eng.run()
    assert fp.live == 36 + 5 + 3 and fp.peak == 44
    assert max(parent.metrics.peak_live_kv, kid.metrics.peak_live_kv) == 40  # each alone: less
    parent.close()
    assert fp.live == kid.live == 36 + 3  # the prefix stays with the kid
    kid.close()
    assert fp.live == 0 and fp.peak == 44


def test_fork_right_after_append_feeds_then_shares(tiny_lm):
    eng = engine(tiny_lm)
    s = eng.session()
    s.append(list(range(60)))
    kids = [s.fork() for _ in range(3)]  # the prompt is fed once, then shared
    assert s.fed == 60 and eng.kv_tokens_used() == 60
    for k, c in enumerate([s, *kids]):
        c.generate(SamplingParams(max_tokens=5, seed=k, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert sum(c.metrics.prefill_tokens for c in [s, *kids]) == 60
    assert_matches_trainer(tiny_lm, [s, *kids])


def test_first_chunks_of_mixed_lengths_in_one_step(tiny_lm, monkeypatch):
    """Fresh prompts of lengths 5, 9, 5, 9, 3, 5 prefilled in one step: each length's chunks are one
    block of the step's tokens (one causal SDPA reads them as views), and every session's
    log-probs equal the trainer's."""
    import compactrl.engine.engine as engine_module
    from compactrl.engine.runner import step_order

    steps, forward = [], engine_module.forward_step
    monkeypatch.setattr(
        engine_module,
        "forward_step",
        lambda m, kv, feeds, *a: steps.append(feeds) or forward(m, kv, feeds, *a),
    )
    eng = engine(tiny_lm)
    sessions = [eng.session() for _ in range(6)]
    for k, (s, n) in enumerate(zip(sessions, [5, 9, 5, 9, 3, 5], strict=True)):
        s.append([(k * 11 + i) % 300 for i in range(n)])
        s.generate(SamplingParams(max_tokens=4, seed=k, ignore_eos=True, model_logprobs=True))
    eng.run()
    _, rest = step_order(steps[0])
    assert [f.n for f in rest] == [3, 5, 5, 5, 9, 9]  # all six in the first step, grouped by length
    assert_matches_trainer(tiny_lm, sessions)


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
@pytest.mark.parametrize("generating", [[0, 2, 4, 6, 8, 9], [0, 1, 2, 5, 6, 9]])
def test_decode_over_scattered_rows(tiny_lm, generating, attention):
    """Decode rows that are not one block: the kernel's row list, or SDPA's runs of views or one
    gathered copy."""
    eng = engine(tiny_lm, attention=attention)
    sessions = [eng.session() for _ in range(10)]
    for k, s in enumerate(sessions):
        s.append([(k * 13 + i) % 300 for i in range(10 + 3 * k)])
    eng.run()
    rows = [s.row for s in sessions]
    assert rows == sorted(rows) and rows[-1] - rows[0] == 9
    for k in generating:
        sessions[k].generate(SamplingParams(max_tokens=6, seed=k, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert_matches_trainer(tiny_lm, [sessions[k] for k in generating])


def test_rows_are_compacted_lazily_and_stay_exact(tiny_lm):
    eng = engine(tiny_lm)
    s = eng.session()
    s.append(list(range(200)))
    eng.run()
    s.evict([(10, 120)])  # over a quarter of the row becomes holes
    eng.run()  # applies the eviction: valid bits only, no data moves yet
    assert eng.kv.used[s.row] == 200 and eng.kv.dead[s.row] == 110
    s.append([7, 8, 9])
    s.generate(SamplingParams(max_tokens=5, seed=0, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert eng.kv.dead[s.row] == 0 and eng.kv.used[s.row] == 200 - 110 + 3 + 5
    assert eng.kv.stream_index(s.row)[:12].tolist() == list(range(10)) + [120, 121]
    assert_matches_trainer(tiny_lm, [s])


def test_block_size_rounds_pool_accounting(tiny_lm):
    eng = Engine(tiny_lm, None, EngineConfig(kv_pool_tokens=4096, block_size=16))
    a, b = eng.session(), eng.session()
    a.append(list(range(17)))
    b.append(list(range(40)))
    eng.run()
    assert eng.kv_tokens_used() == 32 + 48


def test_same_seed_same_tokens_whatever_the_batch(tiny_lm):
    def sample(companions):
        eng = engine(tiny_lm)
        main = eng.session()
        main.append([1, 2, 3, 4])
        g = main.generate(SamplingParams(max_tokens=12, seed=42, ignore_eos=True))
        for c in range(companions):
            o = eng.session()
            o.append([c + 5] * (c + 3))
            o.generate(SamplingParams(max_tokens=5 + c, seed=c))
        eng.run()
        return g.tokens

    assert sample(0) == sample(5) == sample(2)
    eng = engine(tiny_lm)
    s = eng.session()
    s.append([1, 2, 3, 4])
    g = s.generate(SamplingParams(max_tokens=12, seed=43, ignore_eos=True))
    eng.run()
    assert g.tokens != sample(0)


def test_a_preallocated_cache_keeps_its_rows_and_samples_the_same(tiny_lm):
    """Preallocating (as a bench does before timing) grows rows and capacity once, keeps what the
    rows hold, and changes no sampled token or log-prob."""

    def sample(prealloc: bool):
        eng = engine(tiny_lm)
        first = eng.session()
        first.append([1, 2, 3])
        eng.run()
        if prealloc:
            before = (eng.kv.k[0].clone(), eng.kv.rows, eng.kv.capacity)
            eng.kv.preallocate(4 * before[1], 3 * before[2])
            assert (eng.kv.rows, eng.kv.capacity) == (4 * before[1], 3 * before[2])
            r, c = before[0].shape[0], before[0].shape[2]
            assert torch.equal(eng.kv.k[0][:r, :, :c], before[0])
            eng.kv.preallocate(1, 1)  # never shrinks
            assert (eng.kv.rows, eng.kv.capacity) == (4 * before[1], 3 * before[2])
        gens = []
        for k in range(6):
            s = first if k == 0 else eng.session()
            s.append([k + 4] * (k + 2))
            gens.append(s.generate(SamplingParams(max_tokens=8, seed=k, ignore_eos=True)))
        eng.run()
        return [(g.tokens, g.logprobs) for g in gens]

    assert sample(True) == sample(False)


def test_stop_tokens_and_length(tiny_lm):
    eng = engine(tiny_lm)
    s = eng.session()
    s.append([1, 2, 3])
    g = s.generate(SamplingParams(max_tokens=50, seed=0, ignore_eos=True))
    eng.run()
    stop = g.tokens[3]
    s2 = eng.session()
    s2.append([1, 2, 3])
    g2 = s2.generate(SamplingParams(max_tokens=50, seed=0, ignore_eos=True, stop_token_ids=[stop]))
    eng.run()
    first = g.tokens.index(stop)
    assert g2.tokens == g.tokens[: first + 1] and g2.finish_reason == "stop"
    assert g.finish_reason == "length" and len(g.tokens) == 50


def test_stop_strings_with_a_real_tokenizer(tmp_path):
    from compactrl.models.tiny import write_tiny_model

    eng = Engine.from_pretrained(write_tiny_model(tmp_path / "m"), config=EngineConfig(kv_pool_tokens=4096))
    s = eng.session()
    s.append(
        eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    )
    g = s.generate(SamplingParams(max_tokens=40, seed=1, ignore_eos=True))
    eng.run()
    text = eng.tokenizer.decode(g.tokens)
    stop = next(c for c in text[len(text) // 2 :] if c.isalpha())  # a character the continuation produces
    s2 = eng.session()
    s2.append(s.tokens[: g.start])
    g2 = s2.generate(SamplingParams(max_tokens=40, seed=1, ignore_eos=True, stop=[stop]))
    eng.run()
    text2 = eng.tokenizer.decode(g2.tokens)
    assert g2.finish_reason == "stop" and stop in text2 and stop not in eng.tokenizer.decode(g2.tokens[:-1])
    assert g2.tokens == g.tokens[: len(g2.tokens)]


def test_bad_input_is_refused_and_leaves_sessions_untouched(tiny_lm):
    eng = engine(tiny_lm, pool=500)
    a, b = eng.session("a"), eng.session("b")
    a.append(list(range(30)))
    b.append(list(range(30, 60)))
    eng.run()
    a.evict([(2, 5)])
    before = a.trace().to_dict()
    bad = [
        (lambda: a.append([1, 300]), "outside the vocabulary"),
        (lambda: a.append([-1]), "outside the vocabulary"),
        (lambda: a.evict([(25, 31)]), "outside the stream"),
        (lambda: a.evict([(3, 4)]), "already evicted"),
        (lambda: a.evict([(10, 12), (11, 13)]), "overlap"),
        (lambda: a.append(list(range(300)) * 2), "pool holds 500"),
        (lambda: a.append([1] * 40000), "positions"),
        (lambda: a.append([1], role="robot"), "role"),
        (lambda: a.generate(SamplingParams(stop=["x"])), "tokenizer"),
        (lambda: eng.session().generate(), "append a prompt"),
    ]
    for call, message in bad:
        with pytest.raises(SessionError, match=message):
            call()
    assert a.trace().to_dict() == before
    g = a.generate(SamplingParams(max_tokens=4, seed=0, model_logprobs=True))
    with pytest.raises(SessionError, match="while session a is generating"):
        a.append([1])
    b.generate(SamplingParams(max_tokens=4, seed=1, model_logprobs=True))
    eng.run()
    assert g.done
    assert_matches_trainer(tiny_lm, [a, b])
    a.close()
    for call in (lambda: a.fork(), lambda: a.append([1]), lambda: a.evict([0])):
        with pytest.raises(SessionError, match="closed"):
            call()


def test_update_weights_keeps_live_kv(tiny_lm):
    eng = engine(tiny_lm)
    s = eng.session()
    s.append(list(range(50)))
    eng.run()
    row = s.row
    kv_before = [k[row, :, :50].clone() for k in eng.kv.k]
    other = init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=7)
    try:
        eng.update_weights(other.state_dict())
        assert all(torch.equal(k[row, :, :50], b) for k, b in zip(eng.kv.k, kv_before))
        g = s.generate(SamplingParams(max_tokens=6, **GREEDY))
        eng.run()
        assert torch.equal(
            eng.model.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight
        )
        with pytest.raises(ValueError, match="shape"):
            eng.update_weights({"lm_head.weight": torch.zeros(3, 3)})
    finally:
        eng.update_weights(
            init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=0).state_dict()
        )
    fresh = engine(tiny_lm)
    s2 = fresh.session()
    s2.append(list(range(50)))
    g2 = s2.generate(SamplingParams(max_tokens=6, **GREEDY))
    fresh.run()
    assert g.tokens != g2.tokens  # the new weights were used for decoding


def test_async_agents_get_the_same_results(tiny_lm):
    def prompts(k):
        return [(k * 11 + i) % 300 for i in range(10 + k)]

    sync_eng = engine(tiny_lm)
    expected = []
    for k in range(6):
        s = sync_eng.session()
        s.append(prompts(k))
        expected.append(s.generate(SamplingParams(max_tokens=7, seed=k, ignore_eos=True)))
    sync_eng.run()

    async def main():
        eng = engine(tiny_lm)
        server = asyncio.create_task(eng.serve())

        async def agent(k):
            s = eng.session()
            s.append(prompts(k))
            g = await s.agenerate(SamplingParams(max_tokens=7, seed=k, ignore_eos=True))
            return g.tokens

        out = await asyncio.gather(*(agent(k) for k in range(6)))
        server.cancel()
        return out

    assert asyncio.run(main()) == [g.tokens for g in expected]


def test_metrics_count_what_happened(tiny_lm):
    eng = engine(tiny_lm)
    s = eng.session()
    s.append(list(range(20)))
    s.generate(SamplingParams(max_tokens=5, **GREEDY))
    eng.run()
    s.evict([(0, 4)])
    s.append([1, 2, 3])
    s.generate(SamplingParams(max_tokens=3, **GREEDY))
    eng.run()
    m = s.metrics
    assert m.prefill_tokens == 20 + 3 and m.decode_tokens == 8 and m.reprefilled_tokens == 0
    assert m.evicted_tokens == 4 and m.preemptions == 0
    assert m.peak_live_kv == s.live == 20 + 5 + 3 + 3 - 4
    # kv_reads: feeding each sampled token reads the live KV, incl. that token
    assert m.kv_reads == sum(range(21, 26)) + sum(range(25, 28))
    t = s.trace()
    assert t.segment.max() == 1 and set(t.role) == {"user", "assistant"}


def test_hundreds_of_async_agents_in_an_oversubscribed_pool(tiny_lm):
    async def main():
        eng = engine(tiny_lm, pool=4000, step=1024)
        server = asyncio.create_task(eng.serve())

        async def agent(k):
            s = eng.session(f"a{k}")
            s.append([(k + i) % 300 for i in range(24)])
            for turn in range(2):
                await s.agenerate(SamplingParams(max_tokens=6, seed=k, ignore_eos=True, model_logprobs=True))
                s.evict([(1 + 5 * turn, 6 + 5 * turn)])
                s.append([5, 6])
            return s

        sessions = await asyncio.gather(*(agent(k) for k in range(200)))
        server.cancel()
        return eng, sessions

    eng, sessions = asyncio.run(main())
    assert all(len(s.tokens) == 24 + 2 * (6 + 2) for s in sessions)
    assert eng.metrics()["preemptions"] > 0  # 200 x 40 tokens do not fit in 4000
    assert_matches_trainer(tiny_lm, sessions[::20])


def test_empty_span_is_named_as_such(tiny_lm):
    s = engine(tiny_lm).session()
    s.append(list(range(10)))
    for span in ((5, 5), (6, 4)):
        with pytest.raises(SessionError, match=rf"span \({span[0]}, {span[1]}\) is an empty span"):
            s.evict([span])
    with pytest.raises(SessionError, match=r"span \(8, 11\) is outside the stream \[0, 10\)"):
        s.evict([(8, 11)])
    assert all(e is None for e in s.evict_at)


def test_position_limit_bounds_every_token_ever_fed():
    cfg = tiny_config("qwen3", vocab_size=300, eos_token_id=[1], max_position_embeddings=40)
    lm = init_random(cfg, seed=0)
    eng = engine(lm)
    assert eng.position_limit == 40
    s = eng.session("p")
    s.append(list(range(2, 26)))
    g = s.generate(SamplingParams(max_tokens=100, seed=0, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert g.finish_reason == "position_limit" and len(g.tokens) == 16 and len(s.tokens) == 40
    assert s.fed == 40  # the last token was fed, at position 39
    s.evict([(1, 30)])  # evicting frees KV, not positions
    for call in (lambda: s.append([5]), lambda: s.generate(SamplingParams(max_tokens=1))):
        with pytest.raises(SessionError, match=r"limit of 40 .*holds 40 tokens.*YaRN.*shorter episodes"):
            call()
    assert_matches_trainer(lm, [s])
    t = eng.session("t")
    t.append(list(range(30)))
    with pytest.raises(SessionError, match="appending 11 tokens .* position limit of 40"):
        t.append([1] * 11)
    g = t.generate(SamplingParams(max_tokens=10, seed=1, ignore_eos=True))  # exactly to the limit
    eng.run()
    assert g.finish_reason == "length" and len(t.tokens) == 40


def test_yarn_engine_with_evictions_matches_the_trainer_forward():
    from compactrl.models.config import RopeConfig

    rope = RopeConfig(rope_type="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=16)
    for family in ("llama", "qwen3"):
        cfg = tiny_config(family, vocab_size=300, eos_token_id=[1], rope=rope, max_position_embeddings=64)
        lm = init_random(cfg, seed=2).eval()
        eng = engine(lm, step=16)
        sessions = [rollout(eng, k) for k in range(3)]  # ~50-token streams, past the original 16
        for s in sessions:
            s.generate(SamplingParams(max_tokens=4, seed=3, ignore_eos=True, model_logprobs=True))
        eng.run()
        assert all(len(s.tokens) > 40 and any(e is not None for e in s.evict_at) for s in sessions)
        assert_matches_trainer(lm, sessions)


def test_engine_steps_record_no_autograd_graph_on_a_trainable_model(tiny_lm):
    """The engine shares the trainer's module, whose parameters require grad: its forwards run in
    inference mode, or every step's graph would stay reachable from the KV cache (a leak)."""
    import copy

    model = copy.deepcopy(tiny_lm).requires_grad_(True)
    eng = engine(model)
    s = eng.session("s")
    s.append(list(range(30)), role="system")
    kid = s.fork("k")
    for x in (s, kid):
        x.append([7, 8])
        x.generate(SamplingParams(max_tokens=5, seed=1, ignore_eos=True))
    eng.run()
    assert not any(t.requires_grad for t in [*eng.kv.k, *eng.kv.v])
    assert s.pending_logits is None or not s.pending_logits.requires_grad


def test_the_engine_forgets_closed_sessions_over_ten_thousand_of_them(tiny_lm):
    """A server's engine must not grow with the sessions it has seen: a closed session leaves every
    scan, its KV row and its evictor state; only the metrics' sums remain (and add up)."""
    import gc
    import weakref

    from compactrl.compaction.evictors import H2O

    eng = engine(tiny_lm, pool=4096, step=512)
    gone, sizes = [], []
    for wave in range(200):
        batch = [eng.session() for _ in range(50)]
        for k, s in enumerate(batch):
            s.append([2 + (wave + k) % 200] * 3)
            if k % 10 == 0:
                s.use_evictor(H2O(budget=4, window=1, protect_turn=False))
            s.generate(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        eng.run()
        assert len(eng.sessions) == 50
        for s in batch:
            s.close()
        gone += [weakref.ref(s) for s in batch[::10]]
        del batch, s
        sizes.append((len(eng.sessions), len(eng.active), len(eng.book.segments), eng.kv.nbytes(),
                      eng.kv_tokens_used()))  # fmt: skip
    gc.collect()
    assert all(r() is None for r in gone)  # nothing in the engine still holds a closed session
    assert sizes[-1] == sizes[9] == (0, 0, 0, sizes[9][3], 0)  # flat: no session, no KV in use, same buffers
    m = eng.metrics()
    assert m["sessions"] == 0 and m["sessions_closed"] == 10_000
    assert m["decode_tokens"] == 20_000 and m["prefill_tokens"] == 30_000 and m["evictor_s"] > 0


@pytest.mark.parametrize("forked", [False, True])
def test_truncate_continues_as_a_fresh_stream_of_the_kept_prefix(tiny_lm, forked):
    """Re-prefill's prefix reuse: cut a stream back to n tokens and continue; the result is the
    stream a fresh session of those tokens gives (same tokens sampled, same log-probs, positions
    contiguous), with only the cut token before n re-fed. A stream with evictions cannot be cut."""
    eng = engine(tiny_lm, pool=2000, step=64)
    s = eng.session("cut")
    s.append(list(range(10, 40)))
    g = s.generate(SamplingParams(max_tokens=5, seed=3, ignore_eos=True))
    eng.run()
    if forked:  # the kept prefix then lies partly in a shared, frozen segment
        child = s.fork("child")
        child.append([7, 8])
        eng.run()
    assert s.truncate(20) == 15 and len(s.tokens) == s.live == 20 and s.fed == 19
    s.append([50, 51, 52])
    g = s.generate(SamplingParams(max_tokens=6, seed=4, ignore_eos=True, model_logprobs=True))
    eng.run()
    fresh = eng.session("fresh")
    fresh.append(list(range(10, 30)) + [50, 51, 52])
    f = fresh.generate(SamplingParams(max_tokens=6, seed=4, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert g.tokens == f.tokens and s.tokens == fresh.tokens
    assert max(abs(a - b) for a, b in zip(g.logprobs, f.logprobs)) < 1e-5
    assert_matches_trainer(tiny_lm, [s])
    s.evict([(0, 2)])
    with pytest.raises(SessionError, match="a cut would undo evictions"):
        s.truncate(5)
    with pytest.raises(SessionError, match="outside the stream"):
        fresh.truncate(100)
