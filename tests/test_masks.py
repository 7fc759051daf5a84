"""Every mask form encodes the same invariant: j <= i < evict_at[j]."""

import torch
from conftest import random_stream
from hypothesis import given, settings
from hypothesis import strategies as st

from compactrl.masks import chunked_mask, dense_mask, flex_block_mask, pack, pack_greedy
from compactrl.models.attention import attend


def chunks_to_dense(cm) -> torch.Tensor:
    out = torch.zeros(cm.length, cm.length, dtype=torch.bool)
    for c in cm.chunks:
        out[c.q_start : c.q_end, c.keys] = c.mask
    return out


@st.composite
def evict_schedules(draw):
    T = draw(st.integers(1, 90))
    ev = [draw(st.integers(j + 1, T)) for j in range(T)]
    return torch.tensor(ev)


@settings(max_examples=60, deadline=None)
@given(evict_schedules(), st.integers(1, 40))
def test_chunked_mask_equals_dense(ev, chunk):
    cm = chunked_mask(ev, chunk)
    assert torch.equal(chunks_to_dense(cm), dense_mask(ev))
    for c in cm.chunks:  # no key is gathered that no query of the chunk can see
        assert c.mask.any(0).all()


def test_chunked_cost_grows_with_live_context_not_T_squared():
    """Sliding window: live context stays ~W, so attended pairs grow linearly in T."""

    def window(T, W=64):
        return torch.minimum(torch.arange(T) + W, torch.tensor(T))

    pairs = [chunked_mask(window(T), 32).attended_pairs for T in (1024, 2048)]
    assert 1.9 < pairs[1] / pairs[0] < 2.1
    assert pairs[1] < 0.1 * 2048 * 2048


def test_packing_is_block_diagonal():
    traces = [random_stream(s, T=30 + 7 * s) for s in range(3)]
    row = pack(traces)
    m = dense_mask(row.evict_at)
    for a, (sa, na) in enumerate(zip(row.starts, row.lengths)):
        for b, (sb, nb) in enumerate(zip(row.starts, row.lengths)):
            block = m[sa : sa + na, sb : sb + nb]
            if a == b:
                assert torch.equal(block, dense_mask(torch.as_tensor(traces[a].evict_at)))
            else:
                assert not block.any()
    assert row.positions.tolist() == [p for n in row.lengths for p in range(n)]


def test_pack_greedy_respects_budget_and_keeps_everything():
    traces = [random_stream(s, T=20 + 13 * s) for s in range(6)]
    rows = pack_greedy(traces, 120)
    assert sorted(k for r in rows for k in r) == list(range(6))
    assert all(sum(len(traces[k]) for k in r) <= 120 or len(r) == 1 for r in rows)


def test_flex_block_mask_attention_matches_dense_sdpa():
    """The CUDA training path's mask, run forward-only on CPU (compiled flex attention)."""
    trace = random_stream(11, T=300)
    ev = torch.as_tensor(trace.evict_at)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 300, 16, generator=g) for h in (4, 2, 2))
    with torch.no_grad():
        flex = attend(q, k, v, flex_block_mask(ev))
        dense = attend(q, k, v, dense_mask(ev))
        chunked = attend(q, k, v, chunked_mask(ev, 64))
    assert (flex - dense).abs().max() < 1e-5
    assert (chunked - dense).abs().max() < 1e-5
