"""SideQuest: the model deletes its own stale tool outputs, from an auxiliary thread.

Every ``every`` actions the rollout runner forks the main thread (the fork shares its KV, no copy),
appends the trigger phrase and lets the model write a short reasoning and then
``{"del_cursors": [c, ...]}``. The auxiliary tokens never enter the main stream: when the thread has
answered, the named cursors are deleted from the main thread at a later step boundary (parallel:
the main thread kept acting meanwhile; the boundary is set by a token clock, ``pace``) or at once
(sequential: it waited), in place (stream) or by re-prefilling the rest (reprefill), as every other
strategy deletes. A thread deletes only cursors it saw open at its fork, their outputs in.

The answer format and the justification template are shared by the runner's demonstrations and
the hindsight labeller (:mod:`compactrl.rl.sidequest`), so both teach one layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from compactrl.compaction.base import Context
from compactrl.trace import NO_CURSOR, Trace

TRIGGER = "Memory management mode"
_ANSWER = re.compile(r'\{\s*"del_cursors"\s*:\s*\[[^\[\]{}]*\]\s*\}')


def parse_deletions(text: str) -> list[int] | None:
    """The cursor ids of the last ``{"del_cursors": [...]}`` in ``text``; None if there is none, or
    it holds anything but non-negative integers."""
    found = _ANSWER.findall(text)
    if not found:
        return None
    try:
        ids = json.loads(found[-1])["del_cursors"]
    except json.JSONDecodeError:  # a sampled thread writes '[1, ]' or '[1 2]': unparsable, counted
        return None
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in ids):
        return None
    return sorted(set(ids))


def justify(cursor: int, tool: str | None, last_used: int) -> str:
    """One line of hindsight reasoning about a cursor to delete (the template the paper's larger
    model replaces: facts the context shows, no model-written prose)."""
    what = {"search": "search results", "open": "a page"}.get(tool or "", "a tool output")
    return f"Cursor {cursor} is {what}, last used at action {last_used}; it is not needed again."


def aux_answer(delete: list[tuple[int, str | None, int]]) -> str:
    """The auxiliary thread's target: a line per deleted cursor ``(cursor, tool, last_used)``, then
    the JSON the runner parses."""
    lines = [justify(*d) for d in delete] or ["Every open cursor may still be needed."]
    return "\n".join(lines) + "\n" + json.dumps({"del_cursors": [d[0] for d in delete]})


@dataclass(frozen=True)
class AuxEvery:
    """The trigger: after every ``every``-th action."""

    every: int

    def __call__(self, ctx: Context) -> bool:
        return ctx.step % self.every == 0


@dataclass(frozen=True)
class AuxThread:
    """The plan: what the auxiliary thread is asked and how its answer becomes a deletion."""

    trigger: str
    max_tokens: int
    parallel: bool
    at: str = "output"  # fork after the tool's output lands, or after the call ("call")
    keep_unread: bool = False  # the output of the action the thread was called after is never deleted
    keep_calls: bool = False  # a deleted cursor's output goes, the call that made it stays
    keep_titles: bool = False  # a deleted cursor's first line ("[Cursor c] <title>") stays
    pace: float = 1.0  # parallel: thread tokens per main-thread stream token (when its answer lands)

    def split(self, answer: str, live: set[int]) -> tuple[list[int] | None, list[int]]:
        """(live cursors to delete, named cursors that are not live); None: unparsable."""
        named = parse_deletions(answer)
        if named is None:
            return None, []
        return [c for c in named if c in live], [c for c in named if c not in live]


# ---- hindsight: what each cursor was used for, once the episode is over -------------------------------
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


def title_span(tokenizer, ids: list[int], cursor: int) -> tuple[int, int]:
    """The tokens of cursor ``cursor``'s output message that hold its first line, ``[Cursor c]
    <title>`` and its newline ((0, 0) if there is none): what ``keep_titles`` leaves of a deleted
    cursor, a ~11-token record of which page each hop reached."""
    text = tokenizer.decode(ids)
    i = text.find(f"[Cursor {cursor}]")
    if i < 0:
        return 0, 0
    j = text.find("\n", i)
    j = len(text) - 1 if j < 0 else j
    a = None
    for k in range(len(ids)):  # token k ends at this character; stop at the one holding the newline
        end = len(tokenizer.decode(ids[: k + 1]))
        a = k if a is None and end > i else a
        if end > j:
            return a, k + 1
    return a, len(ids)


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
