"""KV storage with in-place eviction: one contiguous row per resident session.

Each layer holds ``k, v: [rows, kv_heads, capacity, head_dim]``; a session's row stores the
RoPE'd K/V of its tokens in stream order. Evicting a token clears its ``valid`` bit (O(1), no
data moves); a row is compacted lazily, when holes pile up or it must grow. Contiguous rows
keep batched decode a plain strided SDPA (gather-based paging is 4-20x slower on CPU).

A row can also be frozen into a shared :class:`Segment` when a session forks: parent and child
then both read it as a prefix (each with its own valid bits), and continue in rows of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compactrl.models.config import ModelConfig


@dataclass(eq=False)
class Segment:
    """A frozen, shared prefix: the first ``n`` entries of a row no session writes any more."""

    row: int
    stream_index: np.ndarray
    refs: int = 0

    @property
    def n(self) -> int:
        return len(self.stream_index)


class KVCache:
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, rows: int = 4, capacity: int = 256
    ):
        self.n_layers, self.n_kv, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.dtype, self.device = dtype, device
        self.max_capacity = cfg.max_position_embeddings
        self.k = [self._zeros(rows, capacity) for _ in range(self.n_layers)]
        self.v = [self._zeros(rows, capacity) for _ in range(self.n_layers)]
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.pos = torch.zeros(rows, capacity, dtype=torch.long, device=device)  # stream index per entry
        self.used = [0] * rows  # entries written per row (live + holes)
        self.dead = [0] * rows  # holes per row (evicted entries not yet compacted away)
        self.free = list(range(rows - 1, -1, -1))

    def _zeros(self, rows: int, capacity: int) -> torch.Tensor:
        return torch.zeros(rows, self.n_kv, capacity, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def nbytes(self) -> int:
        kv = 2 * sum(t.numel() * t.element_size() for t in self.k)
        return kv + self.valid.numel() + self.pos.numel() * self.pos.element_size()

    # ---- rows ---------------------------------------------------------------------------
    def alloc(self) -> int:
        if not self.free:
            self._resize(2 * self.rows, self.capacity)
        return self.free.pop()

    def preallocate(self, rows: int, capacity: int) -> None:
        """Grow to at least ``rows`` rows of ``capacity`` entries now, as vLLM allocates its KV cache
        at start-up, so the first steps of a known workload do not pay for zero-filling and copying
        the cache as it doubles."""
        if rows > self.rows or capacity > self.capacity:
            self._resize(max(rows, self.rows), max(capacity, self.capacity))

    def release(self, row: int) -> None:
        self.valid[row, : self.used[row]] = False
        self.used[row] = self.dead[row] = 0
        self.free.append(row)

    def reserve(self, row: int, n: int) -> None:
        """Make room for ``n`` more entries in ``row`` (growing every row's capacity if needed)."""
        need = self.used[row] + n
        if need > self.capacity:
            cap = self.capacity
            while cap < need:
                cap *= 2
            self._resize(self.rows, min(max(cap, need), max(self.max_capacity, need)))

    def _resize(self, rows: int, capacity: int) -> None:
        r, c = self.rows, self.capacity
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = self._zeros(rows, capacity)
                new[:r, :, :c] = old
                store[i] = new
        for name in ("valid", "pos"):
            old = getattr(self, name)
            new = torch.zeros(rows, capacity, dtype=old.dtype, device=self.device)
            new[:r, :c] = old
            setattr(self, name, new)
        self.free = list(range(rows - 1, r - 1, -1)) + self.free
        self.used += [0] * (rows - r)
        self.dead += [0] * (rows - r)

    def append(self, row: int, n: int) -> int:
        """Claim ``n`` new entries at the end of ``row``; returns the first entry index. The writer
        (the step's forward) fills their K/V, ``pos`` and ``valid`` bits, batched across rows."""
        self.reserve(row, n)
        start = self.used[row]
        self.used[row] += n
        return start

    def gather(self, parts: list[tuple[int, torch.Tensor]]) -> int:
        """A new row holding the given entries ``(row, entries)`` of other rows, in order, K/V and
        stream index copied (no recompute). Used to fold a session's shared prefixes back into a
        row of its own once no other session reads them."""
        row = self.alloc()
        at = self.append(row, sum(len(e) for _, e in parts))
        for src, e in parts:
            m = len(e)
            for store in (self.k, self.v):
                for t in store:
                    t[row, :, at : at + m] = t[src].index_select(1, e)
            self.pos[row, at : at + m] = self.pos[src].index_select(0, e)
            self.valid[row, at : at + m] = True
            at += m
        return row

    def stream_index(self, row: int) -> torch.Tensor:
        """Stream index of every entry of ``row`` (sorted: entries are kept in stream order)."""
        return self.pos[row, : self.used[row]]

    def cut(self, row: int, stream_at: int) -> None:
        """Forget the row's entries at stream index ``stream_at`` and later: they are its last ones
        (entries are in stream order), so the row just ends before them."""
        at = int(torch.searchsorted(self.stream_index(row), stream_at))
        self.dead[row] -= int((~self.valid[row, at : self.used[row]]).sum())
        self.valid[row, at : self.used[row]] = False
        self.used[row] = at

    def invalidate(self, row: int, entries: torch.Tensor) -> None:
        """Evict entries in place: clear their valid bits (no data moves)."""
        self.valid[row, entries] = False
        self.dead[row] += len(entries)

    def compact(self, row: int) -> None:
        """Move the row's live entries to its front, keeping their order."""
        keep = torch.nonzero(self.valid[row, : self.used[row]]).squeeze(1)
        n = len(keep)
        for store in (self.k, self.v):
            for t in store:
                t[row, :, :n] = t[row].index_select(1, keep)
        self.pos[row, :n] = self.pos[row].index_select(0, keep)
        self.valid[row, : self.used[row]] = False
        self.valid[row, :n] = True
        self.used[row], self.dead[row] = n, 0
