"""The one-pass eviction-mask forward reproduces a token-by-token evicting KV cache."""

import numpy as np
import pytest
import torch
from conftest import random_stream

from compactrl.masks import dense_mask
from compactrl.rl.forward import reprefill_logprobs, reprefill_segments, stream_logprobs
from compactrl.rl.reference import incremental_logprobs
from compactrl.trace import Trace


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_forward_matches_incremental_eviction(tiny_lm, seed):
    trace = random_stream(seed)
    assert trace.num_evicted > 0
    ref = incremental_logprobs(tiny_lm, trace)
    with torch.no_grad():
        for backend in ("chunked", "dense"):
            lp = stream_logprobs(tiny_lm, [trace], backend=backend, chunk=32)[0]
            assert (lp.double() - ref).abs().max() < 2e-5, backend


def test_float64_agreement_is_tight(tiny_lm):
    lm64 = tiny_lm.to(torch.float64)
    try:
        trace = random_stream(5, T=96)
        ref = incremental_logprobs(lm64, trace)
        with torch.no_grad():
            lp = stream_logprobs(lm64, [trace], backend="chunked", chunk=16)[0]
        assert lp.dtype == torch.float64
        assert (lp - ref).abs().max() < 1e-10
    finally:
        tiny_lm.to(torch.float32)


def test_negative_controls_differ(tiny_lm):
    """A plain causal mask and a re-prefill of the kept tokens must NOT reproduce the stream."""
    trace = random_stream(3, T=200, n_events=4)
    with torch.no_grad():
        stream = stream_logprobs(tiny_lm, [trace])[0]
        causal = torch.log_softmax(tiny_lm(torch.as_tensor(trace.tokens), torch.arange(len(trace)))[0], -1)[
            :-1
        ].gather(-1, torch.as_tensor(trace.tokens[1:])[:, None])[:, 0]
        causal = torch.cat([causal.new_zeros(1), causal])
        fresh = reprefill_logprobs(tiny_lm, trace)
        original = reprefill_logprobs(tiny_lm, trace, original_positions=True)
    after = torch.as_tensor(trace.live_counts() < np.arange(1, len(trace) + 1))  # queries past an eviction
    after = torch.cat([torch.zeros(1, dtype=torch.bool), after[:-1]])
    assert after.any()
    for name, other in [("causal", causal), ("reprefill", fresh), ("reprefill@orig", original)]:
        diff = (stream - other)[after].abs().max().item()
        assert diff > 0.1, f"{name} should differ from the stream, max diff {diff}"
    # before the first eviction all three see the same context and must agree
    assert (stream - causal)[~after].abs().max() < 1e-4


def test_packing_equals_separate_rows(tiny_lm):
    traces = [random_stream(s, T=60 + 20 * s) for s in range(4)]
    with torch.no_grad():
        alone = stream_logprobs(tiny_lm, traces)
        packed = stream_logprobs(tiny_lm, traces, max_row_tokens=200, chunk=48)
    for a, b in zip(alone, packed):
        assert (a - b).abs().max() < 1e-5


def test_wanted_rows_alone_give_the_same_log_probs_and_nothing_else(tiny_lm):
    """The head on the trained tokens' rows only (packed rows, entropy column, a trace with none
    trained): those outputs as the full forward gives them, zeros elsewhere."""
    traces = [random_stream(s, T=60 + 20 * s) for s in range(3)]
    wanted = [t.trainable for t in traces[:2]] + [np.zeros(len(traces[2]), bool)]
    with torch.no_grad():
        full = stream_logprobs(tiny_lm, traces, max_row_tokens=200, entropy=True)
        some = stream_logprobs(tiny_lm, traces, max_row_tokens=200, entropy=True, wanted=wanted)
    for a, b, w in zip(some, full, wanted, strict=True):
        assert a.shape == b.shape and torch.allclose(a[w], b[w], atol=1e-5, rtol=0)
        assert not a[~w].any() and b[~w][1:].abs().sum() > 0  # rows left out were not zero before


