"""``evict_at`` -> attention masks: dense, chunked (CPU training), flex block mask (CUDA), packed rows.

Every mask here encodes the one invariant: query ``i`` attends key ``j`` iff
``j <= i < evict_at[j]``. Packing concatenates streams and offsets their ``evict_at`` by the
row start; because a never-evicted token has ``evict_at = T`` of its own stream, the offset
value is exactly the start of the next stream, so the document mask falls out of the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compactrl.trace import Trace


def dense_mask(evict_at: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` bool mask, True where query i may attend key j."""
    T = evict_at.shape[-1]
    i = torch.arange(T, device=evict_at.device)[:, None]
    j = torch.arange(T, device=evict_at.device)[None, :]
    return (j <= i) & (i < evict_at[None, :])


@dataclass
class AttentionChunk:
    """Queries ``[q_start, q_end)`` attend only ``keys`` (sorted stream indices) under ``mask``."""

    q_start: int
    q_end: int
    keys: torch.Tensor  # int64 [K]
    mask: torch.Tensor  # bool [q_end - q_start, K]


@dataclass
class ChunkedMask:
    """The eviction mask cut into query chunks, each with only the keys some query in it can see.

    Attention then costs ``T x (live context + chunk)`` instead of ``T^2``, and every chunk is
    an ordinary SDPA call, so it has a backward on CPU (where flex attention has none).
    """

    length: int
    chunks: list[AttentionChunk]

    @property
    def attended_pairs(self) -> int:
        return sum(c.mask.numel() for c in self.chunks)


def chunked_mask(evict_at: torch.Tensor, chunk: int = 256) -> ChunkedMask:
    T = evict_at.shape[-1]
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    idx = torch.arange(T, device=evict_at.device)
    chunks = []
    for q0 in range(0, T, chunk):
        q1 = min(q0 + chunk, T)
        keys = torch.nonzero(evict_at[:q1] > q0).squeeze(1)  # fed by the chunk's end, live at its start
        q = idx[q0:q1, None]
        mask = (keys[None, :] <= q) & (q < evict_at[keys][None, :])
        chunks.append(AttentionChunk(q0, q1, keys, mask))
    return ChunkedMask(T, chunks)


def flex_block_mask(evict_at: torch.Tensor, block_size: int = 128):
    """Flex-attention ``BlockMask`` for one (possibly packed) row: the CUDA training path.

    On CPU flex attention is forward-only (no backward kernel), so CPU training uses
    :func:`chunked_mask`. ``create_block_mask`` fills the ``full_kv_*`` blocks, which torch 2.13's
    CPU compile needs.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    T = evict_at.shape[-1]
    ev = evict_at.contiguous()

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q < ev[kv])

    return create_block_mask(mask_mod, None, None, T, T, device=str(ev.device), BLOCK_SIZE=block_size)


@dataclass
class PackedRow:
    """Several streams concatenated into one row; positions restart at 0 for each stream."""

    tokens: torch.Tensor  # int64 [L]
    positions: torch.Tensor  # int64 [L]
    evict_at: torch.Tensor  # int64 [L], offset by each stream's start
    starts: list[int]  # start of each stream in the row
    lengths: list[int]


def pack(traces: list[Trace], device: torch.device | str = "cpu") -> PackedRow:
    starts, lengths, toks, pos, ev = [], [], [], [], []
    offset = 0
    for t in traces:
        T = len(t)
        starts.append(offset)
        lengths.append(T)
        toks.append(torch.as_tensor(t.tokens, dtype=torch.long))
        pos.append(torch.arange(T, dtype=torch.long))
        ev.append(torch.as_tensor(t.evict_at, dtype=torch.long) + offset)
        offset += T
    cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
    return PackedRow(cat(toks), cat(pos), cat(ev), starts, lengths)


def pack_greedy(traces: list[Trace], max_tokens: int) -> list[list[int]]:
    """Group trace indices into rows of at most ``max_tokens`` (first-fit decreasing)."""
    rows: list[list[int]] = []
    sizes: list[int] = []
    for k in sorted(range(len(traces)), key=lambda k: -len(traces[k])):
        n = len(traces[k])
        for r, s in enumerate(sizes):
            if s + n <= max_tokens:
                rows[r].append(k)
                sizes[r] += n
                break
        else:
            rows.append([k])
            sizes.append(n)
    return rows
