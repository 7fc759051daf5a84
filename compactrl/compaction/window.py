"""Plans that delete without asking the model: the oldest steps (sliding window, Markovian
thinker) or given steps (the recall task's eviction of its assignment)."""

from __future__ import annotations

from dataclasses import dataclass

from compactrl.compaction.base import Context, Decision, Request


@dataclass(frozen=True)
class DropOldest:
    stride: int

    def request(self, ctx: Context) -> Request | None:
        return None

    def decide(self, ctx: Context, answer: str | None) -> Decision:
        return Decision(delete=[s.index for s in ctx.steps[: self.stride]])


@dataclass(frozen=True)
class DropSteps:
    steps: tuple[int, ...]

    def request(self, ctx: Context) -> Request | None:
        return None

    def decide(self, ctx: Context, answer: str | None) -> Decision:
        live = {s.index for s in ctx.steps}
        return Decision(delete=[i for i in self.steps if i in live])
