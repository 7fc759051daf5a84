"""A client's session: one engine stream that lives across requests, and the messages live in it.

Each request sends the whole message list, as OpenAI clients do. The session compares it with the
messages live in its stream and turns the difference into stream operations (``plan``):

* a message the client sends back unchanged is matched to its tokens (an assistant message to the
  tokens sampled for it, by the text this server returned; never re-tokenised);
* messages appended: only their tokens are fed;
* messages removed, anywhere: their tokens are evicted in place (``evict_at`` recorded, positions
  kept, nothing re-prefilled);
* a message changed or inserted before the end: from there on every live message is evicted and
  the request's messages are fed again (what a prefix cache gives).

Matching walks the request in order and takes, for each message, the first live message after the
previous match with the same role and content; the first message with no such match ends it. With
``compaction = "reprefill"`` only a common prefix is kept: the stream is cut at the first difference
and everything after it is fed again at contiguous positions (fresh-prefill semantics, KV of the
prefix reused), and each cut stream is kept as a trace segment.

A plan is made and checked (position limit, KV pool) on a fork of the conversation before anything
changes, so a request that cannot be served leaves the session as it was.

Semantics, as KV-streams define them: a surviving token keeps the K/V computed while the removed
messages were visible to it. Clients that need each prompt to mean exactly what a fresh prefill of
the message list means use ``compaction = "reprefill"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from compactrl.agent.chat import ChatFormat, Conversation
from compactrl.engine import Engine, SamplingParams
from compactrl.engine.session import Generation
from compactrl.serve.protocol import ApiError


@dataclass
class Live:
    """A message live in the stream: its tokens are ``[start, end)`` of the stream."""

    role: str
    content: str
    start: int
    end: int

    def message(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass
class Plan:
    keep: list[int]  # indices of live messages kept
    gone: list[Live]  # live messages removed
    new: list[tuple[str, str, list[int]]]  # (role, content, tokens) appended
    prompt: list[int]  # the generation prompt
    conv: Conversation  # the conversation after the plan
    cut: int | None = None  # reprefill: the stream is cut here


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


class ChatSession:
    """Lives on the engine's thread: every method is called there, between engine steps."""

    def __init__(
        self,
        sid: str,
        engine: Engine,
        fmt: ChatFormat,
        compaction: str = "stream",
        evictor=None,
        kind: str = "chat",
    ):
        self.id, self.engine, self.fmt, self.compaction, self.kind = sid, engine, fmt, compaction, kind
        self.evictor = evictor
        self.stream = engine.session(sid)
        if evictor is not None:
            self.stream.use_evictor(evictor)
        self.conv = fmt.conversation()
        self.live: list[Live] = []
        self.turn = -1
        self.segments: list[dict] = []  # reprefill: the traces of the streams cut before
        self.busy = False
        self.last_used = time.monotonic()

    # ---- planning (nothing changes) ---------------------------------------------------------
    def _match(self, messages: list[tuple[str, str]]) -> tuple[list[int], int]:
        """Indices of the live messages the request keeps, and how many request messages they cover."""
        keep: list[int] = []
        j = 0
        for k, m in enumerate(messages):
            if self.compaction == "reprefill":
                found = j if j < len(self.live) and (self.live[j].role, self.live[j].content) == m else None
            else:
                found = next(
                    (i for i in range(j, len(self.live)) if (self.live[i].role, self.live[i].content) == m),
                    None,
                )
            if found is None:
                return keep, k
            keep.append(found)
            j = found + 1
        return keep, len(messages)

    def plan(self, messages: list[tuple[str, str]], max_tokens: int) -> Plan:
        keep, k = self._match(messages)
        kept = set(keep)
        gone = [m for i, m in enumerate(self.live) if i not in kept]
        conv = self.conv.fork()
        conv.reset([self.live[i].message() for i in keep])
        new = [(role, text, conv.message(role, text)) for role, text in messages[k:]]
        prompt = conv.prompt()
        cut = gone[0].start if gone and self.compaction == "reprefill" else None
        plan = Plan(keep, gone, new, prompt, conv, cut)
        base = len(self.stream.tokens) if cut is None else cut
        adding = sum(len(t) for *_, t in new) + len(prompt)
        if base + adding >= self.engine.position_limit:
            raise ApiError(
                413,
                f"this request needs {base + adding} stream positions and at least one more to "
                f"generate, but the model's position limit is {self.engine.position_limit} (positions "
                "are never renumbered: removed messages do not free them); start a new session or "
                "use a model with more positions",
                "messages",
                "context_length_exceeded",
            )
        live = self.stream.live - self._live_tokens(gone) + adding
        need = self.engine._blocks(live + min(max_tokens, self.engine.position_limit - base - adding))
        if need > self.engine.config.kv_pool_tokens:
            raise ApiError(
                413,
                f"this request needs {need} KV tokens (live context plus max_tokens) but the "
                f"pool holds {self.engine.config.kv_pool_tokens}; remove messages, lower max_tokens "
                "or raise --kv-pool-tokens",
                "messages",
                "context_length_exceeded",
            )
        return plan

    def _live_tokens(self, gone: list[Live]) -> int:
        ev = self.stream.evict_at
        return sum(1 for m in gone for j in range(m.start, m.end) if ev[j] is None)

    # ---- applying ---------------------------------------------------------------------------
    def apply(self, plan: Plan, usage: Usage) -> None:
        """Evict (or cut) what the client removed, feed what it added, and the generation prompt."""
        if plan.cut is not None:
            self.segments.append(self.stream.trace().to_dict())
            usage.evicted_tokens = self.stream.truncate(plan.cut)
        elif plan.gone:
            ev = self.stream.evict_at
            idx = [j for m in plan.gone for j in range(m.start, m.end) if ev[j] is None]
            usage.evicted_tokens = self.stream.evict(idx) if idx else 0
        self.live = [self.live[i] for i in plan.keep]
        self.conv = plan.conv
        usage.cached_tokens = self.stream.live
        for role, text, toks in plan.new:
            self.turn += 1
            start = len(self.stream.tokens)
            self.stream.append(toks, role=role, turn=self.turn)
            self.live.append(Live(role, text, start, len(self.stream.tokens)))
        self.turn += 1
        self.answer_start = len(self.stream.tokens)
        self.stream.append(plan.prompt, role="assistant", turn=self.turn)
        usage.prefilled_tokens = sum(len(t) for *_, t in plan.new) + len(plan.prompt)
        usage.prompt_tokens = self.stream.live

    def generate(self, params: SamplingParams) -> Generation:
        return self.stream.generate(params, role="assistant", turn=self.turn)

    def finish(self, gen: Generation, text: str) -> None:
        """Close the answer as the template does and record it as a live message with ``text`` (what
        the client was sent): sent back unchanged, it matches these sampled tokens."""
        close = self.conv.close(gen.tokens)
        if len(self.stream.tokens) + len(close) <= self.engine.position_limit:
            self.stream.append(close, role="assistant", turn=self.turn)
        self.conv.messages[-1] = {"role": "assistant", "content": text}
        self.live.append(Live("assistant", text, self.answer_start, len(self.stream.tokens)))
        self.last_used = time.monotonic()

    # ---- token prompts (/v1/completions) ------------------------------------------------------
    def sync_tokens(self, prompt: list[int], max_tokens: int, usage: Usage) -> None:
        """A token prompt continues the session by its longest common prefix with the live tokens:
        the rest of the live tokens is evicted (stream) or cut (reprefill), the rest of the prompt fed."""
        ev, toks = self.stream.evict_at, self.stream.tokens
        live = [j for j, e in enumerate(ev) if e is None]
        p = 0
        while p < min(len(live), len(prompt)) and toks[live[p]] == prompt[p]:
            p += 1
        fresh_logits = self.stream.unfed or self.stream.pending_logits is not None
        if p == len(prompt) and (p < len(live) or not fresh_logits):  # nothing new to feed: the last
            p -= 1  # prompt token is fed again, for the logits that the first sampled token needs
        gone = live[p:]
        base = len(toks) if not gone or self.compaction == "stream" else gone[0]
        if base + len(prompt) - p >= self.engine.position_limit:
            raise ApiError(
                413,
                f"this prompt needs {base + len(prompt) - p} stream positions and at least one "
                f"more to generate, past the model's position limit of {self.engine.position_limit}",
                "prompt",
                "context_length_exceeded",
            )
        need = self.engine._blocks(len(prompt) + max_tokens)
        if need > self.engine.config.kv_pool_tokens:
            raise ApiError(
                413,
                f"this request needs {need} KV tokens but the pool holds "
                f"{self.engine.config.kv_pool_tokens}; lower max_tokens or raise --kv-pool-tokens",
                "prompt",
                "context_length_exceeded",
            )
        if gone and self.compaction == "reprefill":
            self.segments.append(self.stream.trace().to_dict())
            usage.evicted_tokens = self.stream.truncate(gone[0])
        elif gone:
            usage.evicted_tokens = self.stream.evict(gone)
        usage.cached_tokens = self.stream.live
        self.turn += 1
        self.stream.append(prompt[p:], role="user", turn=self.turn)
        usage.prefilled_tokens = len(prompt) - p
        usage.prompt_tokens = self.stream.live

    def trace(self) -> list[dict]:
        """The session's stream as compactrl traces (traces.jsonl rows): one, or with reprefill one per
        segment (each stream cut, then the current one)."""
        return [*self.segments, self.stream.trace().to_dict()]

    def close(self) -> None:
        if self.stream.generating:
            self.stream.cancel()
        self.stream.close()
