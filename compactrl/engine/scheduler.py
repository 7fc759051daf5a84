"""Which tokens an engine step feeds, and which sessions hold KV while it does: admission,
preemption and restore (nano-vllm's scheduler, for streams that evict).

Each step feeds decode tokens first, then prefill chunks in arrival order, within
``max_step_tokens`` and the KV pool. When the pool is full, admitting a session displaces only
idle residents (an agent between turns, idle past ``idle_grace_s``); a running session that must
grow may also displace the most recently admitted busy ones. A preempted session's KV is dropped;
it resumes by recomputing its whole stream under its eviction mask
(:func:`~compactrl.engine.runner.prefill_stream`), which reproduces the dropped K/V exactly.
"""

from __future__ import annotations

import time

import torch

from compactrl.engine.kv_book import KVBook
from compactrl.engine.runner import Feed, prefill_stream
from compactrl.models.lora import adapter_mask


class Scheduler:
    def __init__(self, config, book: KVBook, model, linears, projections) -> None:
        self.config, self.book, self.kv = config, book, book.kv
        self.sessions = book.sessions  # the engine's open sessions (shared, insertion-ordered)
        self.active: dict = {}  # insertion-ordered set of busy sessions
        self.model, self.linears, self.projections = model, linears, projections  # for restores
        self.tick = 0  # steps so far (admission order)

    def wake(self, s) -> None:
        self.active[s] = None
        s.last_active = time.monotonic()

    def release(self, s) -> None:
        """A session leaves the pool (close or preemption) and the busy set."""
        self.book.release(s)
        self.active.pop(s, None)

    def idle_residents(self) -> bool:
        """Idle sessions hold KV: waiting out their grace period (or displacing them) makes room."""
        return any(not s.busy and s.row is not None for s in self.sessions)

    def _displaceable(self, s, now: float) -> bool:
        """An idle resident that has been idle past the grace period (an agent between turns
        comes back soon: displacing it would only make it recompute)."""
        return not s.busy and now - s.last_active >= self.config.idle_grace_s

    def _preempt_one(self, keep: set, idle_only: bool) -> bool:
        now = time.monotonic()
        victims = [
            s for s in self.sessions
            if s.row is not None and s not in keep
            and (self._displaceable(s, now) if idle_only else True)
        ]  # fmt: skip
        if not victims:
            return False
        idle = [s for s in victims if not s.busy]
        # idle ones first, least recently active; then busy ones, most recently admitted (LIFO)
        v = min(idle, key=lambda s: s.last_active) if idle else max(victims, key=lambda s: s.admitted_at)
        self.release(v)
        v.metrics.preemptions += 1
        if v.busy:
            self.wake(v)
        return True

    def _make_room(self, need: int, keep: set, used: int, idle_only: bool = False) -> int | None:
        """Preempt until ``need`` more tokens fit; returns the pool usage then, or None if they can't.
        Admissions only displace idle sessions (so busy ones are not thrashed); growth may displace
        busy ones too."""
        while used + need > self.config.kv_pool_tokens:
            if not self._preempt_one(keep, idle_only):
                return None
            used = self.book.used()
        return used

    def _restore(self, s) -> None:
        """Give a non-resident session a row: empty if nothing was fed, else recompute its stream."""
        s.row = self.kv.alloc()
        s.admitted_at = self.tick
        if s.fed == 0:
            return
        T = s.fed
        ev = torch.tensor([T if e is None or e >= T else e for e in s.evict_at[:T]])
        own = s.adapter_from if s.adapter_from is not None else T
        with adapter_mask(self.model, lambda: torch.arange(T, device=self.kv.device) >= own):
            ks, vs, logits = prefill_stream(
                self.model, s.tokens[:T], ev, linears=self.linears, projections=self.projections
            )
        # live now: never evicted or evicted later than T. Drops due at T were requested while the
        # session was out: they are done here, so the row holds exactly the `live` it asked room for
        while s.drops and s.drops[0][0] == T:
            s.drops.popleft()
        alive = [j for j, e in enumerate(s.evict_at[:T]) if e is None or e > T]
        keep = torch.tensor(alive, dtype=torch.long, device=self.kv.device)
        start = self.kv.append(s.row, len(keep))
        for li in range(self.kv.n_layers):
            self.kv.k[li][s.row, :, start : start + len(keep)] = ks[li].index_select(1, keep)
            self.kv.v[li][s.row, :, start : start + len(keep)] = vs[li].index_select(1, keep)
        self.kv.pos[s.row, start : start + len(keep)] = keep
        self.kv.valid[s.row, start : start + len(keep)] = True
        s.pending_logits = logits
        s.metrics.reprefilled_tokens += T

    def schedule(self) -> tuple[list[Feed], int]:
        """Pick this step's tokens: decode tokens first, then prefill chunks in arrival order, within
        ``max_step_tokens``; admit (or resume) sessions and preempt others to fit the KV pool.
        Returns the feeds and the pool usage."""
        book = self.book
        feeds: list[Feed] = []
        picked: set = set()
        budget = self.config.max_step_tokens
        pool_used = book.used()
        for s in sorted(self.active, key=lambda s: not s.generating):
            if budget <= 0:
                break
            if s.unfed == 0:
                continue
            if s.row is None:  # new or preempted: (re)admit it, recomputing what it had fed
                room = self._make_room(book.blocks(s.live), picked | {s}, pool_used, idle_only=True)
                if room is None:
                    pool_used = book.used()
                    continue
                self._restore(s)
                book.apply_drops(s)
                pool_used = room + book.blocks(self.kv.used[s.row])
            limit = s.drops[0][0] - s.fed if s.drops else s.unfed  # an eviction splits the chunk
            n = min(s.unfed, limit, budget)
            before = book.blocks(self.kv.used[s.row])
            room = self._make_room(book.blocks(self.kv.used[s.row] + n) - before, picked | {s}, pool_used)
            if room is None:
                pool_used = book.used()
                continue
            entry = book.claim(s, n)
            pool_used = room - before + book.blocks(self.kv.used[s.row])
            done = s.fed + n == len(s.tokens)
            keep_q = s.evictor.keep(n) if s.evictor else 0
            feeds.append(Feed(s, s.tokens[s.fed : s.fed + n], s.fed, entry, s.row, s.chain, done, keep_q))
            picked.add(s)
            budget -= n
        return feeds, pool_used
