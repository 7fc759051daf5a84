"""A client's session: one engine stream that lives across requests, and the messages recorded in it.

Each request sends the whole message list, as OpenAI clients do. The session compares it with the
messages it recorded and turns the difference into stream operations (:meth:`ChatSession.plan`):

* a message the client sends back unchanged is matched to its tokens (an assistant message to the
  tokens sampled for it, by the text this server returned, or by its content and tool calls when it
  was returned with tool calls; never re-tokenised);
* messages appended: only their tokens are fed;
* messages removed, anywhere: their tokens are evicted in place (``evict_at`` recorded, positions
  kept, nothing re-prefilled);
* a message changed or inserted before the end: from there on every recorded message is evicted
  and the request's messages are fed again (what a prefix cache gives).

Matching walks the request in order and takes, for each message, the first recorded message after
the previous match with the same role and content (and tool calls, or tool call id); the first
message with no such match ends it.

A session may also compact on its own (``strategy``: any step-wise compactrl strategy;
``evictor``: a token evictor), so a client that never edits its list still runs in bounded memory.
A message the session deleted stays recorded as deleted: the client may keep sending it, and it
is matched and stays out of the stream. Steps are as a rollout numbers them: the system messages
and the first other message (the task) are the protected head; messages after the task and before
the first answer are the first observation's step; then each answer and the messages that follow it
are a step; a tool message is a cursor. A strategy that asks the model (``summary``, ``pick``)
asks it in the stream at the step boundary, before the request's new messages are fed, exactly as
a rollout does; what the session writes so (a kept summary and its resume message) is the
session's own: the client never sends it, and it stays until the session's strategy deletes it.

With ``compaction = "reprefill"`` the stream is never evicted in place: at the first message removed
(by the client or the session's strategy) it is cut, and every kept message after it is fed again at
contiguous positions (its original tokens), then the new ones: fresh-prefill semantics with the
prefix's KV reused. Each cut stream is kept as a trace segment.

A plan is made and checked (position limit, KV pool) on a fork of the conversation before anything
changes, so a request that cannot be served leaves the session as it was.

Semantics, as KV-streams define them: a surviving token keeps the K/V computed while the removed
messages were visible to it. Clients that need each prompt to mean exactly what a fresh prefill of
the message list means use ``compaction = "reprefill"``.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

from compactrl.agent.chat import ChatFormat, Conversation
from compactrl.compaction import Context, Decision, StepView, build_strategy
from compactrl.engine import Engine, SamplingParams
from compactrl.engine.session import Generation
from compactrl.serve.protocol import ApiError
from compactrl.serve.records import Plan, Record, Usage, key
from compactrl.serve.sidequest import side_quest, thread_due
from compactrl.serve.tools import template_calls
from compactrl.trace import NO_CURSOR

# strategies a session runs on its own (drop_opened_search needs each output's tool: clients don't say)
SERVER_STRATEGIES = ("none", "sliding_window", "markovian", "summary", "pick", "evict_steps",
                     "keep_last_cursors", "drop_unreferenced", "random_cursors", "sidequest")  # fmt: skip
CURSOR_LABEL = re.compile(r"^\s*\[Cursor (\d+)\]")
STATS = ("compactions", "pick_fallbacks", "aux_calls", "aux_tokens", "deleted_cursors", "aux_parse_failures",
         "aux_no_room", "aux_unknown_cursors", "aux_kept_unread", "tool_call_parse_failures")  # fmt: skip


class ChatSession:
    """Lives on the engine's thread: every method is called there, between engine steps."""

    def __init__(
        self,
        sid: str,
        engine: Engine,
        fmt: ChatFormat,
        compaction: str = "stream",
        evictor=None,
        strategy=None,
        kind: str = "chat",
        tools: list[dict] | None = None,
        group: str | None = None,
        groups: dict | None = None,
    ):
        self.id, self.engine, self.fmt, self.compaction, self.kind = sid, engine, fmt, compaction, kind
        # sessions of one group (a GRPO group's rollouts) read their common first prompt from one root
        # stream: ``groups`` maps a group to its root (the worker's), a root knows its members
        self.group, self.groups, self.root, self.members = group, groups, None, set()
        self.rooted = 0  # tokens this session fed into its group's new root (the shared first prompt)
        self.tools = tools  # rendered in the head by ``fmt``: the session keeps them
        self.evictor, self.strategy_cfg = evictor, strategy
        self.strategy = build_strategy(strategy) if strategy is not None else None
        self.stream = engine.session(sid)
        if evictor is not None:
            self.stream.use_evictor(evictor)
        self.conv = fmt.conversation()
        self.records: list[Record] = []
        # steps as a rollout numbers them: -1 the head (system messages and the task); then, in order,
        # the first observation (messages after the task, before the first answer), each answer with
        # what follows it, each summary the session writes
        self.step = -1  # the step new client messages join
        self.next_step = 0
        self.answer_step = -1  # the newest answer's step
        self.actions = 0  # answers so far
        self.action_of: dict[int, int] = {}  # an answer's step -> its action number
        self.compacted_at = 0  # actions at the latest compaction
        self.next_cursor = 0
        self.threads: list[dict] = []  # SideQuest: the auxiliary threads' traces
        self.stats = dict.fromkeys(STATS, 0)
        self.turn = -1
        self.segments: list[dict] = []  # reprefill: the traces of the streams cut before
        self.busy = False
        self.last_used = time.monotonic()

    # ---- planning (nothing changes) ---------------------------------------------------------
    def _match(self, messages: list[tuple[str, str, dict]]) -> tuple[list[int], int]:
        """Indices of the records the request keeps, and how many request messages they cover."""
        keep: list[int] = []
        j = 0
        for k, m in enumerate(messages):
            want = key(*m)
            found = next(
                (
                    i
                    for i in range(j, len(self.records))
                    if not self.records[i].own and self.records[i].key() == want
                ),
                None,
            )
            if found is None:
                return keep, k
            keep.append(found)
            j = found + 1
        return keep, len(messages)

    def live(self, r: Record) -> list[int]:
        ev = self.stream.evict_at
        return [j for j in range(r.start, r.end) if ev[j] is None]

    def _cursor(self, role: str, content: str) -> int | None:
        """A message after the first answer is a cursor when it opens with ``[Cursor N]`` (id N; the
        browse env labels its outputs so) or is a tool message (the next unused id)."""
        if self.actions == 0:
            return None
        if m := CURSOR_LABEL.match(content):
            return int(m.group(1))
        return self.next_cursor if role == "tool" else None

    def _new_step(self) -> int:
        self.next_step += 1
        return self.next_step - 1

    def _context(self, live: list[Record], incoming: int, incoming_cursor: int | None):
        """The strategy's view at this step boundary, and each view's records (by step)."""
        groups: dict[int, list[Record]] = {}
        for r in live:
            if r.step >= 0:
                groups.setdefault(r.step, []).append(r)
        views = []
        for k, rs in groups.items():
            cursor = next((r.cursor for r in reversed(rs) if r.cursor is not None), None)
            if k == self.answer_step and incoming_cursor is not None:
                cursor = incoming_cursor  # the output about to be read is this step's cursor
            text = "\n".join(r.content for r in rs)
            size = sum(len(self.live(r)) for r in rs)
            views.append(StepView(k, size, text, rs[0].kind, cursor, last_used=self.action_of.get(k, 0)))
        head = sum(len(self.live(r)) for r in live if r.step < 0)
        answers = [r for r in live if r.role == "assistant" and not r.own]
        ctx = Context(
            views,
            head,
            incoming,
            self.actions,
            self.actions - self.compacted_at,
            answers[-1].content if answers else "",
        )
        return ctx, groups

    def _compaction(self, live: list[Record], incoming: int, incoming_cursor: int | None):
        """What the session's strategy does at this step boundary: the records it deletes, or (for a
        strategy that asks the model first) the question to ask: ``(context, groups, request)``."""
        if self.strategy is None or self.actions == 0 or self.strategy.name == "sidequest":
            return [], None
        ctx, groups = self._context(live, incoming, incoming_cursor)
        if not self.strategy.trigger(ctx):
            return [], None
        if (req := self.strategy.plan.request(ctx)) is not None:
            return [], (ctx, groups, req)
        return self._decided(ctx, groups, None)[0], None

    def _decided(self, ctx: Context, groups: dict, answer: str | None) -> tuple[list[Record], Decision]:
        """The strategy's decision and the records it deletes (the newest answer's step, whose output
        is still coming, stays)."""
        decision = self.strategy.plan.decide(ctx, answer)
        self.stats["pick_fallbacks"] += int(decision.fallback)
        gone = [
            r for i in set(decision.delete) - {self.answer_step} for r in groups.get(i, ()) if not r.deleted
        ]
        return gone, decision

    def plan(self, messages: list[tuple], max_tokens: int) -> Plan:
        """``messages``: ``(role, content)`` or ``(role, content, extra)`` (the template's other fields)."""
        rooted = (
            self._join(messages) if self.group is not None and not self.records and self.root is None else 0
        )
        messages = [(m[0], m[1], m[2] if len(m) > 2 else {}) for m in messages]
        keep, k = self._match(messages)
        kept = set(keep)
        gone = [r for i, r in enumerate(self.records) if i not in kept and not r.deleted and not r.own]
        records = [r for i, r in enumerate(self.records) if i in kept or r.own]
        live = [r for r in records if not r.deleted]

        def render(live: list[Record]) -> tuple[Conversation, list]:  # the new messages after ``live``
            conv = self.conv.fork()
            conv.reset([r.message() for r in live])
            return conv, [
                (role, text, extra, conv.message(role, text, extra=extra))
                for role, text, extra in messages[k:]
            ]

        conv, new = render(live)
        cursors = [c for role, text, _ in messages[k:] if (c := self._cursor(role, text)) is not None]
        drop, ask = self._compaction(live, sum(len(t) for *_, t in new), cursors[0] if cursors else None)
        if drop:  # rendered again after what the strategy deletes
            live = [r for r in live if r not in drop]
            conv, new = render(live)
        prompt = conv.prompt()
        plan = Plan(records, gone, drop, new, prompt, conv, ask, rooted)
        base = len(self.stream.tokens)
        if self.compaction == "reprefill" and (gone or drop):  # cut at the first removed, the rest fed again
            cut = min(r.start for r in gone + drop)
            base = cut + sum(r.end - r.start for r in live if r.start > cut)
        adding = sum(len(t) for *_, t in new) + len(prompt)
        if ask is not None:  # the question, its answer and a resume message come first
            plan.conv = self.conv.fork()  # _ask renders the new messages after them
            plan.conv.reset([r.message() for r in live])
            asked = plan.conv.fork()
            req, resume = ask[2], getattr(self.strategy.plan, "resume", "")
            adding += len(asked.message("user", req.prompt)) + len(asked.prompt()) + req.max_tokens
            adding += len(asked.message("user", resume)) if resume else 0
        limit = self.engine.position_limit
        if base + adding >= limit:
            raise ApiError(
                413,
                f"this request needs {base + adding} stream positions and at least one more to "
                f"generate, but the model's position limit is {limit} (positions are never "
                "renumbered: removed messages do not free them); start a new session or use a model "
                "with more positions",
                "messages",
                "context_length_exceeded",
            )
        going = sum(len(self.live(r)) for r in gone + drop)
        live = self.stream.live - going + adding
        need = self.engine.book.blocks(live + min(max_tokens, limit - base - adding))
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

    # ---- applying ---------------------------------------------------------------------------
    def apply(self, plan: Plan, usage: Usage, temperature: float = 1.0, seed: int | None = None) -> None:
        """Evict (or cut) what was removed, feed what was added (with SideQuest, its thread runs after
        the call or after the output, as ``at`` says), and the generation prompt."""
        s = self.stream
        usage.evicted_tokens, usage.prefilled_tokens = self._remove(plan.gone + plan.drop)
        usage.prefilled_tokens += plan.rooted
        if plan.drop:
            self.compacted_at = self.actions
            self.stats["compactions"] += 1
        self.records, self.conv = plan.records, plan.conv
        usage.cached_tokens = s.live - usage.prefilled_tokens
        if plan.ask is not None:
            self._ask(plan, usage, temperature, seed)
        thread = thread_due(self)
        if thread == "call":  # the call is in, its output not yet
            side_quest(self, temperature, seed)
        self._feed(plan.new)
        if thread == "output":
            side_quest(self, temperature, seed)
        if s.evictor is not None:  # the head (system prompt, task) is never evicted
            s.evictor.head = max((r.end for r in self.records if r.step < 0), default=0)
        self.turn += 1
        self.answer_start = len(s.tokens)
        s.append(plan.prompt, role="assistant", turn=self.turn)
        usage.prefilled_tokens += sum(len(t) for *_, t in plan.new) + len(plan.prompt)
        usage.prompt_tokens = s.live

    def _feed(self, new: list[tuple]) -> None:
        """Append the request's new messages (rendered by the plan) to the stream and the records."""
        for role, text, extra, toks in new:
            if role == "assistant":  # an answer the client wrote: a step of its own
                self._answered()
            elif self.actions == 0 and self.step < 0 and any(r.role != "system" for r in self.records):
                self.step = self._new_step()  # after the task, before the first answer: the first observation
            self._add(role, text, extra, toks)

    def _join(self, messages: list[tuple]) -> int:
        """A group's first prompt is fed once, into a root stream that never generates; a session whose
        first request sends exactly that prompt forks the root (its KV shared, not computed again) and
        continues from there. Not for reprefill or evictor sessions, or another chat format (tools).
        Returns the tokens this request fed into a new root."""
        if self.compaction != "stream" or self.evictor is not None:
            return 0
        root, fed = self.groups.get(self.group), 0
        if root is None:
            root = ChatSession(f"{self.id}-group-root", self.engine, self.fmt, kind=self.kind)
            root._feed(root.plan(messages, 1).new)
            self.groups[self.group] = root
            fed = len(root.stream.tokens)
        keep, k = root._match(messages)
        if root.fmt is not self.fmt or k < len(messages) or keep != list(range(len(root.records))):
            return 0
        self.stream.close()
        self.stream = root.stream.fork(self.id)
        self.conv, self.records = root.conv.fork(), [replace(r) for r in root.records]
        for name in ("step", "next_step", "answer_step", "actions", "turn", "next_cursor"):
            setattr(self, name, getattr(root, name))
        self.root, self.rooted = root, fed
        root.members.add(self.id)
        return fed

    # ---- a strategy that asks the model (summary, pick) ----------------------------------------
    def _ask(self, plan: Plan, usage: Usage, temperature: float, seed: int | None) -> None:
        """Ask the strategy's question in the stream, let the model answer, and apply the decision:
        the chosen steps go with the question (and the answer, unless it is a summary that stays,
        followed by the resume message). The request's new messages are then rendered after it."""
        ctx, groups, req = plan.ask
        s, conv = self.stream, self.conv
        fed = len(s.tokens)
        asked = self._own("user", req.prompt, conv.message("user", req.prompt), "ask")
        self.turn += 1
        start = len(s.tokens)
        s.append(conv.prompt(), role=req.role, turn=self.turn)
        params = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=list(self.fmt.stop_ids),
        )
        gen = s.generate(params, role=req.role, turn=self.turn)
        self.engine.run(until=[gen])
        if gen.error is not None:
            raise gen.error
        s.append(conv.close(gen.tokens), role=req.role, turn=self.turn)
        answer = self.fmt.text(gen.tokens)
        conv.messages[-1] = {"role": "assistant", "content": answer}
        written = Record(
            "assistant", answer, start, len(s.tokens), self._new_step(), kind="summary", own=True
        )
        self.records.append(written)
        gone, decision = self._decided(ctx, groups, answer)
        gone += [asked] + ([] if decision.keep_answer else [written])
        if decision.keep_answer and decision.resume:
            resume = self._own("user", decision.resume, conv.message("user", decision.resume), "summary")
            resume.step = written.step
        usage.prefilled_tokens += len(s.tokens) - fed - len(gen.tokens)  # the question, the resume
        evicted, refed = self._remove(gone)
        usage.evicted_tokens += evicted
        usage.prefilled_tokens += refed
        self.compacted_at = self.actions
        self.stats["compactions"] += 1
        self.conv.reset([r.message() for r in self.records if not r.deleted])
        plan.new = [
            (role, text, extra, self.conv.message(role, text, extra=extra))
            for role, text, extra, _ in plan.new
        ]
        plan.prompt = self.conv.prompt()

    def _own(self, role: str, text: str, toks: list[int], kind: str) -> Record:
        """Feed a message the session writes itself (never sent by the client)."""
        self.turn += 1
        start = len(self.stream.tokens)
        self.stream.append(toks, role=role, turn=self.turn)
        r = Record(role, text, start, len(self.stream.tokens), self.step, kind=kind, own=True)
        self.records.append(r)
        return r

    def _remove(self, gone: list[Record]) -> tuple[int, int]:
        """Remove records from the stream: evicted in place, or (reprefill) the stream is cut at the
        first and every kept record after it fed again. Returns the tokens evicted and fed again."""
        s = self.stream
        idx = [j for r in gone for j in self.live(r)]
        for r in gone:
            r.deleted = True
        if not gone:
            return 0, 0
        if self.compaction == "stream":
            return (s.evict(idx) if idx else 0), 0
        cut = min(r.start for r in gone)
        refeed = [r for r in self.records if not r.deleted and r.start > cut]
        self.segments.append(s.trace().to_dict())
        old = [
            (r, s.tokens[r.start : r.end], s.role[r.start], s.turn[r.start], s.cursor[r.start])
            for r in refeed
        ]
        evicted = s.truncate(cut)
        for r, toks, role, turn, cursor in old:
            r.start = len(s.tokens)
            s.append(toks, role=role, turn=turn, cursor=cursor)
            r.end = len(s.tokens)
        refed = sum(len(t) for _, t, *_ in old)
        return evicted - refed, refed

    def _add(self, role: str, text: str, extra: dict, toks: list[int]) -> None:
        self.turn += 1
        start = len(self.stream.tokens)
        cursor = self._cursor(role, text)
        if cursor is not None:
            self.next_cursor = max(self.next_cursor, cursor + 1)
        self.stream.append(toks, role=role, turn=self.turn, cursor=NO_CURSOR if cursor is None else cursor)
        self.records.append(
            Record(role, text, start, len(self.stream.tokens), self.step, cursor, extra=extra or None)
        )

    def _answered(self) -> None:
        """An answer opens a new step, which the messages after it join."""
        self.actions += 1
        self.step = self.answer_step = self._new_step()
        self.action_of[self.step] = self.actions

    def finish(self, gen: Generation, text: str, reply: dict | None = None) -> None:
        """Close the answer as the template does and record it with ``text`` (what the client was
        sent): sent back unchanged, it matches these sampled tokens. An answer returned with tool calls
        (``reply``: its ``content`` and ``tool_calls``) matches the message the client sends back for
        it, while ``text`` stays what later messages are rendered after. The answer opens a new step."""
        close = self.conv.close(gen.tokens)
        if len(self.stream.tokens) + len(close) <= self.engine.position_limit:
            self.stream.append(close, role="assistant", turn=self.turn)
        self.conv.messages[-1] = {"role": "assistant", "content": text}
        self._answered()
        sent = None
        if reply is not None:
            sent = key(
                "assistant", reply["content"] or "", {"tool_calls": template_calls(reply["tool_calls"])}
            )
        self.records.append(
            Record("assistant", text, self.answer_start, len(self.stream.tokens), self.step, sent=sent)
        )
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
        need = self.engine.book.blocks(len(prompt) + max_tokens)
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
        segment (each stream cut, then the current one); then SideQuest's threads (``meta["aux"]``)."""
        return [*self.segments, self.stream.trace().to_dict(), *self.threads]

    def close(self) -> None:
        self.stream.cancel()
        self.stream.close()
        if self.root is not None:  # the group's last member closes its root
            self.root.members.discard(self.id)
            if not self.root.members:
                if self.groups.get(self.group) is self.root:
                    del self.groups[self.group]
                self.root.close()
