"""One agent episode through the engine, with compaction, in one of three modes.

* ``full``: no compaction; the context only grows.
* ``stream`` (KV-streams): compaction evicts the deleted steps' KV in place; one continuous
  stream and one trace per episode; nothing is computed twice.
* ``reprefill`` (what frameworks do today): the kept context is rendered into a fresh session
  and prefilled again; one trace per segment, sharing the episode's ``rollout_id``.

The loop: the agent acts (assistant header, generation, message close), the environment
answers, and at that boundary, before the answer is fed, the strategy may compact. Every token
is tokenised once (:mod:`compactrl.agent.chat`); re-prefill re-sends the same ids.

Re-prefill accounting is exact. Each token gets an origin id when it is first rendered;
``reprefilled_tokens`` counts tokens the engine fed whose origin it had already fed (plus any
recompute after preemption), and ``predicted_reprefilled_tokens`` adds up, over the realised
compactions, the kept tokens (the cost model's r = overlap + summary, per compaction).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from compactrl.agent.chat import ChatFormat, Conversation
from compactrl.compaction import Context, Decision, StepView, Strategy
from compactrl.compaction.sidequest import AuxThread, aux_answer, parse_deletions, title_span
from compactrl.engine import Engine, SamplingParams, SessionError
from compactrl.envs.base import Env, EnvError, guarded
from compactrl.trace import NO_CURSOR, Trace

MODES = ("full", "reprefill", "stream")
HEAD = -1  # owner of the protected system/task head
AUX = -2  # owner of a compaction request and its answer (deleted unless kept)
TITLE = -3  # owner of a tool output's first line that SideQuest's keep_titles leaves when it deletes
NON_COMPLETION = ("unparsable", "turn_limit", "position_limit", "error")  # why an episode did not finish


class RolloutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(64, ge=1, description="tokens per action unless the env asks for a number")
    max_turns: int = Field(64, ge=1, description="actions per episode before it is truncated")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: top tokens of this mass (1: off)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0: off)")
    ignore_eos: bool = Field(False, description="generate exactly max_tokens (fixed-length benchmarks)")
    system: str | None = Field(None, description="system prompt; overrides the env's (default: the env's)")
    chat_rewrites: Literal["error", "keep"] = Field(
        "error",
        description="a chat template that rewrites earlier turns (Qwen3's reasoning): refuse, or keep "
        "earlier turns as fed (see compactrl.agent.chat)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        {}, description="extra chat template variables, e.g. {enable_thinking = false} for Qwen3"
    )
    env_timeout_s: float = Field(60.0, gt=0, description="an env call that takes longer ends its episode")


class _AtPositionLimit(Exception):
    """The stream cannot grow: it holds the model's position limit (positions are never renumbered,
    so evicting does not free any). The episode ends there, truncated, its trace kept."""


@dataclass
class _Piece:
    """A run of tokens of one owner (a step, the head, a request) in the current session."""

    owner: int
    tokens: list[int]
    origins: range
    start: int  # index in the current session's stream
    turn: int  # the chat message it belongs to


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


@dataclass
class EpisodeResult:
    episode: int
    seed: int
    env: str
    mode: str
    strategy: str
    reward: float = 0.0
    turns: int = 0
    tokens: int = 0  # distinct tokens of the episode (what one stream would hold)
    generated_tokens: int = 0
    compactions: int = 0
    segments: int = 1
    prefilled_tokens: int = 0  # engine-fed prompt tokens, re-prefill included
    reprefilled_tokens: int = 0
    predicted_reprefilled_tokens: int = 0
    peak_live_kv: int = 0  # the main thread's
    peak_kv_with_threads: int = 0  # the main thread's and its auxiliary threads' own tokens at once
    kv_reads: int = 0  # the main thread's
    evicted_tokens: int = 0
    evictions: int = 0  # eviction calls (compactions in stream mode, a token evictor's)
    preemptions: int = 0
    pick_fallbacks: int = 0
    aux_calls: int = 0  # SideQuest: auxiliary threads run
    deleted_cursors: int = 0  # cursors their answers deleted
    aux_offered_cursors: int = 0  # per landed answer, the cursors it could delete (rate: deleted / offered)
    aux_parse_failures: int = 0  # answers with no readable {"del_cursors": [...]}
    aux_no_room: int = 0  # threads that could not run or finish: no room (positions or KV pool) to fork
    aux_unknown_cursors: int = 0  # named cursors that were not open (never made, or deleted)
    aux_unseen_cursors: int = 0  # named cursors open now that the thread did not see open at its fork
    aux_unfinished: int = 0  # threads whose answer had not landed when the episode ended: no deletions
    aux_tokens: int = 0  # tokens the auxiliary threads generated (never in the main stream)
    aux_kv_reads: int = 0  # the auxiliary threads' KV reads (the shared prefix included)
    aux_kept_unread: int = 0  # keep_unread: named outputs no action had read yet, not deleted
    truncated: bool = False
    at_position_limit: bool = False  # truncated because the stream reached the model's positions
    error: str | None = None
    wall_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    step_rewards: list[tuple[int, int, float]] = field(default_factory=list)  # (trace, token, reward)
    traces: list[Trace] = field(default_factory=list, repr=False)
    aux_traces: list[Trace] = field(default_factory=list, repr=False)  # one per auxiliary thread

    def metrics(self) -> dict[str, Any]:
        """Everything but the traces (one JSON line per episode)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("traces", "aux_traces")}
        return out | {"non_completion": self.non_completion}

    @property
    def non_completion(self) -> str | None:
        """Why the episode did not complete (None: it did): ``error``, ``position_limit``,
        ``turn_limit``, or ``unparsable`` (it ended on an answer the env could not read)."""
        if self.error:
            return "error"
        if self.at_position_limit:
            return "position_limit"
        if self.truncated:
            return "turn_limit"
        return "unparsable" if "said" in self.info and self.info["said"] is None else None

    def token_rewards(self) -> list[np.ndarray]:
        """Per trace, each step's reward on the last token of the action it rewards."""
        out = [np.zeros(len(t), np.float32) for t in self.traces]
        for k, i, reward in self.step_rewards:
            out[k][i] += reward
        return out


