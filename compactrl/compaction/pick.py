"""The model picks which steps to keep within a token budget.

It is shown the live steps, numbered, with their sizes, and answers ``KEEP: 3, 7, 8``. An answer
that does not parse, names a step that is not live, or goes over the budget is *not* trusted: the
documented default (keep the most recent steps that fit) is used instead and counted as a
fallback in the episode's metrics. The question and the answer are deleted with the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from compactrl.compaction.base import Context, Decision, Request

_KEEP = re.compile(r"KEEP:\s*(\d+(?:\s*,\s*\d+)*)", re.IGNORECASE)


def _preview(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


@dataclass(frozen=True)
class Pick:
    budget: int  # tokens the kept steps may use (the head is not counted)
    max_tokens: int = 32
    preview_chars: int = 80

    def request(self, ctx: Context) -> Request | None:
        lines = [f"[{s.index}] ({s.tokens} tokens) {_preview(s.text, self.preview_chars)}" for s in ctx.steps]
        prompt = (
            f"Your context is over budget. Choose the turns to keep, within {self.budget} tokens in all:\n"
            + "\n".join(lines)
            + "\nAnswer 'KEEP: ' followed by the turn numbers, separated by commas."
        )
        return Request(prompt, self.max_tokens, role="assistant")

    def default(self, ctx: Context) -> list[int]:
        """The most recent steps that fit in the budget."""
        keep, used = [], 0
        for s in reversed(ctx.steps):
            if used + s.tokens > self.budget:
                break
            keep.append(s.index)
            used += s.tokens
        return keep

    def parse(self, ctx: Context, answer: str | None) -> list[int] | None:
        m = _KEEP.search(answer or "")
        if m is None:
            return None
        keep = {int(x) for x in m.group(1).split(",")}
        sizes = {s.index: s.tokens for s in ctx.steps}
        if not keep <= set(sizes) or sum(sizes[i] for i in keep) > self.budget:
            return None
        return sorted(keep)

    def decide(self, ctx: Context, answer: str | None) -> Decision:
        keep = self.parse(ctx, answer)
        fallback = keep is None
        keep = set(self.default(ctx) if keep is None else keep)
        return Decision(delete=[s.index for s in ctx.steps if s.index not in keep], fallback=fallback)
