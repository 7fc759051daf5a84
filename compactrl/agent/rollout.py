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
from compactrl.agent.compactors import compactor_for
from compactrl.compaction import Context, StepView, Strategy
from compactrl.engine import Engine, SamplingParams
from compactrl.envs.base import Env, EnvError, guarded
from compactrl.trace import NO_CURSOR, Trace

MODES = ("full", "reprefill", "stream")
HEAD = -1  # owner of the protected system/task head
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
        self.compactor = compactor_for(self.strategy) if self.strategy is not None else None
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

    def message(self, owner: int, role: str, text: str) -> None:
        """Append a whole message, rendered by the model's chat template."""
        turn = len(self.chat.messages)
        self._add(owner, self.chat.message(role, text), role, turn)

    def _output(self, sid: int, text: str) -> None:
        """Append a tool output, its parts owned as the compactor says (SideQuest's keep_titles
        leaves a cursor's first line to no step)."""
        if sid not in self.kinds:  # a deletion may never remove a call before its output lands
            raise RuntimeError(f"step {sid} was deleted before its tool output landed")
        self.pending = None
        if self.compactor is None:
            return self.message(sid, "user", text)
        turn = len(self.chat.messages)
        for owner, part in self.compactor.output_parts(self, sid, self.chat.message("user", text)):
            self._add(owner, part, "user", turn)

    async def generate(self, owner: int, role: str, max_tokens: int, ctx: Context | None = None) -> list[int]:
        """Generation prompt, generation, close; returns the generated ids. ``ctx``: the compaction
        whose question this answers."""
        s, turn = self.settings, len(self.chat.messages)
        self._add(owner, self.chat.prompt(), role, turn)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            stop_token_ids=[] if s.ignore_eos else list(self.fmt.stop_ids), ignore_eos=s.ignore_eos,
            seed=self.next_seed(),
        )  # fmt: skip
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

    async def delete(self, gone: set[int], outputs_only: bool = False) -> None:
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

    def adopt(self, owner: int, sid: int, last: int) -> None:
        """The last ``last`` pieces of ``owner`` (a request's answer) become step ``sid``'s."""
        for p in [p for p in self.pieces if p.owner == owner][-last:]:
            p.owner = sid

    def live_cursors(self) -> dict[int, int]:
        """Open cursors: cursor id -> the live step whose output it is."""
        return {c: sid for sid, c in self.cursor_of.items() if sid in self.kinds}

    def next_seed(self) -> int:
        """The sampling seed of the episode's next generation (the same in every mode)."""
        self.messages += 1
        return self.sample_seed * 100_003 + self.messages - 1

    def _role(self, p: _Piece) -> str:
        return self.sessions[-1].role[p.start] if p.tokens else "user"

    def new_step(self, kind: str) -> int:
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
                self.message(HEAD, "system", system)
            self.message(HEAD, "user", reset.task)
            if self.session.evictor is not None:
                self.session.evictor.head = len(self.session.tokens)  # the system/task head stays
            if reset.observation:
                obs = reset.observation
                if reset.observation_variants:
                    obs = self.chat.padded("user", obs, reset.observation_variants)
                self.message(self.new_step("step"), "user", obs)
            hint, since = reset.max_tokens, 0
            while True:
                sid = self.pending = self.new_step("step")
                action_ids = await self.generate(sid, "assistant", hint or s.max_tokens)
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
                if self.compactor is not None and await self.compactor.before_output(self, ctx):
                    since = 0
                self._output(sid, out.observation)
                if self.compactor is not None:
                    await self.compactor.after_output(self, ctx)
                hint = out.max_tokens
        except _AtPositionLimit:
            r.truncated = r.at_position_limit = True
        except Exception as e:  # noqa: BLE001 - env, session or any other failure ends only this episode
            r.error = f"{type(e).__name__}: {e}"
        finally:
            if self.compactor is not None:
                await self.compactor.end(self)
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
