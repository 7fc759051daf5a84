"""SideQuest's hindsight labels (its Algorithm 2) and the training samples built from them.

On a correct trace, cursor ``c``'s last use ``l_c`` is the last action that reads it (a tool call
naming it) or cites it (the final answer); the action right after a tool output reads that output
too, so ``l_c`` is at least the action after the one that made it. Cursor ``c`` is expired at
action ``t`` iff ``l_c < t``. At each auxiliary call (before action ``t``, every ``every`` actions,
as the rollout runner calls it) the expired, still live cursors are split into ``D`` (pretended
already deleted: evicted from the input at the call where they first expired, as a thread that had
deleted them then would have left the cache) and ``S`` (still open: the targets). A sample is the
trace up to the call with ``D`` evicted, the trigger, and the target: one templated line of
hindsight facts per cursor of ``S`` (:func:`compactrl.compaction.sidequest.aux_answer`, no model
writes it) then ``{"del_cursors": S}``; only the target is trained.

The split is the paper's random one (``split="random"``), or ``"history"``: ``D`` = every cursor
that expired at an earlier call, which is exactly what the runner's sequential SideQuest
demonstrations hold at each call (a test checks it token for token and mask for mask).
"""

from __future__ import annotations

import random
from typing import Literal

import numpy as np

from compactrl.agent.chat import ChatFormat
from compactrl.agent.hindsight import (
    Action,
    actions_of,
    aux_calls,
    deletable,
    fork_point,
    last_use,
    live_at,
    title_mask,
)
from compactrl.compaction.sidequest import TRIGGER, aux_answer
from compactrl.trace import NO_CURSOR, Trace


def aux_prefix(fmt: ChatFormat, trigger: str = TRIGGER) -> tuple[list[int], list[int]]:
    """The trigger message and the generation prompt, as the runner renders them mid-conversation."""
    chat = fmt.conversation()
    chat.message("system", "-")
    chat.message("user", "-")
    return chat.message("user", trigger), chat.prompt()


def hindsight_samples(
    trace: Trace,
    fmt: ChatFormat,
    every: int,
    rng: random.Random,
    split: Literal["random", "history"] = "random",
    trigger: str = TRIGGER,
    at: str = "output",
    keep_calls: bool = False,
    keep_titles: bool = False,
) -> list[Trace]:
    """One training sample per auxiliary call of a correct trace (one stream: full context or stream
    mode; a re-prefill episode's segments are not one stream), forked where the runner forks
    (``at``: after the tool's output, or after the call, before it); ``keep_calls``: a cursor of
    ``D`` loses its output only, as the runner deletes then; ``keep_titles``: each output's first line
    stays (see :func:`compactrl.compaction.sidequest.title_span`)."""
    acts = actions_of(trace)
    last, made = last_use(acts), {a.cursor: a for a in acts if a.cursor is not None}
    calls = aux_calls(len(acts), every)
    at = {t: fork_point(trace, acts, t, at) for t in calls}
    first_expired = {c: min((t for t in calls if l < t), default=None) for c, l in last.items()}
    message, prompt = aux_prefix(fmt, trigger)
    stop = fmt.stop_ids[0]
    titles = title_mask(trace, fmt.tokenizer) if keep_titles else None
    removed = deletable(trace, keep_calls, titles)
    samples = []
    for t in calls:
        b = at[t]
        live = live_at(trace, sorted(made), b, keep_calls, titles)
        expired = [c for c in live if last[c] < t]
        if split == "history":
            gone = [c for c in expired if first_expired[c] < t]
        else:
            gone = rng.sample(expired, rng.randint(0, len(expired)))
        target = [c for c in expired if c not in gone]
        answer = aux_answer([(c, made[c].tool, _last_used(acts, c, t)) for c in target])
        target_ids = fmt.tokenizer.encode(answer) + [stop]
        tail = message + prompt + target_ids
        T, m, g = b + len(tail), len(message), len(prompt) + len(target_ids)
        # evicted before the call stays evicted; at it or later (this call's own deletions) is live here
        ev = np.r_[np.where(trace.evict_at[:b] < b, trace.evict_at[:b], T), np.full(len(tail), T)]
        for c in gone:  # deleted at the call it first expired at, as the thread would have
            ev[:b][(trace.cursor[:b] == c) & removed[:b] & (ev[:b] == T)] = at[first_expired[c]]
        turn = int(trace.turn[b])  # the trigger takes the turn the action would have, as in the runner
        samples.append(Trace.from_tokens(
            np.r_[trace.tokens[:b], tail], evict_at=ev,
            trainable=np.r_[np.zeros(T - len(target_ids), bool), np.ones(len(target_ids), bool)],
            turn=np.r_[trace.turn[:b], np.full(m, turn), np.full(g, turn + 1)],
            role=trace.role[:b] + ["user"] * m + ["assistant"] * g,
            cursor=np.r_[trace.cursor[:b], np.full(len(tail), NO_CURSOR)],
            rollout_id=f"{trace.rollout_id}-hindsight{t}",
            meta={"aux": True, "action": t, "fork_at": b, "deleted": gone, "target": target},
        ))  # fmt: skip
    return samples


def _last_used(acts: list[Action], c: int, t: int) -> int:
    """The last action before ``t`` that made or named cursor ``c`` (what the context shows)."""
    return max(a.number for a in acts[: t - 1] if a.cursor == c or c in a.refs)
