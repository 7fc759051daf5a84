"""What a server session records of its messages and of each request: the message records (the
tokens each message holds in the stream), a request's plan, and its token accounting."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from compactrl.agent.chat import Conversation


def key(role: str, content: str, extra: dict[str, Any] | None = None) -> tuple:
    """What a message is matched by: role, content and its template fields (tool calls with their
    arguments parsed, a tool message's call id)."""
    return role, content, json.dumps(extra, sort_keys=True) if extra else ""


@dataclass(eq=False)
class Record:
    """A message of the session: its tokens are ``[start, end)`` of the stream (until deleted)."""

    role: str
    content: str
    start: int
    end: int
    step: int  # -1: the head; else the step (an observation, an answer and what follows, a summary)
    cursor: int | None = None  # a tool message's cursor id
    deleted: bool = False  # deleted by the session's own compaction; the client may still send it
    kind: str = "step"  # "summary": a summary the session's strategy wrote, or its resume message
    own: bool = False  # written by the session (a summary, a question to the model), not the client
    extra: dict[str, Any] | None = None  # the template's other fields (tool_calls, tool_call_id, name)
    sent: tuple | None = None  # an answer returned with tool calls: the key of the message as returned

    def message(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, **(self.extra or {})}

    def key(self) -> tuple:
        return self.sent or key(self.role, self.content, self.extra)


@dataclass
class Plan:
    records: list[Record]  # the records after the request (kept ones, new ones appended later)
    gone: list[Record]  # live records the client removed
    drop: list[Record]  # live records the session's strategy deletes
    new: list[tuple[str, str, dict, list[int]]]  # (role, content, extra, tokens) appended
    prompt: list[int]  # the generation prompt
    conv: Conversation  # the conversation after the plan
    ask: tuple | None = None  # (context, groups, request): the strategy asks the model first
    rooted: int = 0  # tokens fed into a new group root (the group's first prompt) for this request


@dataclass
class Usage:
    """One request's token accounting (OpenAI's usage plus compactrl's own counts)."""

    prompt_tokens: int = 0  # live tokens the completion is conditioned on
    cached_tokens: int = 0  # of those, tokens whose KV was already in the stream
    prefilled_tokens: int = 0  # tokens fed for this request (new messages, generation prompt)
    evicted_tokens: int = 0  # tokens this request removed from the stream
    completion_tokens: int = 0

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "prefilled_tokens": self.prefilled_tokens,
            "evicted_tokens": self.evicted_tokens,
        }
