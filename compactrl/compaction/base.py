"""The compaction interface: a strategy is a trigger (when) plus a plan (what to delete, and what
the model writes in its place). Both are small dataclasses, as kvpress presses are.

Compaction is step-wise. A *step* is one agent action with the observation that answers it
(step 0 is the episode's first observation, when the environment gives one apart from the
task); steps are deleted whole, message boundaries included, and the system/task head is never
deleted. Strategies see a :class:`Context` and never touch the engine: the rollout runner applies
their :class:`Decision` by evicting in place (``stream``) or by re-prefilling what is kept into a
fresh segment (``reprefill``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StepView:
    index: int  # 0 = the first observation, k = the k-th action and its observation
    tokens: int  # live tokens of the step
    text: str  # its messages as plain text (what `pick` shows the model)
    kind: str = "step"  # or "summary": a summary the model wrote at a compaction
    cursor: int | None = None  # the tool output's cursor id (a tool env's ``info["cursor"]``)
    tool: str | None = None  # the tool that produced it (``info["tool"]``)
    last_used: int = 0  # the latest action that created or referred to the cursor
    referenced: bool = False  # a later call referred to it (``info["refs"]``)


@dataclass(frozen=True)
class Context:
    """What a strategy sees at a step boundary: after the agent acted, before the reply is fed."""

    steps: list[StepView]  # live deletable steps, in stream order
    head_tokens: int  # the protected system/task head
    incoming_tokens: int  # the observation about to be fed
    step: int  # index of the step that just got its action
    steps_since_compaction: int
    last_action: str

    @property
    def live_tokens(self) -> int:
        return self.head_tokens + sum(s.tokens for s in self.steps)


@dataclass(frozen=True)
class Request:
    """Ask the policy to write something (a summary, a choice) in the stream before deciding."""

    prompt: str
    max_tokens: int
    role: str = "assistant"  # trace role of the answer (``summary`` for summaries)


@dataclass(frozen=True)
class Decision:
    delete: list[int]  # step indices to delete
    keep_answer: bool = False  # the request's answer stays (a summary) or goes (a pick)
    resume: str | None = None  # a user message appended after the kept answer
    fallback: bool = False  # the model's answer was unusable and a default was used


class Trigger(Protocol):
    def __call__(self, ctx: Context) -> bool: ...


class Plan(Protocol):
    def request(self, ctx: Context) -> Request | None: ...

    def decide(self, ctx: Context, answer: str | None) -> Decision: ...


@dataclass
class Strategy:
    name: str
    trigger: Trigger
    plan: Plan
    params: dict = field(default_factory=dict)


# ---- triggers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBudget:
    """Compact when the context would exceed ``budget`` tokens once the reply is fed."""

    budget: int

    def __call__(self, ctx: Context) -> bool:
        return ctx.live_tokens + ctx.incoming_tokens > self.budget


@dataclass(frozen=True)
class LiveSteps:
    """Compact when ``max_steps`` deletable steps are live (the sliding-window trigger)."""

    max_steps: int

    def __call__(self, ctx: Context) -> bool:
        return len([s for s in ctx.steps if s.kind == "step"]) >= self.max_steps


@dataclass(frozen=True)
class EverySteps:
    every: int

    def __call__(self, ctx: Context) -> bool:
        return ctx.steps_since_compaction >= self.every


@dataclass(frozen=True)
class ModelRequest:
    """Compact when the agent's action contains ``marker`` (the model asks for it)."""

    marker: str = "[compact]"

    def __call__(self, ctx: Context) -> bool:
        return self.marker in ctx.last_action


@dataclass(frozen=True)
class AtStep:
    step: int

    def __call__(self, ctx: Context) -> bool:
        return ctx.step == self.step
