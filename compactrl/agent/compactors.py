"""What an episode calls at its step boundaries to compact: one interface for every strategy.

An episode (:class:`compactrl.agent.rollout.Episode`) builds the stream and applies deletions; a
compactor decides when and what, and may run asynchronously. It is called after each action,
before the tool's output is fed (``before_output``) and after it is fed (``after_output``), and
once when the episode ends (``end``). The step-wise strategies (window, Markovian, summaries,
picks, evict-steps, cursor rules) are :class:`StepCompactor`: a trigger and a plan that may ask the
model first. SideQuest (:class:`SideQuestThreads`) forks an auxiliary thread that answers which
cursors to delete, in parallel with the main thread or before it goes on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from compactrl.agent.chat import ChatFormat, Conversation
from compactrl.compaction import Context, Decision, Strategy
from compactrl.compaction.sidequest import AuxThread, aux_answer, parse_deletions, title_span
from compactrl.engine import SamplingParams, SessionError
from compactrl.trace import Trace

AUX = -2  # owner of a compaction request and its answer (deleted unless kept)
TITLE = -3  # owner of a tool output's first line that SideQuest's keep_titles leaves when it deletes


class Episode(Protocol):
    """What a compactor may read and do of the episode it serves (``agent.rollout.Episode``)."""

    fmt: ChatFormat
    chat: Conversation
    settings: Any  # RolloutSettings
    result: Any  # EpisodeResult: the compactor's counters
    env: Any
    demo: bool
    rollout_id: str
    session: Any  # the current engine session (what a fork is taken from)
    sessions: list  # the finished segments
    origin: int  # tokens the main thread has added so far (its clock)
    kinds: dict[int, str]  # live step id -> "step" | "summary"
    pending: int | None  # the step whose call is in and whose output is not
    cursor_of: dict[int, int]  # step id -> the cursor of its tool output
    cursors: dict[int, dict]  # cursor id -> tool, last_used, referenced

    def message(self, owner: int, role: str, text: str) -> None: ...

    async def generate(
        self, owner: int, role: str, max_tokens: int, ctx: Context | None = None
    ) -> list[int]: ...

    def new_step(self, kind: str) -> int: ...

    def adopt(self, owner: int, sid: int, last: int) -> None: ...

    async def delete(self, gone: set[int], outputs_only: bool = False) -> None: ...

    def live_cursors(self) -> dict[int, int]: ...

    def next_seed(self) -> int: ...


class StepCompactor:
    """A trigger and a plan: at the boundary before the output, when the trigger fires, the plan
    may ask the model (a request in the stream, its answer generated), then decides what goes."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    async def before_output(self, ep: Episode, ctx: Context) -> bool:
        """Compact if the trigger fires; True when it did (the steps-since counter restarts)."""
        if not self.strategy.trigger(ctx):
            return False
        plan = self.strategy.plan
        req = plan.request(ctx)
        answer_ids: list[int] = []
        if req is not None:
            ep.message(AUX, "user", req.prompt)
            answer_ids = await ep.generate(AUX, req.role, req.max_tokens, ctx)
        answer = ep.fmt.text(answer_ids) if req is not None else None
        decision: Decision = plan.decide(ctx, answer)
        ep.result.pick_fallbacks += int(decision.fallback)
        gone = set(decision.delete) & set(ep.kinds) - {ep.pending}  # a call stays until its output is in
        if decision.keep_answer:  # the answer (a summary) becomes a step of its own, with the resume
            sid = ep.new_step("summary")
            ep.adopt(AUX, sid, last=3)  # header, generated, close
            if decision.resume:
                ep.message(sid, "user", decision.resume)
        await ep.delete(gone | {AUX})
        return True

    async def after_output(self, ep: Episode, ctx: Context) -> None:
        pass

    async def end(self, ep: Episode) -> None:
        pass

    def output_parts(self, ep: Episode, sid: int, ids: list[int]) -> list[tuple[int, list[int]]]:
        """A tool output's tokens and the step that owns each part."""
        return [(sid, ids)]