def test_chunked_backward_matches_dense(tiny_lm):
    trace = random_stream(7, T=120)
    grads = {}
    for backend in ("chunked", "dense"):
        tiny_lm.zero_grad()
        lp = stream_logprobs(tiny_lm, [trace], backend=backend, chunk=24, logits_chunk=50)[0]
        lp[torch.as_tensor(trace.trainable)].sum().backward()
        grads[backend] = [p.grad.clone() for p in tiny_lm.parameters()]
    tiny_lm.zero_grad()
    for a, b in zip(grads["chunked"], grads["dense"]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_reprefill_segments_count_kept_tokens():
    T = 40
    evict_at = np.full(T, T)
    evict_at[2:10] = 20  # one eviction at 20 removing 8 tokens
    evict_at[10:15] = 30
    trace = Trace.from_tokens(np.arange(T), evict_at=evict_at)
    segs = reprefill_segments(trace)
    assert [s.num_kept for s in segs] == [0, 20 - 8, 30 - 8 - 5]
    assert sum(len(s.tokens) for s in segs) == T + 12 + 17
    assert segs[1].stream_index[:2].tolist() == [0, 1] and segs[1].stream_index[2] == 10


def test_dense_mask_is_the_invariant():
    ev = torch.tensor([5, 2, 5, 4, 5])
    m = dense_mask(ev)
    for i in range(5):
        for j in range(5):
            assert bool(m[i, j]) == (j <= i < int(ev[j]))


def test_bad_traces_are_clear_errors(tiny_lm):
    with pytest.raises(ValueError, match="vocab_size"):
        stream_logprobs(tiny_lm, [Trace.from_tokens([1, 2, 5000])])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        stream_logprobs(tiny_lm, [Trace.from_tokens([1] * (tiny_lm.config.max_position_embeddings + 1))])
    with pytest.raises(ValueError, match="has 0 tokens"):
        stream_logprobs(tiny_lm, [Trace.from_tokens([])])


def test_verify_trainer_passes_and_its_controls_bite():
    from compactrl.verify import verify_trainer

    r = verify_trainer(n_streams=3)
    assert r["ok"] and r["evictions"] >= 6
    assert max(r["max_abs_logprob_diff"].values()) < 5e-5
    assert min(r["negative_control"].values()) > 0.1


def test_flex_refuses_backward_on_cpu(tiny_lm):
    with pytest.raises(ValueError, match="no backward on CPU"):
        stream_logprobs(tiny_lm, [random_stream(0, T=40)], backend="flex")[0].sum().backward()


def test_gradient_checkpointing_gives_the_same_gradients(tiny_lm):
    trace = random_stream(9, T=100)
    grads = []
    for ckpt in (False, True):
        tiny_lm.zero_grad()
        tiny_lm.gradient_checkpointing = ckpt
        lp = stream_logprobs(tiny_lm, [trace], chunk=16)[0]
        lp[torch.as_tensor(trace.trainable)].sum().backward()
        grads.append([p.grad.clone() for p in tiny_lm.parameters()])
    tiny_lm.gradient_checkpointing = False
    tiny_lm.zero_grad()
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_flex_forward_matches_dense_on_packed_streams_with_evictions(tiny_lm, monkeypatch):
    """The CUDA training path (flex attention, forward-only on CPU) against the dense mask, on three
    streams with evictions packed into one row of 300 tokens (block size 128: blocks that are
    partly masked, partly evicted, and cross stream boundaries). Negative control: the same flex
    path given a causal-only block mask (every ``evict_at`` = row length) must differ by nats after
    the evictions, or the comparison cannot see the mask. Breaks if ``flex_block_mask``'s
    ``mask_mod`` drops ``q < evict_at[kv]`` or the packing offsets, or ``create_block_mask`` marks
    a partly evicted block as full. 300 tokens, the heads and head_dim of test_masks' flex test:
    one compiled kernel (~8 s to compile on a cold CPU), which the control reuses."""
    pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no flex attention")
    from torch._dynamo.exc import BackendCompilerFailed

    from compactrl.rl import forward

    traces = [random_stream(s, T=n, n_events=4) for s, n in zip((21, 22, 23), (90, 100, 110))]
    assert all(t.num_evicted > 0 for t in traces)
    with torch.no_grad():
        dense = stream_logprobs(tiny_lm, traces, backend="dense", max_row_tokens=300)
        try:
            flex = stream_logprobs(tiny_lm, traces, backend="flex", max_row_tokens=300)
        except BackendCompilerFailed as e:  # torch.compile needs a working C++ toolchain on CPU
            pytest.skip(f"flex attention does not compile on this CPU: {e}")
        ref = [incremental_logprobs(tiny_lm, t) for t in traces]
        real = forward.flex_block_mask  # the same mask_mod code (no recompile), nothing evicted
        causal_only = lambda ev, **kw: real(torch.full_like(ev, len(ev)), **kw)  # noqa: E731
        monkeypatch.setattr(forward, "flex_block_mask", causal_only)
        causal = stream_logprobs(tiny_lm, traces, backend="flex", max_row_tokens=300)
    for t, d, f, r, c in zip(traces, dense, flex, ref, causal):
        assert (f - d).abs().max() < 2e-5
        assert (f.double() - r)[1:].abs().max() < 2e-5  # and both reproduce the evicting KV cache
        after = torch.as_tensor(t.live_counts() < np.arange(1, len(t) + 1))  # tokens fed after an eviction
        after = torch.cat([torch.zeros(1, dtype=torch.bool), after[:-1]])
        assert (c - f)[after].abs().max() > 0.1  # the causal-only control sees the evicted tokens
