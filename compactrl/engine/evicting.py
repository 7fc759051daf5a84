"""The engine side of a session's token evictor (:mod:`compactrl.compaction.evictors`).

The engine's forward keeps the post-RoPE queries of sessions with an evictor (the method's last
``queries``, or all of them for H2O's running sums; nothing for other sessions). After each feed:
H2O adds the attention the new queries paid to every live key (before that step's evictions, so
over the keys they saw); then, once the session has fed everything appended and is over budget —
right after a prefill, or when ``interval`` tokens have been decoded since the last check — the
per-head scores of every layer are averaged and the lowest-scoring unprotected tokens are evicted
at ``e = fed``, in place and in ``evict_at``, like any other eviction. A method that ``draws``
(random) skips the keys: its scores come from the session's stream.

Everything here lives on the KV's device (positions, kept queries, sums, masks, scores): a GPU
session never mixes in CPU tensors, and only the evicted indices come back to the host.
"""

from __future__ import annotations

import time

import torch

from compactrl.engine.kv_book import KVBook
from compactrl.engine.runner import Feed


class EvictorState:
    def __init__(self, evictor, n_layers: int, head: int = 0):
        self.evictor = evictor
        self.head = head  # the protected system/task head: stream indices below it stay
        self.q: list[torch.Tensor | None] = [None] * n_layers  # kept queries per layer [W, H, D]
        self.q_pos: torch.Tensor | None = None  # their stream positions [W] (made on the KV's device)
        self.acc: list[torch.Tensor] = []  # H2O: attention received per layer [Hkv, capacity]
        self.seen: torch.Tensor | None = None  # H2O: queries that could see each stream index
        self.decoded = 0  # tokens decoded since the last check
        self.seconds = 0.0  # time spent here (the evictor's overhead)

    def keep(self, n: int) -> int:
        """How many of a feed's ``n`` queries the forward should hand over."""
        return n if self.evictor.accumulates else min(n, self.evictor.queries)

    @torch.inference_mode()
    def observe(self, book: KVBook, s, f: Feed) -> None:
        """Take session ``s``'s fed queries: keep the newest, and (H2O) add the attention they paid."""
        t0 = time.perf_counter()
        ev = self.evictor
        dev = book.kv.device
        end = f.start + f.n
        pos = torch.arange(end - len(f.queries[0]), end, device=dev) if f.queries else None
        if ev.accumulates and pos is not None:
            self._grow(end, book.kv.n_kv, dev)
            k_pos, keys = book.live_keys(s)
            for li, q in enumerate(f.queries):
                self.acc[li][:, k_pos] += ev.received(q, pos, keys[li], k_pos)
            # query i saw keys 0..i: key j was seen by min(m, end - j) of them
            self.seen[:end] += (end - torch.arange(end, device=dev)).clamp(max=len(pos))
        if ev.queries and pos is not None:
            W = ev.queries
            self.q_pos = pos if self.q_pos is None else torch.cat([self.q_pos, pos])[-W:]
            self.q = [q if old is None else torch.cat([old, q])[-W:] for old, q in zip(self.q, f.queries)]
        f.queries = []
        self.seconds += time.perf_counter() - t0

    def _grow(self, n: int, n_kv: int, device: torch.device) -> None:
        if not self.acc:
            self.acc = [torch.zeros(n_kv, 0, device=device) for _ in self.q]
            self.seen = torch.zeros(0, device=device)
        if self.acc[0].shape[1] < n:
            cap = max(n, 2 * self.acc[0].shape[1])
            self.acc = [torch.cat([a, a.new_zeros(n_kv, cap - a.shape[1])], 1) for a in self.acc]
            self.seen = torch.cat([self.seen, self.seen.new_zeros(cap - len(self.seen))])

    @torch.inference_mode()
    def after_feed(self, book: KVBook, s, decoded: int) -> None:
        """Evict down to the budget if due: right after a prefill, or every ``interval`` decoded tokens."""
        ev = self.evictor
        self.decoded += decoded
        if s.unfed or s.live <= ev.budget or (decoded and self.decoded < ev.interval):
            return
        t0 = time.perf_counter()
        self.decoded = 0
        if ev.draws:  # random: no keys, a draw from the stream so far
            k_pos, _ = book.live_keys(s, layers=False)
            score = ev.draw(s.tokens[: s.fed], k_pos)
        else:
            k_pos, keys = book.live_keys(s)
            score = self.scores(k_pos, keys).mean((0, 1))
        turn = torch.tensor(s.turn, device=k_pos.device)[k_pos]
        protected = (k_pos < self.head) | (k_pos >= s.fed - ev.window)
        if ev.protect_turn:
            protected |= turn == s.turn[-1]
        cand = torch.nonzero(~protected).squeeze(1)  # in stream order: ties evict the older first
        order = torch.argsort(score[cand], stable=True)
        gone = k_pos[cand[order[: s.live - ev.budget]]]
        if len(gone):
            s.evict_now(sorted(gone.tolist()))
        self.seconds += time.perf_counter() - t0

    def scores(self, k_pos: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
        """Every layer's per-KV-head scores of the live keys, ``[layers, Hkv, N]``."""
        ev = self.evictor
        out = []
        for li, k in enumerate(keys):
            acc = None
            if ev.accumulates:
                acc = self.acc[li][:, k_pos]
                if ev.average:
                    acc = acc / self.seen[k_pos]
            out.append(ev.layer_scores(self.q[li], self.q_pos, k, k_pos, acc))
        return torch.stack(out)