@dataclass
class _Thread:
    """SideQuest's auxiliary thread in flight."""

    task: asyncio.Task  # -> (answer text, None if it had no room; its trace)
    session: Any  # the fork
    seen: dict[int, int]  # cursor -> step: open at the fork with its output in (what it may delete)
    unread: set[int]  # its call's cursors no action had read yet (what keep_unread protects)
    main_tokens: int  # tokens the main thread had added to its stream at the fork (its clock)

    def written(self) -> int:
        """Tokens the thread has generated so far."""
        g = self.session.generation
        return len(g.tokens) if g is not None else 0


class SideQuestThreads(StepCompactor):
    """SideQuest: after every ``every``-th action (after its call, or after its output) the main
    thread is forked and the fork asked which open cursors to delete; sequential: the main thread
    waits for the answer; parallel: the answer lands at a later step boundary (see :meth:`collect`)."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy)
        self.plan: AuxThread = strategy.plan
        self.aux: _Thread | None = None  # the thread in flight

    async def before_output(self, ep: Episode, ctx: Context) -> bool:
        await self.collect(ep)
        if self.plan.at == "call":  # the call is in, its output not yet
            await self.call(ep, ctx)
        return False

    async def after_output(self, ep: Episode, ctx: Context) -> None:
        if self.plan.at == "output":
            await self.call(ep, ctx)

    def output_parts(self, ep: Episode, sid: int, ids: list[int]) -> list[tuple[int, list[int]]]:
        """Under keep_titles a cursor's first line is a piece of no step (no cursor label either),
        so deleting the cursor leaves it."""
        c = ep.cursor_of.get(sid)
        if not self.plan.keep_titles or c is None:
            return [(sid, ids)]
        a, b = title_span(ep.fmt.tokenizer, ids, c)
        return [(owner, part) for owner, part in ((sid, ids[:a]), (TITLE, ids[a:b]), (sid, ids[b:])) if part]

    async def call(self, ep: Episode, ctx: Context) -> None:
        """Start the thread when it is due and none is in flight; sequential: wait for it."""
        if self.aux is None and self.strategy.trigger(ctx):
            self.start(ep, ctx.step)
            if not self.plan.parallel:
                await self.collect(ep, wait=True)

    def start(self, ep: Episode, action: int) -> None:
        """Fork the main thread (its KV shared, at this step boundary) and start the thread on the
        fork. It may delete only what it sees open: the cursors whose output is in at the fork."""
        plan, r, s = self.plan, ep.result, ep.settings
        chat = ep.chat.fork()
        turn = len(chat.messages)
        child = ep.session.fork(f"{ep.rollout_id}-aux{action}")
        fork_at = len(child.tokens)
        child.adapter_from = fork_at  # a thread adapter (gated LoRA) acts on the thread's tokens only
        params = SamplingParams(
            max_tokens=plan.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            stop_token_ids=list(ep.fmt.stop_ids), seed=ep.next_seed(),
        )  # fmt: skip
        r.aux_calls += 1
        seen = {c: sid for c, sid in ep.live_cursors().items() if sid != ep.pending}
        unread = {c for c, k in ep.cursors.items() if k["last_used"] == action and not k["referenced"]}
        if ep.demo:  # the env's memory oracle writes the answer, teacher-forced
            info = [
                (c, ep.cursors[c]["tool"], ep.cursors[c]["last_used"])
                for c in ep.env.demo_deletions(sorted(seen))
            ]
            toks = ep.fmt.tokenizer.encode(aux_answer(info)) + [ep.fmt.stop_ids[0]]
            params = params.model_copy(update={"forced": toks, "max_tokens": max(len(toks), plan.max_tokens)})
        prompt = chat.message("user", plan.trigger), chat.prompt()
        task = asyncio.ensure_future(self.run(ep, child, prompt, params, turn, fork_at, action))
        self.aux = _Thread(task, child, seen, unread, ep.origin)

    async def run(
        self, ep: Episode, child, prompt, params: SamplingParams, turn: int, fork_at: int, action: int
    ) -> tuple[str | None, Trace]:
        """The thread's answer text (None: no room to run it) and its trace; only its own tokens
        are trainable (the prefix is the main thread's, trained there)."""
        r = ep.result
        try:
            child.append(prompt[0], role="user", turn=turn)
            child.append(prompt[1], role="assistant", turn=turn + 1)
            gen = await child.agenerate(params, role="assistant", turn=turn + 1)
            r.aux_tokens += len(gen.tokens)
            answer = None if gen.finish_reason == "position_limit" else ep.fmt.text(gen.tokens)
        except SessionError:  # no room (positions or pool) for the thread: it deletes nothing
            answer = None
        r.aux_kv_reads += child.metrics.kv_reads
        t = child.trace()
        child.close()
        t.trainable[:fork_at], t.logprobs[:fork_at] = False, np.nan
        t.meta = {"aux": True, "action": action, "fork_at": fork_at, "segment": len(ep.sessions),
                  "named": parse_deletions(answer or ""), "keep_calls": self.plan.keep_calls,
                  "no_room": answer is None}  # fmt: skip
        r.aux_traces.append(t)
        return answer, t

    async def collect(self, ep: Episode, wait: bool = False) -> None:
        """At a main-thread step boundary: apply the thread's deletions if its answer is due. In
        parallel it is due once the main thread has added to its stream, since the fork, enough
        tokens for the thread to have written its answer at ``pace`` thread tokens per main token
        (the tokens it generated and the outputs it was fed: a tool output's time is the thread's
        too), so where a deletion lands depends on tokens only, never on wall-clock time."""
        th = self.aux
        if th is None:
            return
        if not wait:
            since = (ep.origin - th.main_tokens) * self.plan.pace
            if th.written() > since:  # not due, whatever it writes next
                return
            await asyncio.wait([th.task])  # the rule needs its final length
            if th.written() > since:
                return
        answer, _ = await th.task
        self.aux = None
        r, plan, now = ep.result, self.plan, ep.live_cursors()
        if answer is None:
            r.aux_no_room += 1
            return
        r.aux_offered_cursors += len(set(th.seen) - (th.unread if plan.keep_unread else set()))
        delete, unknown = plan.split(answer, set(th.seen) & set(now))
        unseen = [c for c in unknown if c in now]  # open now, but not when the thread looked
        r.aux_parse_failures += delete is None
        r.aux_unseen_cursors += len(unseen)
        r.aux_unknown_cursors += len(unknown) - len(unseen)
        if delete and plan.keep_unread:
            r.aux_kept_unread += len(set(delete) & th.unread)
            delete = [c for c in delete if c not in th.unread]
        if delete:
            r.deleted_cursors += len(delete)
            await ep.delete({now[c] for c in delete}, outputs_only=plan.keep_calls)

    async def end(self, ep: Episode) -> None:
        """The episode ended with a thread in flight: it is run to its end (its trace is kept), but
        its answer had not landed, so it deleted nothing; its trace is flagged ``unfinished`` (left
        out of the loss and of the deletion scores)."""
        th, self.aux = self.aux, None
        if th is None:
            return
        await asyncio.wait([th.task])
        if (e := th.task.exception()) is not None:
            ep.result.error = ep.result.error or f"{type(e).__name__}: {e}"
            return
        th.task.result()[1].meta["unfinished"] = True
        ep.result.aux_unfinished += 1


def compactor_for(strategy: Strategy) -> StepCompactor:
    """A fresh compactor for one episode (a SideQuest one holds the thread in flight)."""
    return SideQuestThreads(strategy) if isinstance(strategy.plan, AuxThread) else StepCompactor(strategy)
