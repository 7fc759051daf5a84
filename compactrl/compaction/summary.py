"""The policy summarises its own older context (CompactionRL-style), and the summarised steps go.

When triggered, a summary prompt is appended and the policy writes the summary (trainable policy
tokens, trace role ``summary``). Then every step but the most recent ``tail`` is deleted, and so
is the prompt; the summary stays, followed by a resume prompt. In ``stream`` mode the summary
stays in the stream and the old steps are evicted around it; in ``reprefill`` mode the next
segment starts from the head, the tail, the summary and the resume prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from compactrl.compaction.base import Context, Decision, Request

SUMMARY_PROMPT = (
    "Your context is about to be compacted. Write a summary that lets you continue without it. Keep: "
    "the original task; the work completed so far; exact commands, names and values you will need "
    "again; errors met and how they were handled; the pending next steps. Be concise."
)
RESUME_PROMPT = "The older context was replaced by your summary above. Continue the task from there."


@dataclass(frozen=True)
class Summarize:
    tail: int = 2  # most recent steps kept verbatim
    max_tokens: int = 256  # summary length limit
    prompt: str = SUMMARY_PROMPT
    resume: str = RESUME_PROMPT

    def request(self, ctx: Context) -> Request | None:
        return Request(self.prompt, self.max_tokens, role="summary")

    def decide(self, ctx: Context, answer: str | None) -> Decision:
        old = ctx.steps[: max(0, len(ctx.steps) - self.tail)]
        return Decision(delete=[s.index for s in old], keep_answer=True, resume=self.resume)
