"""Compaction strategies and their typed configs (``[strategy]`` in a run's TOML)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.compaction.base import (
    AtStep,
    Context,
    Decision,
    EverySteps,
    LiveSteps,
    ModelRequest,
    Request,
    StepView,
    Strategy,
    TokenBudget,
    Trigger,
)
from compactrl.compaction.cursors import DropOpenedSearch, DropUnreferenced, KeepLastCursors, RandomCursors
from compactrl.compaction.pick import Pick
from compactrl.compaction.sidequest import TRIGGER, AuxEvery, AuxThread
from compactrl.compaction.summary import Summarize
from compactrl.compaction.window import DropOldest, DropSteps

__all__ = [
    "Context", "Decision", "Request", "StepView", "Strategy", "StrategyConfig", "build_strategy",
]  # fmt: skip


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoCompaction(_Config):
    name: Literal["none"] = "none"


class SlidingWindow(_Config):
    """When ``max_turns`` steps are live, delete the oldest ``stride`` (stride = max_turns // 2 is
    the Markovian thinker)."""

    name: Literal["sliding_window"] = "sliding_window"
    max_turns: int = Field(10, ge=1, description="compact when this many steps are live")
    stride: int = Field(1, ge=1, description="the oldest steps deleted per compaction")

    @model_validator(mode="after")
    def _stride(self):
        if self.stride > self.max_turns:
            raise ValueError(f"stride {self.stride} > max_turns {self.max_turns}; use 1..max_turns")
        return self


class Markovian(_Config):
    name: Literal["markovian"] = "markovian"
    max_turns: int = Field(10, ge=2, description="at this many live steps, delete the oldest half")


class _Triggered(_Config):
    trigger: Literal["budget", "every", "request"] = Field(
        "budget",
        description="when to compact — budget: the live context is over `budget` tokens; every: every "
        "`every` steps; request: the model writes `marker`",
    )
    budget: int = Field(2048, gt=0, description="token budget of the live context (trigger 'budget')")
    every: int = Field(10, ge=1, description="steps between compactions (trigger 'every')")
    marker: str = Field("[compact]", min_length=1, description="text that asks for it (trigger 'request')")

    def make_trigger(self) -> Trigger:
        if self.trigger == "every":
            return EverySteps(self.every)
        if self.trigger == "request":
            return ModelRequest(self.marker)
        return TokenBudget(self.budget)


class Summary(_Triggered):
    name: Literal["summary"] = "summary"
    tail: int = Field(2, ge=0, description="recent steps kept verbatim")
    max_tokens: int = Field(256, ge=1, description="summary length limit")


class PickTurns(_Triggered):
    name: Literal["pick"] = "pick"
    keep_budget: int | None = Field(
        None, gt=0, description="tokens the kept steps may use (default budget/2)"
    )
    max_tokens: int = Field(32, ge=1, description="length limit of the model's KEEP: answer")


class EvictSteps(_Config):
    """Delete given steps once step ``at_step`` has acted (the recall task's eviction)."""

    name: Literal["evict_steps"] = "evict_steps"
    at_step: int = Field(1, ge=0, description="delete once this step has acted (0: the first step)")
    steps: list[int] = Field([0], description="the steps deleted (0: the first)")


class KeepLastCursorsConfig(_Config):
    """Cursor rule: keep the newest ``n`` tool outputs; older cursors are deleted."""

    name: Literal["keep_last_cursors"] = "keep_last_cursors"
    n: int = Field(2, ge=1, description="tool outputs kept (the newest)")


class DropOpenedSearchConfig(_Config):
    """Cursor rule: delete a search-results cursor once a link from it has been opened."""

    name: Literal["drop_opened_search"] = "drop_opened_search"


class DropUnreferencedConfig(_Config):
    """Cursor rule: delete cursors not created or referred to for ``m`` actions."""

    name: Literal["drop_unreferenced"] = "drop_unreferenced"
    m: int = Field(3, ge=1, description="actions without a reference after which a cursor goes")


class RandomCursorsConfig(_Config):
    """Cursor rule, the control for a learned deleter: after every ``every``-th action each open
    cursor (its output in) is deleted with probability ``rate`` (bench memory's ``rate_from`` sets
    it to a SideQuest row's realised rate)."""

    name: Literal["random_cursors"] = "random_cursors"
    rate: float = Field(0.5, ge=0, le=1, description="probability that an open cursor is deleted at a call")
    every: int = Field(2, ge=1, description="actions between calls (as SideQuest's every)")
    seed: int = Field(0, ge=0, description="seeds the draws (hashed with the cursor, the action, its text)")


class SideQuestConfig(_Config):
    """SideQuest: after every ``every``-th action an auxiliary thread, a fork sharing the main
    thread's KV, names the tool outputs (cursors) to delete; its tokens never enter the main stream."""

    name: Literal["sidequest"] = "sidequest"
    every: int = Field(2, ge=1, description="actions between auxiliary calls (the paper's 4 suits "
                       "longer episodes than browse's 3-6 actions)")  # fmt: skip
    parallel: bool = Field(
        True, description="the main thread keeps acting while the auxiliary thread runs (its deletions "
        "apply at the next step boundary); false: the main thread waits for it (an ablation)"
    )  # fmt: skip
    at: Literal["output", "call"] = Field(
        "output", description="where the thread forks — output: after the tool's output lands (the "
        "paper's turn boundary; the call and the output it reads are both held then); call: after the "
        "call, before its output lands, so the output the call was read from can go before the next one "
        "arrives (the tool runs meanwhile)"
    )  # fmt: skip
    keep_unread: bool = Field(
        False, description="an answer naming the tool output of the action the thread was called "
        "after does not delete it (counted: aux_kept_unread): no action has read it yet, so the "
        "hindsight labels never expire it (at = 'call' that output is not in at the fork, so the thread "
        "never deletes it anyway: a thread deletes only cursors it saw open)"
    )  # fmt: skip
    keep_calls: bool = Field(
        False, description="a deleted cursor loses its tool output only; the call that made it stays "
        "(a ~15-token record of each hop the policy can count); false: the call goes with it"
    )  # fmt: skip
    keep_titles: bool = Field(
        False, description="a deleted cursor's output keeps its first line ('[Cursor c] <page title>', "
        "~11 tokens), so the policy still sees which page each hop reached; false: the output goes whole"
    )  # fmt: skip
    pace: float = Field(
        1.0, gt=0, description="parallel: the thread writes this many tokens per token the main thread "
        "adds to its stream (generated or fed); its answer lands at the first step boundary by which that "
        "clock has let it write it all, so where deletions land depends on tokens, never on machine speed"
    )  # fmt: skip
    trigger: str = Field(TRIGGER, min_length=1, description="the user message that starts the thread")
    max_tokens: int = Field(160, ge=8, description="the auxiliary thread's reasoning and answer")
    thread_adapter: str | None = Field(
        None, description="a checkpoint folder of a sidequest.adapter = 'thread' fine-tune: its LoRA "
        "adapters act on the auxiliary thread's tokens only, the main thread stays model.path; in training "
        "(objective = 'rl') it stays frozen while the policy's own LoRA learns"
    )  # fmt: skip


StrategyConfig = Annotated[
    NoCompaction
    | SlidingWindow
    | Markovian
    | Summary
    | PickTurns
    | EvictSteps
    | KeepLastCursorsConfig
    | DropOpenedSearchConfig
    | DropUnreferencedConfig
    | RandomCursorsConfig
    | SideQuestConfig,
    Field(discriminator="name"),
]


def build_strategy(cfg) -> Strategy | None:
    """The strategy object for a config; None for ``none``."""
    params = cfg.model_dump()
    if isinstance(cfg, NoCompaction):
        return None
    if isinstance(cfg, SlidingWindow):
        return Strategy(cfg.name, LiveSteps(cfg.max_turns), DropOldest(cfg.stride), params)
    if isinstance(cfg, Markovian):
        return Strategy(cfg.name, LiveSteps(cfg.max_turns), DropOldest(cfg.max_turns // 2), params)
    if isinstance(cfg, Summary):
        return Strategy(cfg.name, cfg.make_trigger(), Summarize(cfg.tail, cfg.max_tokens), params)
    if isinstance(cfg, PickTurns):
        return Strategy(
            cfg.name, cfg.make_trigger(), Pick(cfg.keep_budget or cfg.budget // 2, cfg.max_tokens), params
        )
    if isinstance(cfg, EvictSteps):
        return Strategy(cfg.name, AtStep(cfg.at_step), DropSteps(tuple(cfg.steps)), params)
    if isinstance(cfg, KeepLastCursorsConfig):  # a cursor rule is its own trigger and plan
        return Strategy(cfg.name, rule := KeepLastCursors(cfg.n), rule, params)
    if isinstance(cfg, DropOpenedSearchConfig):
        return Strategy(cfg.name, rule := DropOpenedSearch(), rule, params)
    if isinstance(cfg, DropUnreferencedConfig):
        return Strategy(cfg.name, rule := DropUnreferenced(cfg.m), rule, params)
    if isinstance(cfg, RandomCursorsConfig):
        return Strategy(cfg.name, rule := RandomCursors(cfg.rate, cfg.every, cfg.seed), rule, params)
    if isinstance(cfg, SideQuestConfig):
        return Strategy(
            cfg.name,
            AuxEvery(cfg.every),
            AuxThread(**cfg.model_dump(include=set(AuxThread.__dataclass_fields__))),
            params,
        )
    raise TypeError(f"unknown strategy config {cfg!r}")
