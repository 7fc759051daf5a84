"""Cursor rules: the cheap, non-learned ways to drop stale tool outputs (a baseline SideQuest's
paper did not compare against). A tool env labels each output with a cursor id
(``info["cursor"]``) and each call with the cursors it refers to (``info["refs"]``); a step that
holds a tool output is that cursor, its call and output deleted whole, in place (stream) or by
re-prefilling the rest (reprefill), as every step-wise strategy does.

Each rule is its own trigger and plan: it compacts at a step boundary exactly when it has
something to delete. ``RandomCursors`` is the control a learned deleter (SideQuest) is measured
against: it deletes as often as that deleter did, at random.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from compactrl.compaction.base import Context, Decision, Request, StepView


def live_cursors(ctx: Context) -> list[StepView]:
    return [s for s in ctx.steps if s.cursor is not None]


def cursor_steps(ctx: Context, cursors: list[int]) -> list[int]:
    """The step indices holding ``cursors``; a cursor that is not live is a ValueError naming it."""
    by_cursor = {s.cursor: s.index for s in live_cursors(ctx)}
    unknown = [c for c in cursors if c not in by_cursor]
    if unknown:
        raise ValueError(f"cursor(s) {unknown} are not live; live cursors: {sorted(by_cursor)}")
    return [by_cursor[c] for c in cursors]


@dataclass(frozen=True)
class _Rule:
    def stale(self, ctx: Context) -> list[int]:
        raise NotImplementedError

    def __call__(self, ctx: Context) -> bool:  # the trigger
        return bool(self.stale(ctx))

    def request(self, ctx: Context) -> Request | None:
        return None

    def decide(self, ctx: Context, answer: str | None) -> Decision:
        return Decision(delete=cursor_steps(ctx, self.stale(ctx)))


@dataclass(frozen=True)
class KeepLastCursors(_Rule):
    """Keep the newest ``n`` tool outputs (the one about to be read included)."""

    n: int

    def stale(self, ctx: Context) -> list[int]:
        live = live_cursors(ctx)
        return [s.cursor for s in live[: max(0, len(live) - self.n)]]


@dataclass(frozen=True)
class DropOpenedSearch(_Rule):
    """Delete a search-results cursor once a later call has opened a link from it."""

    def stale(self, ctx: Context) -> list[int]:
        return [s.cursor for s in live_cursors(ctx) if s.tool == "search" and s.referenced]


@dataclass(frozen=True)
class DropUnreferenced(_Rule):
    """Delete cursors that no call has created or referred to for ``m`` actions."""

    m: int

    def stale(self, ctx: Context) -> list[int]:
        return [s.cursor for s in live_cursors(ctx) if ctx.step - s.last_used >= self.m]


@dataclass(frozen=True)
class RandomCursors(_Rule):
    """After every ``every``-th action, delete each open cursor with probability ``rate``, as
    SideQuest's thread is called and offered them: the cursors whose output is in (the output this
    action's call is about to read is not). A draw is a hash of ``seed``, the cursor, the action and
    the cursor's text: the same episode draws alike in every run, episodes draw apart."""

    rate: float
    every: int
    seed: int

    def _draw(self, ctx: Context, s: StepView) -> float:
        key = hashlib.blake2b(f"{self.seed}/{s.cursor}/{ctx.step}/{s.text}".encode(), digest_size=8)
        return int.from_bytes(key.digest(), "little") / 2**64

    def stale(self, ctx: Context) -> list[int]:
        if ctx.step % self.every:
            return []
        offered = [s for s in live_cursors(ctx) if s.referenced or s.last_used < ctx.step]
        return [s.cursor for s in offered if self._draw(ctx, s) < self.rate]
