"""Hindsight facts of a finished episode: what each tool output (cursor) was used for, when it
expired, and which cursors a SideQuest thread saw open at its fork. SideQuest's labeller
(:mod:`compactrl.rl.sidequest`) trains on them; :func:`deletion_scores` grades the threads'
deletions against them (precision and recall in the rollout summary)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compactrl.compaction.sidequest import title_span
from compactrl.trace import NO_CURSOR, Trace


@dataclass(frozen=True)
class Action:
    number: int  # 1, 2, ... in stream order
    end: int  # stream index of its last generated token
    cursor: int | None  # the cursor its output became
    refs: tuple[int, ...]  # the cursors it named (open) or cited (answer)
    tool: str | None


def actions_of(trace: Trace) -> list[Action]:
    """The trace's actions, from the facts the rollout runner keeps in its meta."""
    facts = trace.meta.get("action_facts")
    if facts is None:
        raise ValueError(
            f"trace {trace.rollout_id!r} has no meta['action_facts']: label traces the rollout runner "
            "wrote (compactrl rollout, or demonstrations played by the runner)"
        )
    return [Action(n, int(e), c, tuple(refs), tool) for n, (e, c, refs, tool) in enumerate(facts, 1)]


def last_use(actions: list[Action]) -> dict[int, int]:
    """cursor -> the action number of its last use (at least the action after the one that made it)."""
    last = {a.cursor: a.number + 1 for a in actions if a.cursor is not None}
    for a in actions:
        for c in a.refs:
            if c in last:
                last[c] = max(last[c], a.number)
    return last


def aux_calls(n_actions: int, every: int) -> list[int]:
    """The actions the auxiliary thread runs before: after every ``every``-th action, up to the last."""
    return list(range(every + 1, n_actions + 1, every))


def boundary(trace: Trace, action: Action) -> int:
    """Where the action's message starts in the stream."""
    return int(np.flatnonzero(trace.turn == trace.turn[action.end])[0])


def fork_point(trace: Trace, acts: list[Action], t: int, at: str = "output") -> int:
    """Where the thread called before action ``t`` forks: where action ``t``'s message starts
    (``output``: action ``t - 1``'s output is in), or where action ``t - 1``'s call ends (``call``:
    its output is not in yet)."""
    if at == "output":
        return boundary(trace, acts[t - 1])
    return int(np.flatnonzero(trace.turn > trace.turn[acts[t - 2].end])[0])


def title_mask(trace: Trace, tokenizer) -> np.ndarray:
    """The tokens of each cursor's output that hold its first line (see :func:`title_span`)."""
    out = np.zeros(len(trace), dtype=bool)
    user = np.asarray(trace.role) == "user"
    for c in set(trace.cursor[user].tolist()) - {NO_CURSOR}:
        idx = np.flatnonzero(user & (trace.cursor == c))
        a, b = title_span(tokenizer, trace.tokens[idx].tolist(), c)
        out[idx[a:b]] = True
    return out


def deletable(trace: Trace, keep_calls: bool = False, titles: np.ndarray | None = None) -> np.ndarray:
    """The tokens a cursor's deletion removes, of those labelled with it: its call and its output,
    or (``keep_calls``) its output only (the tool's user message); ``titles``: tokens it leaves."""
    out = np.asarray(trace.role) == "user" if keep_calls else np.ones(len(trace), dtype=bool)
    return out if titles is None else out & ~titles


def live_at(
    trace: Trace, cursors, b: int, keep_calls: bool = False, titles: np.ndarray | None = None
) -> list[int]:
    """The ``cursors`` a thread forked at ``b`` sees open: some token a deletion would remove is
    in before ``b`` and not evicted by then."""
    held = (trace.evict_at[:b] >= b) & deletable(trace, keep_calls, titles)[:b]
    return [c for c in cursors if (held & (trace.cursor[:b] == c)).any()]


def deletion_scores(main: Trace, aux: list[Trace]) -> dict[str, int]:
    """The auxiliary threads' answers against the hindsight labels of the episode they ran in: per
    call (fork before action ``t``), the cursors named vs the expired ones live at the fork.
    ``correct / named`` is the deletion precision, ``correct / expired`` the recall. A thread whose
    answer had not landed when the episode ended (``meta["unfinished"]``) acted on nothing: left out."""
    acts = actions_of(main)
    last, made = last_use(acts), {a.cursor: a for a in acts if a.cursor is not None}
    out = {"calls": 0, "named": 0, "expired": 0, "correct": 0}
    for x in (x for x in aux if not x.meta.get("unfinished")):
        t, b, named = x.meta["action"] + 1, x.meta["fork_at"], set(x.meta.get("named") or ())
        live = set(live_at(main, made, b, x.meta.get("keep_calls", False)))  # as the thread saw
        expired = {c for c in live if last[c] < t}
        named &= live  # a cursor that was not open deletes nothing (the runner counts it apart)
        out["calls"] += 1
        out["named"] += len(named)
        out["expired"] += len(expired)
        out["correct"] += len(named & expired)
    return out
