"""The KV bookkeeping of the engine's sessions: which row each resident session holds, the holes
evictions leave in it, and the frozen prefixes forks share (nano-vllm's block manager, for rows).

A resident session owns one row of the :class:`~compactrl.engine.kv_cache.KVCache`; a fork
freezes its parent's row into a :class:`~compactrl.engine.kv_cache.Segment` both read (the
session's ``chain``), and each continues in a new row. A segment goes when its last reader does.
Evictions are recorded on the session (``drops``) and cleared here once the stream is fed up to
them. The functions take sessions as data: their ``row``, ``chain``, ``drops``, ``fed``.
"""

from __future__ import annotations

import numpy as np
import torch

from compactrl.engine.kv_cache import KVCache, Segment


def _locate(sorted_idx: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of ``idx`` in the sorted array, and which of them are present."""
    pos = np.searchsorted(sorted_idx, idx)
    if not len(sorted_idx):
        return pos, np.zeros(len(idx), dtype=bool)
    return pos, (pos < len(sorted_idx)) & (sorted_idx[np.minimum(pos, len(sorted_idx) - 1)] == idx)


class KVBook:
    def __init__(self, kv: KVCache, sessions: dict, block_size: int = 1, compact_holes: float = 0.25) -> None:
        self.kv = kv
        self.sessions = sessions  # the engine's open sessions (shared)
        self.block_size, self.compact_holes = block_size, compact_holes
        self.segments: set[Segment] = set()

    def blocks(self, n: int) -> int:
        b = self.block_size
        return -(-n // b) * b

    def used(self) -> int:
        """Pool usage: every resident row (live entries + holes) and every shared prefix, once."""
        rows = sum(self.blocks(self.kv.used[s.row]) for s in self.sessions if s.row is not None)
        return rows + sum(self.blocks(seg.n) for seg in self.segments)

    def share(self, parent, child, tick: int) -> None:
        """A fork: freeze the parent's row into a prefix both read, and give each a new row."""
        if parent.row is None:
            return
        seg = Segment(parent.row, self.kv.stream_index(parent.row).cpu().numpy().copy(), refs=2)
        self.segments.add(seg)
        mask = self.kv.valid[parent.row, : seg.n].clone()
        for g, _ in parent.chain:
            g.refs += 1  # the child's reference to the parent's older prefixes
        child.chain = [(g, m.clone()) for g, m in parent.chain] + [(seg, mask.clone())]
        parent.chain = parent.chain + [(seg, mask)]
        for s in (parent, child):
            s.row = self.kv.alloc()
            s.admitted_at = tick

    def release(self, s) -> None:
        """Drop a session's KV (close or preemption); shared prefixes go when their last reader does."""
        if s.row is not None:
            self.kv.release(s.row)
            s.row = None
        for seg, _ in s.chain:
            seg.refs -= 1
            if seg.refs == 0:
                self.kv.release(seg.row)
                self.segments.discard(seg)
        s.chain = []

    def truncate(self, s, keep: int) -> None:
        """Cut a session's KV back to its first ``keep`` stream tokens."""
        if s.row is not None:
            self.kv.cut(s.row, keep)
        for seg, mask in s.chain:
            mask[torch.as_tensor(seg.stream_index >= keep, device=mask.device)] = False

    def live_parts(self, s, chain=None) -> list[tuple[int, torch.Tensor]]:
        """A resident session's live KV entries in stream order, as ``(row, entries)``: those of its
        shared prefixes (``chain``, default all of them) first, then its own row's."""
        parts = [
            (seg.row, torch.nonzero(mask).squeeze(1)) for seg, mask in (s.chain if chain is None else chain)
        ]
        return parts + [(s.row, torch.nonzero(self.kv.valid[s.row, : self.kv.used[s.row]]).squeeze(1))]

    def unchain(self, s) -> None:
        """Fold the shared prefixes at the end of a session's chain that no other session reads any
        more (their forks closed) back into one row of its own: a chained session attends segment
        by segment, an unchained one decodes in the batched path."""
        k = len(s.chain)
        while k and s.chain[k - 1][0].refs == 1:
            k -= 1
        if s.row is None or k == len(s.chain):
            return
        row = self.kv.gather(self.live_parts(s, s.chain[k:]))
        self.kv.release(s.row)
        for seg, _ in s.chain[k:]:
            self.kv.release(seg.row)
            self.segments.discard(seg)
        s.row, s.chain = row, s.chain[:k]

    def apply_drops(self, s) -> None:
        """Clear the KV of evictions that are due (fed == e); a non-resident session keeps them
        pending until its recompute has put those tokens back."""
        while s.row is not None and s.drops and s.drops[0][0] == s.fed:
            _, idx = s.drops.popleft()
            idx = np.asarray(idx)
            pos, mine = _locate(self.kv.stream_index(s.row).cpu().numpy(), idx)
            if mine.any():
                self.kv.invalidate(s.row, torch.as_tensor(pos[mine], device=self.kv.device))
            for j in idx[~mine]:
                for seg, mask in s.chain:
                    p, found = _locate(seg.stream_index, np.array([j]))
                    if found[0]:
                        mask[int(p[0])] = False
                        break
                else:
                    raise AssertionError(f"session {s.id}: token {j} is live but not in its KV")

    def claim(self, s, n: int) -> int:
        """``n`` new entries at the end of the session's row (compacting it first when it is mostly
        holes); returns the first."""
        if self.kv.dead[s.row] > max(32, self.compact_holes * self.kv.used[s.row]):
            self.kv.compact(s.row)
        return self.kv.append(s.row, n)

    def live_keys(self, s, layers: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A resident session's live keys in stream order: their stream positions ``[N]`` and, per
        layer, ``[Hkv, N, D]`` (shared prefixes of a fork first, then its own row; none unless
        ``layers``), all on the KV's device."""
        kv, parts = self.kv, self.live_parts(s)
        pos = torch.cat([kv.pos[row, e] for row, e in parts])
        if not layers:
            return pos, []
        return pos, [torch.cat([kv.k[li][row][:, e] for row, e in parts], 1) for li in range(kv.n_layers)]
