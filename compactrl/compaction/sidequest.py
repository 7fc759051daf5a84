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

from compactrl.compaction.base import Context

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