class Episode:
    def __init__(
        self,
        engine: Engine,
        fmt: ChatFormat,
        env: Env,
        strategy: Strategy | None,
        mode: str,
        settings: RolloutSettings,
        seed: int,
        episode: int = 0,
        sample_seed: int | None = None,
        demo: bool = False,
        evictor=None,
        pool: Executor | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} unknown; choose one of {MODES}")
        self.engine, self.fmt, self.env, self.settings = engine, fmt, env, settings
        self.pool = pool  # the worker threads env calls run in (None: asyncio's default executor)
        self.chat: Conversation = fmt.conversation()
        self.strategy = None if mode == "full" else strategy
        self.evictor = evictor if mode == "stream" else None  # a token evictor runs in place only
        self.mode, self.seed = mode, seed
        self.sample_seed = seed if sample_seed is None else sample_seed  # a group: one env seed, many
        name = strategy.name if strategy and mode != "full" else "none"
        self.result = EpisodeResult(episode, seed, env.name, mode, name)
        self.rollout_id = f"{env.name}-{seed}-{self.sample_seed}-{mode}-{name}"
        self.pieces: list[_Piece] = []
        self.kinds: dict[int, str] = {}  # live step id -> "step" | "summary"
        self.sessions = []
        self.session = None
        self.origin_log: list[list[int]] = []  # origin id of each token, per session
        self.origin = 0  # next origin id
        self.next_id = 0
        self.messages = 0  # seeds each generation: same seeds in every mode
        self.demo = demo  # the env writes every answer (demo_action, demo_summary): an SFT demonstration
        self.cursor_of: dict[int, int] = {}  # step id -> the cursor id of its tool output
        self.cursors: dict[int, dict] = {}  # cursor id -> tool, last_used, referenced
        self.sidequest = self.strategy is not None and isinstance(self.strategy.plan, AuxThread)
        self.aux: _Thread | None = None  # the auxiliary thread in flight (SideQuest)
        self.pending: int | None = None  # the step whose action is in and whose output is not yet
        self.action_log: list[tuple[int, list]] = []  # (session, [end, cursor, refs, tool]) per action

    # ---- stream building ------------------------------------------------------------------------
    def _new_session(self) -> None:
        if self.session is not None:  # a re-prefill segment ends: its KV is dropped now
            self.session.close()
            self.sessions.append(self.session)
        self.session = self.engine.session(self.rollout_id)
        if self.evictor is not None:
            self.session.use_evictor(self.evictor)
        self.origin_log.append([])

    def _record(self, owner: int, tokens: list[int], start: int, turn: int, origins: range | None = None):
        """Note tokens that now sit at ``start`` in the current session (new ones get fresh origins)."""
        if origins is None:
            origins = range(self.origin, self.origin + len(tokens))
            self.origin += len(tokens)
        self.pieces.append(_Piece(owner, list(tokens), origins, start, turn))
        self.origin_log[-1].extend(origins)

    def _add(self, owner: int, tokens: list[int], role: str, turn: int, origins: range | None = None) -> None:
        """Append tokens to the current session, labelled with their chat message ``turn``."""
        start = len(self.session.tokens)
        if start + len(tokens) > self.engine.position_limit:
            raise _AtPositionLimit
        self.session.append(tokens, role=role, turn=turn, cursor=self.cursor_of.get(owner, NO_CURSOR))
        self._record(owner, tokens, start, turn, origins)

    def _message(self, owner: int, role: str, text: str) -> None:
        """Append a whole message, rendered by the model's chat template."""
        turn = len(self.chat.messages)
        self._add(owner, self.chat.message(role, text), role, turn)

    def _output(self, sid: int, text: str) -> None:
        """Append a tool output; under SideQuest's keep_titles its first line is a piece of no step
        (no cursor label either), so deleting the cursor leaves it."""
        if sid not in self.kinds:  # a deletion may never remove a call before its output lands
            raise RuntimeError(f"step {sid} was deleted before its tool output landed")
        self.pending = None
        c = self.cursor_of.get(sid)
        if not (self.sidequest and self.strategy.plan.keep_titles and c is not None):
            return self._message(sid, "user", text)
        turn = len(self.chat.messages)
        ids = self.chat.message("user", text)
        a, b = title_span(self.fmt.tokenizer, ids, c)
        for owner, part in ((sid, ids[:a]), (TITLE, ids[a:b]), (sid, ids[b:])):
            if part:
                self._add(owner, part, "user", turn)

    async def _generate(
        self, owner: int, role: str, max_tokens: int, ctx: Context | None = None
    ) -> list[int]:
        """Generation prompt, generation, close; returns the generated ids. ``ctx``: the compaction
        whose question this answers."""
        s, turn = self.settings, len(self.chat.messages)
        self._add(owner, self.chat.prompt(), role, turn)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            stop_token_ids=[] if s.ignore_eos else list(self.fmt.stop_ids), ignore_eos=s.ignore_eos,
            seed=self.sample_seed * 100_003 + self.messages,
        )  # fmt: skip
        self.messages += 1
        start = len(self.session.tokens)
        if self.demo:  # teacher-forced: the engine scores the demonstration as if it had sampled it
            params = params.model_copy(update={"forced": self._demonstrated(role, max_tokens, ctx)})
        gen = await self.session.agenerate(params, role=role, turn=turn)
        toks = list(gen.tokens)
        self._record(owner, toks, start, turn)
        if gen.finish_reason == "position_limit":
            raise _AtPositionLimit
        self.last_generated = start + len(toks) - 1
        self._add(owner, self.chat.close(toks), role, turn)
        self.result.generated_tokens += len(toks)
        return toks

    def _demonstrated(self, role: str, max_tokens: int, ctx: Context | None) -> list[int]:
        """The env's answer, as the policy would write it (ending with the stop token)."""
        if role == "summary":
            if not hasattr(self.env, "demo_summary"):
                raise ValueError(
                    f"demonstrations under summary compaction need {self.env.name}.demo_summary()"
                )
            text = self.env.demo_summary(ctx.steps)
        elif ctx is not None:
            raise ValueError(f"no demonstration for the {self.strategy.name} strategy's question")
        else:
            text = self.env.demo_action()
        toks = self.fmt.tokenizer.encode(text) + [self.fmt.stop_ids[0]]
        if len(toks) > max_tokens:
            raise ValueError(
                f"the demonstration {text!r} is {len(toks)} tokens, over the {max_tokens} allowed"
            )
        return toks

    def _live(self, p: _Piece) -> list[int]:
        """Stream indices of a piece not evicted yet (a token evictor may have taken some)."""
        ev = self.session.evict_at
        return [j for j in range(p.start, p.start + len(p.tokens)) if ev[j] is None]

    def _step_view(self, sid: int) -> StepView:
        ps = [p for p in self.pieces if p.owner == sid]
        text = self.fmt.tokenizer.decode([t for p in ps for t in p.tokens], skip_special_tokens=True)
        c = self.cursor_of.get(sid)
        cur = {} if c is None else {"cursor": c, **self.cursors[c]}
        return StepView(sid, sum(len(self._live(p)) for p in ps), text, self.kinds[sid], **cur)

    def _note_cursor(self, sid: int, info: dict, action: int) -> None:
        """A tool env's output is a cursor (``info["cursor"]``): label the step's tokens, the call
        already in the stream and the output to come, with it; note the cursors the call referred to."""
        for c in info.get("refs", ()):
            if c in self.cursors:
                self.cursors[c].update(last_used=action, referenced=True)
        c = info.get("cursor")
        if c is None:
            return
        if not isinstance(c, int) or isinstance(c, bool) or c < 0 or c in self.cursors:
            raise EnvError(f"{self.env.name}.step returned cursor {c!r}; a tool output needs a new "
                           "cursor id, an int >= 0")  # fmt: skip
        self.cursor_of[sid] = c
        self.cursors[c] = {"tool": info.get("tool"), "last_used": action, "referenced": False}
        for p in self.pieces:
            if p.owner == sid:
                self.session.mark_cursor(self._live(p), c)

    def _context(self, step: int, since: int, action: str, incoming: int) -> Context:
        head = sum(len(p.tokens) for p in self.pieces if p.owner == HEAD)
        views = [self._step_view(sid) for sid in self.kinds]
        return Context(views, head, incoming, step, since, action)

    # ---- compaction -----------------------------------------------------------------------------
    async def _compact(self, ctx: Context) -> None:
        plan = self.strategy.plan
        req = plan.request(ctx)
        answer_ids: list[int] = []
        if req is not None:
            self._message(AUX, "user", req.prompt)
            answer_ids = await self._generate(AUX, req.role, req.max_tokens, ctx)
        answer = self.fmt.text(answer_ids) if req is not None else None
        decision: Decision = plan.decide(ctx, answer)
        self.result.pick_fallbacks += int(decision.fallback)
        gone = set(decision.delete) & set(self.kinds) - {self.pending}  # a call stays until its output is in
        if decision.keep_answer:  # the answer (a summary) becomes a step of its own, with the resume
            sid = self._new_step("summary")
            for p in [p for p in self.pieces if p.owner == AUX][-3:]:  # header, generated, close
                p.owner = sid
            if decision.resume:
                self._message(sid, "user", decision.resume)
        await self._delete(gone | {AUX})

    async def _delete(self, gone: set[int], outputs_only: bool = False) -> None:
        """Delete steps (and a request's pieces): evict them in place, or re-prefill the rest.
        ``outputs_only``: their tool outputs go, their calls stay as steps without a cursor."""
        for sid in gone:
            (self.cursor_of if outputs_only else self.kinds).pop(sid, None)

        def drop(p: _Piece) -> bool:
            return p.owner in gone and (not outputs_only or self.session.role[p.start] == "user")

        dropped = [p for p in self.pieces if drop(p)]
        self.pieces = [p for p in self.pieces if not drop(p)]
        self.result.compactions += 1
        if self.mode == "stream":
            live = [j for p in dropped for j in self._live(p)]
            if live:
                self.session.evict(live)
        else:
            while self.session.unfed:  # the engine feeds the last tokens eagerly; let it finish, so
                await asyncio.sleep(0)  # every kept token was computed once (the cost model's r)
            self.result.predicted_reprefilled_tokens += sum(len(p.tokens) for p in self.pieces)
            self._new_session()
            old, self.pieces = self.pieces, []
            for p in old:
                self._add(p.owner, p.tokens, self._role(p), p.turn, p.origins)
            self.result.segments += 1

    # ---- SideQuest's auxiliary thread ---------------------------------------------------------------
    def _live_cursors(self) -> dict[int, int]:
        return {c: sid for sid, c in self.cursor_of.items() if sid in self.kinds}

    def _aux_start(self, action: int) -> None:
        """Fork the main thread (its KV shared, at this step boundary) and start the auxiliary
        thread on the fork; the main thread goes on (parallel) or waits for it (sequential). The
        thread may delete only what it sees open: the cursors whose output is in at the fork."""
        plan, r = self.strategy.plan, self.result
        chat = self.chat.fork()
        turn = len(chat.messages)
        child = self.session.fork(f"{self.rollout_id}-aux{action}")
        fork_at = len(child.tokens)
        child.adapter_from = fork_at  # a thread adapter (gated LoRA) acts on the thread's tokens only
        params = SamplingParams(
            max_tokens=plan.max_tokens, temperature=self.settings.temperature, top_p=self.settings.top_p,
            top_k=self.settings.top_k, stop_token_ids=list(self.fmt.stop_ids),
            seed=self.sample_seed * 100_003 + self.messages,
        )  # fmt: skip
        self.messages += 1
        r.aux_calls += 1
        seen = {c: sid for c, sid in self._live_cursors().items() if sid != self.pending}
        unread = {c for c, k in self.cursors.items() if k["last_used"] == action and not k["referenced"]}
        if self.demo:  # the env's memory oracle writes the answer, teacher-forced
            info = [
                (c, self.cursors[c]["tool"], self.cursors[c]["last_used"])
                for c in self.env.demo_deletions(sorted(seen))
            ]
            toks = self.fmt.tokenizer.encode(aux_answer(info)) + [self.fmt.stop_ids[0]]
            params = params.model_copy(update={"forced": toks, "max_tokens": max(len(toks), plan.max_tokens)})
        prompt = chat.message("user", plan.trigger), chat.prompt()
        task = asyncio.ensure_future(self._aux_run(child, prompt, params, turn, fork_at, action))
        self.aux = _Thread(task, child, seen, unread, self.origin)

    async def _aux_run(
        self, child, prompt, params: SamplingParams, turn: int, fork_at: int, action: int
    ) -> tuple[str | None, Trace]:
        """The thread's answer text (None: no room to run it) and its trace; only its own tokens
        are trainable (the prefix is the main thread's, trained there)."""
        r = self.result
        try:
            child.append(prompt[0], role="user", turn=turn)
            child.append(prompt[1], role="assistant", turn=turn + 1)
            gen = await child.agenerate(params, role="assistant", turn=turn + 1)
            r.aux_tokens += len(gen.tokens)
            answer = None if gen.finish_reason == "position_limit" else self.fmt.text(gen.tokens)
        except SessionError:  # no room (positions or pool) for the thread: it deletes nothing
            answer = None
        r.aux_kv_reads += child.metrics.kv_reads
        t = child.trace()
        child.close()
        t.trainable[:fork_at], t.logprobs[:fork_at] = False, np.nan
        t.meta = {"aux": True, "action": action, "fork_at": fork_at, "segment": len(self.sessions),
                  "named": parse_deletions(answer or ""), "keep_calls": self.strategy.plan.keep_calls,
                  "no_room": answer is None}  # fmt: skip
        r.aux_traces.append(t)
        return answer, t

    async def _aux_call(self, ctx: Context) -> None:
        """Start the auxiliary thread when it is due and none is in flight; sequential: wait for it."""
        if self.aux is None and self.strategy.trigger(ctx):
            self._aux_start(ctx.step)
            if not self.strategy.plan.parallel:
                await self._aux_collect(wait=True)

    async def _aux_collect(self, wait: bool = False) -> None:
        """At a main-thread step boundary: apply the auxiliary thread's deletions if its answer is
        due. In parallel it is due once the main thread has added to its stream, since the fork,
        enough tokens for the thread to have written its answer at ``pace`` thread tokens per main
        token (the tokens it generated and the outputs it was fed: a tool output's time is the
        thread's too), so where a deletion lands depends on tokens only, never on wall-clock time."""
        th = self.aux
        if th is None:
            return
        if not wait:
            since = (self.origin - th.main_tokens) * self.strategy.plan.pace
            if th.written() > since:  # not due, whatever it writes next
                return
            await asyncio.wait([th.task])  # the rule needs its final length
            if th.written() > since:
                return
        answer, _ = await th.task
        self.aux = None
        r, plan, now = self.result, self.strategy.plan, self._live_cursors()
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
            await self._delete({now[c] for c in delete}, outputs_only=plan.keep_calls)

    async def _aux_end(self) -> None:
        """The episode ended with a thread in flight: it is run to its end (its trace is kept), but
        its answer had not landed, so it deleted nothing; its trace is flagged ``unfinished`` (left out
        of the loss and of the deletion scores)."""
        th, self.aux = self.aux, None
        await asyncio.wait([th.task])
        if (e := th.task.exception()) is not None:
            self.result.error = self.result.error or f"{type(e).__name__}: {e}"
            return
        th.task.result()[1].meta["unfinished"] = True
        self.result.aux_unfinished += 1

    def _role(self, p: _Piece) -> str:
        return self.sessions[-1].role[p.start] if p.tokens else "user"

    def _new_step(self, kind: str) -> int:
        sid = self.next_id
        self.next_id += 1
        self.kinds[sid] = kind
        return sid

    # ---- the episode ----------------------------------------------------------------------------
    async def run(self) -> EpisodeResult:
        t0 = time.perf_counter()
        r, s, fmt = self.result, self.settings, self.fmt
        try:
            self._new_session()
            begin = "demo_reset" if self.demo and hasattr(self.env, "demo_reset") else "reset"
            reset = await guarded(self.env, begin, self.seed, s.env_timeout_s, self.pool)
            system = s.system if s.system is not None else reset.system
            if system:  # "" = no system message (TOML has no null)
                self._message(HEAD, "system", system)
            self._message(HEAD, "user", reset.task)
            if self.session.evictor is not None:
                self.session.evictor.head = len(self.session.tokens)  # the system/task head stays
            if reset.observation:
                obs = reset.observation
                if reset.observation_variants:
                    obs = self.chat.padded("user", obs, reset.observation_variants)
                self._message(self._new_step("step"), "user", obs)
            hint, since = reset.max_tokens, 0
            while True:
                sid = self.pending = self._new_step("step")
                action_ids = await self._generate(sid, "assistant", hint or s.max_tokens)
                last_token = self.last_generated  # the action's end
                r.turns += 1
                since += 1
                action = fmt.text(action_ids)
                out = await guarded(self.env, "step", action, s.env_timeout_s, self.pool)
                r.reward += out.reward
                r.step_rewards.append((len(self.sessions), last_token, float(out.reward)))
                r.info = out.info
                facts = [
                    last_token,
                    out.info.get("cursor"),
                    list(out.info.get("refs", ())),
                    out.info.get("tool"),
                ]
                self.action_log.append((len(self.sessions), facts))
                if out.done:
                    break
                if r.turns >= s.max_turns:
                    r.truncated = True
                    break
                self._note_cursor(sid, out.info, r.turns)
                incoming = len(self.chat.message("user", out.observation, record=False))
                ctx = self._context(r.turns, since, action, incoming)
                if self.sidequest:
                    await self._aux_collect()
                    if self.strategy.plan.at == "call":  # the call is in, its output not yet
                        await self._aux_call(ctx)
                elif self.strategy is not None and self.strategy.trigger(ctx):
                    await self._compact(ctx)
                    since = 0
                self._output(sid, out.observation)
                if self.sidequest and self.strategy.plan.at == "output":
                    await self._aux_call(ctx)
                hint = out.max_tokens
        except _AtPositionLimit:
            r.truncated = r.at_position_limit = True
        except Exception as e:  # noqa: BLE001 - env, session or any other failure ends only this episode
            r.error = f"{type(e).__name__}: {e}"
        finally:
            if self.aux is not None:
                await self._aux_end()
            if self.session is not None:
                self.sessions.append(self.session)
                self.session = None
            for sess in self.sessions:
                if not sess.generating:
                    sess.close()
        self._account()
        r.wall_s = time.perf_counter() - t0
        return r

    def _account(self) -> None:
        """Metrics from what the engine did, and the traces."""
        r = self.result
        r.tokens = self.origin
        seen: set[int] = set()
        for i, sess in enumerate(self.sessions):
            m = sess.metrics
            fed = self.origin_log[i][: sess.fed]
            r.reprefilled_tokens += sum(o in seen for o in fed) + m.reprefilled_tokens
            seen.update(fed)
            r.prefilled_tokens += m.prefill_tokens
            r.peak_live_kv = max(r.peak_live_kv, m.peak_live_kv)
            r.peak_kv_with_threads = max(r.peak_kv_with_threads, sess.footprint.peak)
            r.kv_reads += m.kv_reads
            r.evicted_tokens += m.evicted_tokens
            r.evictions += m.evictions
            r.preemptions += m.preemptions
            t = sess.trace()
            if self.mode == "reprefill":
                t.segment[:] = i
            t.meta = {"env": r.env, "seed": r.seed, "mode": r.mode, "strategy": r.strategy,
                      "episode": r.episode, "segment": i, "reward": r.reward,
                      "actions": r.turns, "position_limit": self.engine.position_limit,
                      # per action of this trace: its last token, the cursor it made, the cursors
                      # it referred to, its tool (what SideQuest's hindsight labeller reads)
                      "action_facts": [a for k, a in self.action_log if k == i]}  # fmt: skip
            r.traces.append(t)
