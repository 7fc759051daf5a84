"""``evict_at`` -> attention masks: dense, chunked (CPU training), flex block mask (CUDA), packed rows.

Every mask here encodes the one invariant: query ``i`` attends key ``j`` iff
``j <= i < evict_at[j]``. Packing concatenates streams and offsets their ``evict_at`` by the
row start; because a never-evicted token has ``evict_at = T`` of its own stream, the offset
value is exactly the start of the next stream, so the document mask falls out of the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
class Stream:
    """What one stretch of a row feeds: a trace alone, or a main trace with its auxiliary threads'
    own tokens spliced in at their fork points. A fork's block follows the prefix it was forked
    from and is evicted where it ends, so it sees exactly that prefix and the main thread never
    sees it: one forward for the episode instead of one more per fork over its whole prefix."""

    members: list[int]  # trace indices, the main trace first
    index: list[np.ndarray]  # per member, where each of its tokens sits in the stream
    shared: list[int]  # per member, its first tokens [0, shared) are the main trace's (0: none)
    tokens: np.ndarray
    positions: np.ndarray  # each token's RoPE position in its own trace (a fork's go on from its fork point)
    evict_at: np.ndarray
    thread: np.ndarray  # bool: an auxiliary thread's own tokens (where a gated thread adapter acts)

    def __len__(self) -> int:
        return len(self.tokens)


def _alone(traces: list[Trace], k: int) -> Stream:
    t = traces[k]
    at = np.arange(len(t))
    return Stream([k], [at], [0], t.tokens, at, t.evict_at, t.thread_mask())


def _tree(traces: list[Trace], m: int, forks: list[int]) -> Stream:
    if not forks:
        return _alone(traces, m)
    main, T = traces[m], len(traces[m])
    forks = sorted(forks, key=lambda k: traces[k].meta["fork_at"])
    at = np.array([traces[k].meta["fork_at"] for k in forks])
    own = np.array([len(traces[k]) - a for k, a in zip(forks, at, strict=True)])
    before = np.concatenate([[0], np.cumsum(own)])  # the forks' tokens spliced in before each block

    def moved(i, side="right"):  # a main index's place in the stream: after the blocks forked at <= i
        return i + before[np.searchsorted(at, i, side)]

    # an eviction at a fork point that the fork had too lands before its block, any other after it
    early = np.zeros(T, bool)
    for k, a in zip(forks, at, strict=True):
        early[:a] |= traces[k].evict_at[:a] == a
    main_at = moved(np.arange(T))
    L = T + int(before[-1])
    tokens, positions, evict_at = (np.zeros(L, np.int64) for _ in range(3))
    thread = np.zeros(L, bool)
    tokens[main_at], positions[main_at] = main.tokens, np.arange(T)
    evict_at[main_at] = np.where(early, moved(main.evict_at, "left"), moved(main.evict_at))
    index = [main_at]
    for b, (k, a) in enumerate(zip(forks, at, strict=True)):
        block = a + before[b] + np.arange(own[b])
        tokens[block], positions[block] = traces[k].tokens[a:], np.arange(a, len(traces[k]))
        evict_at[block], thread[block] = a + before[b + 1], True  # gone where the block ends
        index.append(np.concatenate([main_at[:a], block]))
    return Stream([m, *forks], index, [0, *at.tolist()], tokens, positions, evict_at, thread)


def _exact(s: Stream, traces: list[Trace]) -> list[bool]:
    """Per member: its queries see in the stream exactly the keys they saw in its own trace. Key
    ``j`` is seen by the member's queries ``[j, evict_at[j])``; in the stream by the member's
    queries before the first one at or past its stream ``evict_at``; a key of another member must
    be seen by none of them. O(L log L): no L x L mask."""
    out = []
    for k, idx in zip(s.members, s.index, strict=True):
        own = np.searchsorted(idx, s.evict_at[idx]) == traces[k].evict_at
        other = np.setdiff1d(np.arange(len(s)), idx)
        unseen = np.searchsorted(idx, other) == np.searchsorted(idx, s.evict_at[other])
        out.append(bool(own.all() and unseen.all()))
    return out


def streams(traces: list[Trace], splice: bool = True) -> list[Stream]:
    """The traces as streams: with ``splice`` each auxiliary-thread trace (``meta["aux"]``) joins
    the main trace it was forked from (the same tokens up to its ``fork_at``) when the spliced
    stream reproduces every member's visibility exactly (checked); otherwise it stays alone."""
    if not splice:
        return [_alone(traces, k) for k in range(len(traces))]
    mains = [k for k, t in enumerate(traces) if not t.meta.get("aux")]
    attached: dict[int, list[int]] = {m: [] for m in mains}
    alone = []

    def forked_from(m: int, fork: Trace) -> bool:
        a = fork.meta["fork_at"]
        return 0 < a <= len(traces[m]) and np.array_equal(traces[m].tokens[:a], fork.tokens[:a])

    for k, t in enumerate(traces):
        if t.meta.get("aux"):
            m = next((m for m in mains if forked_from(m, t)), None)
            (alone if m is None else attached[m]).append(k)
    out = []
    for m, forks in attached.items():
        s = _tree(traces, m, forks)
        while len(s.members) > 1 and not all(ok := _exact(s, traces)):
            bad = [k for k, good in zip(s.members[1:], ok[1:], strict=True) if not (good and ok[0])]
            alone += bad
            s = _tree(traces, m, [k for k in s.members[1:] if k not in bad])
        out.append(s)
    return out + [_alone(traces, k) for k in alone]


@dataclass
class PackedRow:
    """Several streams concatenated into one row, each at its own positions."""

    tokens: torch.Tensor  # int64 [L]
    positions: torch.Tensor  # int64 [L]
    evict_at: torch.Tensor  # int64 [L], offset by each stream's start
    starts: list[int]  # start of each stream in the row
    lengths: list[int]


def pack(items: list[Stream | Trace], device: torch.device | str = "cpu") -> PackedRow:
    """Concatenate streams (a trace is fed at positions 0..T-1) into one row."""
    starts, lengths, toks, pos, ev = [], [], [], [], []
    offset = 0
    for s in items:
        T = len(s)
        starts.append(offset)
        lengths.append(T)
        toks.append(torch.as_tensor(s.tokens, dtype=torch.long))
        p = s.positions if isinstance(s, Stream) else np.arange(T)
        pos.append(torch.as_tensor(p, dtype=torch.long))
        ev.append(torch.as_tensor(s.evict_at, dtype=torch.long) + offset)
        offset += T
    cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
    return PackedRow(cat(toks), cat(pos), cat(ev), starts, lengths)


def pack_greedy(traces: list[Stream | Trace], max_tokens: int) -> list[list[int]]:
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
