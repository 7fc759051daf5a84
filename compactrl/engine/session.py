"""A session: one rollout's token stream that lives across turns, and where its KV lives.

The stream record (tokens, ``evict_at``, trainable, log-probs, turn, role, segment, cursor) is
what :meth:`Session.trace` exports; the engine keeps the session's KV in sync with it. Calls
validate everything before changing anything, so a bad call leaves every session as it was.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from compactrl.engine.evicting import EvictorState
from compactrl.engine.kv_cache import Segment
from compactrl.engine.sampling import SamplingParams, make_generator
from compactrl.trace import NO_CURSOR, ROLES, Trace

_ids = itertools.count()
RECORD_FIELDS = (
    "tokens", "evict_at", "trainable", "logprobs", "model_logprobs", "turn", "role", "segment", "cursor",
)  # fmt: skip


class SessionError(ValueError):
    """A call a session cannot take (bad tokens, spans, state); nothing was changed."""


@dataclass(eq=False)
class Generation:
    """One ``generate`` request; ``tokens`` grows as the engine decodes."""

    session: Session
    params: SamplingParams
    generator: random.Random | None
    stop_ids: frozenset[int]
    start: int  # stream index of the first generated token
    turn: int
    role: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, if params ask
    finish_reason: str | None = None  # "stop" | "length" | "position_limit" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    callbacks: list[Callable[[Generation], None]] = field(default_factory=list)
    future: asyncio.Future | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        for cb in self.callbacks:
            cb(self)
        if self.future is not None and not self.future.done():
            self.future.get_loop().call_soon_threadsafe(self.future.set_result, self)


@dataclass
class SessionMetrics:
    prefill_tokens: int = 0  # appended (prompt / env) tokens fed, first time
    decode_tokens: int = 0  # tokens sampled (each is fed once too, as a decode step)
    reprefilled_tokens: int = 0  # tokens fed again (recompute after preemption)
    evicted_tokens: int = 0
    kv_reads: int = 0  # sum over decode steps of the live KV attended
    evictions: int = 0  # eviction calls (a compaction's, or a token evictor's)
    peak_live_kv: int = 0
    preemptions: int = 0


class Footprint:
    """The live KV of a session and its forks together, each shared token once: what a family of
    threads holds (SideQuest: the main thread and its auxiliary thread) and its peak. A token
    stays until the last session of the family holding it live evicts it or closes."""

    def __init__(self):
        self.readers: dict[int, int] = {}  # token key -> sessions of the family holding it live
        self.keys = itertools.count()
        self.peak = 0

    @property
    def live(self) -> int:
        return len(self.readers)

    def new(self, n: int) -> list[int]:
        keys = [next(self.keys) for _ in range(n)]
        self.readers.update(dict.fromkeys(keys, 1))
        self.peak = max(self.peak, len(self.readers))
        return keys

    def share(self, keys: Iterable[int]) -> None:
        for k in keys:
            self.readers[k] += 1

    def drop(self, keys: Iterable[int]) -> None:
        for k in keys:
            if self.readers[k] == 1:
                del self.readers[k]
            else:
                self.readers[k] -= 1


class Host(Protocol):
    """All a session asks of the engine that owns it (:class:`compactrl.engine.Engine`)."""

    tokenizer: object | None
    vocab_size: int
    position_limit: int
    eos_token_ids: list[int]
    n_layers: int

    def check_fits(self, s: Session, more: int) -> None: ...  # the pool can ever hold it

    def wake(self, s: Session) -> None: ...  # it has tokens to feed or a generation to run

    def truncate(self, s: Session, n: int) -> None: ...  # its KV from stream index n - 1 on goes

    def fork(self, s: Session, rollout_id: str | None) -> Session: ...

    def forget(self, s: Session) -> None: ...  # closed: it leaves the engine


class Session:
    """Create with :meth:`Engine.session`; then append / generate / evict / fork / close."""

    def __init__(self, engine: Host, rollout_id: str | None = None):
        self.engine = engine
        self.id = rollout_id or f"s{next(_ids)}"
        self.tokens: list[int] = []
        self.evict_at: list[int | None] = []
        self.trainable: list[bool] = []
        self.logprobs: list[float] = []
        self.model_logprobs: list[float] = []
        self.turn: list[int] = []
        self.role: list[str] = []
        self.segment: list[int] = []
        self.cursor: list[int] = []
        self.fed = 0  # tokens fed to the model so far
        self.row: int | None = None  # KV row, None when not resident (new or preempted)
        self.chain: list[tuple[Segment, torch.Tensor]] = []  # shared prefixes with this session's valid bits
        self.pending_logits: torch.Tensor | None = None  # logits for token `fed`, from query fed-1
        self.drops: deque[tuple[int, list[int]]] = deque()  # KV evictions to apply once fed == e
        self.generation: Generation | None = None
        self.closed = False
        self._seg, self._new_segment = 0, False
        self.live = 0  # live (not evicted) fed-or-unfed tokens
        self.metrics = SessionMetrics()
        self.footprint = Footprint()  # shared with this session's forks
        self.keys: list[int] = []  # each token's key in the footprint
        self.evictor: EvictorState | None = None  # a token evictor the engine runs (use_evictor)
        self.adapter_from: int | None = None  # gated adapters act from this stream index (a thread's own)
        self.admitted_at = 0  # scheduler tick of the last admission (LIFO preemption order)
        self.last_active = 0.0  # time.monotonic() of the last work (LRU displacement of idle sessions)

    def __repr__(self) -> str:
        return f"Session({self.id!r}, T={len(self.tokens)}, fed={self.fed}, live={self.live})"

    # ---- user API -----------------------------------------------------------------------
    def append(
        self, tokens: Iterable[int], *, role: str = "user", turn: int | None = None, cursor: int = NO_CURSOR
    ) -> Session:
        """Add prompt/environment tokens to the stream; they are prefilled by the next engine steps."""
        toks = [int(t) for t in tokens]
        self._check_open("append")
        self._check_idle("append")
        if role not in ROLES:
            raise SessionError(f"role {role!r} is not one of {ROLES}")
        bad = [t for t in toks if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise SessionError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.engine.vocab_size})")
        if len(self.tokens) + len(toks) > self.engine.position_limit:
            raise SessionError(self._position_message(f"appending {len(toks)} tokens"))
        self.engine.check_fits(self, len(toks))
        turn = (self.turn[-1] + 1 if self.turn else 0) if turn is None else turn
        self._extend(toks, role=role, turn=turn, cursor=cursor)
        return self

    def generate(
        self,
        params: SamplingParams | None = None,
        *,
        role: str = "assistant",
        turn: int | None = None,
        on_done=None,
    ) -> Generation:
        """Start decoding after everything appended so far; the engine fills ``Generation.tokens``.
        ``turn`` labels the generated tokens (default: a new turn)."""
        params = params or SamplingParams()
        self._check_open("generate")
        self._check_idle("generate")
        if not self.tokens:
            raise SessionError("generate needs context: append a prompt first")
        room = self.engine.position_limit - len(self.tokens)  # the generation stops there at the latest
        if room <= 0:
            raise SessionError(self._position_message("generating a token"))
        if params.stop and self.engine.tokenizer is None:
            raise SessionError("stop strings need a tokenizer: create the engine with one")
        self.engine.check_fits(self, min(params.max_tokens, room))
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.engine.eos_token_ids))
        if role not in ROLES:
            raise SessionError(f"role {role!r} is not one of {ROLES}")
        turn = self.turn[-1] + 1 if turn is None else turn
        gen = Generation(
            self, params, make_generator(params.seed), frozenset(stop), len(self.tokens), turn, role
        )
        if on_done is not None:
            gen.callbacks.append(on_done)
        self.generation = gen
        self.engine.wake(self)
        return gen

    async def agenerate(
        self, params: SamplingParams | None = None, *, role: str = "assistant", turn: int | None = None
    ) -> Generation:
        """``generate`` for asyncio agent loops; the engine's ``serve()`` task does the work."""
        gen = self.generate(params, role=role, turn=turn)
        gen.future = asyncio.get_running_loop().create_future()
        if gen.done:
            return gen
        return await gen.future

    def evict(self, spans: Iterable[tuple[int, int] | int]) -> int:
        """Evict stream indices (``(start, end)`` half-open spans or single indices) in place.

        The eviction happens at ``e = len(stream)``: every token appended so far is fed with the
        evicted tokens still visible, every later token will not see them. Returns tokens evicted.
        """
        self._check_open("evict")
        self._check_idle("evict")
        T = len(self.tokens)
        idx: list[int] = []
        for s in spans:
            a, b = (s, s + 1) if isinstance(s, (int, np.integer)) else s
            if a >= b:
                raise SessionError(f"span ({a}, {b}) is an empty span: give (start, end) with start < end")
            if not 0 <= a < b <= T:
                raise SessionError(f"span ({a}, {b}) is outside the stream [0, {T})")
            idx.extend(range(a, b))
        if len(set(idx)) != len(idx):
            raise SessionError("spans overlap; give each token once")
        gone = [j for j in idx if self.evict_at[j] is not None]
        if gone:
            raise SessionError(f"token(s) {gone[:5]} were already evicted (at {self.evict_at[gone[0]]})")
        if not idx:
            return 0
        self.evict_now(sorted(idx))
        self._new_segment = True  # a compaction boundary: later tokens start a new segment
        self.engine.wake(self)
        return len(idx)

    def evict_now(self, idx: list[int]) -> None:
        """Record the eviction of live stream indices (sorted) at ``e = len(stream)``; the engine
        clears their KV once everything before ``e`` is fed. Used by :meth:`evict` and the engine's
        token evictor."""
        T = len(self.tokens)
        for j in idx:
            self.evict_at[j] = T
        self.drops.append((T, idx))
        self.live -= len(idx)
        self.footprint.drop(self.keys[j] for j in idx)
        self.metrics.evicted_tokens += len(idx)
        self.metrics.evictions += 1

    def truncate(self, n: int) -> int:
        """Forget the stream from index ``n`` on, as if it had never been appended: the tokens that
        follow are fed at positions ``n, n + 1, ...`` (re-prefill's prefix reuse, what a prefix cache
        gives; KV-streams' in-place eviction is :meth:`evict`). Only a stream nothing was evicted from
        can be cut: an eviction recorded after ``n`` would be undone. Returns the tokens cut."""
        self._check_open("truncate")
        self._check_idle("truncate")
        T = len(self.tokens)
        if not 0 <= n <= T:
            raise SessionError(f"truncate({n}) is outside the stream [0, {T}]")
        if any(e is not None for e in self.evict_at) or self.evictor is not None:
            raise SessionError(f"session {self.id} has evicted tokens (or runs an evictor): a cut would undo "
                               "evictions; cut only a stream that is never evicted (re-prefill)")  # fmt: skip
        self.footprint.drop(self.keys[n:])
        for name in RECORD_FIELDS:
            del getattr(self, name)[n:]
        del self.keys[n:]
        self.live -= T - n
        self.engine.truncate(self, n)
        return T - n

    def use_evictor(self, evictor, head: int = 0) -> Session:
        """Have the engine run a token evictor (:mod:`compactrl.compaction.evictors`) on this session
        from now on; stream indices below ``head`` are never evicted (set ``evictor.head`` later if
        the head is not appended yet)."""
        self._check_open("use an evictor")
        self.evictor = EvictorState(evictor, self.engine.n_layers, head)
        return self

    def fork(self, rollout_id: str | None = None) -> Session:
        """A child sharing this session's KV (no copy): both read it as a frozen prefix. Tokens
        appended but not yet fed are fed first (the engine steps), so the whole stream is shared."""
        self._check_open("fork")
        self._check_idle("fork")
        return self.engine.fork(self, rollout_id)

    def mark_cursor(self, indices: Iterable[int], cursor: int) -> None:
        """Label stream tokens with a tool output's cursor id (a tool call is generated before the
        tool says which cursor its output gets)."""
        for j in indices:
            self.cursor[j] = cursor

    def cancel(self) -> None:
        """Stop the generation in progress (finish reason ``"abort"``); what it sampled stays."""
        if self.generating:
            self.generation._finish("abort")

    def close(self) -> None:
        if not self.closed:
            if self.generating:
                raise SessionError(f"session {self.id} is generating; wait for it before closing")
            self.closed = True
            self.footprint.drop(self._live_keys())
            self.engine.forget(self)

    def _live_keys(self) -> list[int]:
        return [k for k, e in zip(self.keys, self.evict_at, strict=True) if e is None]

    def trace(self) -> Trace:
        T = len(self.tokens)
        return Trace.from_tokens(
            self.tokens,
            evict_at=[T if e is None else e for e in self.evict_at],
            trainable=self.trainable,
            logprobs=self.logprobs,
            turn=self.turn,
            role=self.role,
            segment=self.segment,
            cursor=self.cursor,
            rollout_id=self.id,
        )

    # ---- engine side -------------------------------------------------------------------------
    @property
    def unfed(self) -> int:
        return len(self.tokens) - self.fed

    @property
    def busy(self) -> bool:
        """Has work for the engine: tokens to feed, evictions to apply, or an unfinished generation."""
        due = bool(self.drops) and self.row is not None  # a non-resident session applies them on return
        return not self.closed and (self.unfed > 0 or due or self.generating)

    @property
    def generating(self) -> bool:
        return self.generation is not None and not self.generation.done

    def _extend(
        self, toks: list[int], *, role: str, turn: int, cursor: int = NO_CURSOR, lp=None, model_lp=None
    ) -> None:
        """Add tokens to the record; ``lp`` marks one sampled (trainable) token and its log-prob."""
        n = len(toks)
        if self._new_segment:
            self._seg, self._new_segment = self._seg + 1, False
        self.tokens += toks
        self.evict_at += [None] * n
        self.trainable += [lp is not None] * n
        self.logprobs += [float("nan")] * n if lp is None else [lp]
        self.turn += [turn] * n
        self.role += [role] * n
        self.segment += [self._seg] * n
        self.model_logprobs += [float("nan") if model_lp is None else model_lp] * n
        self.cursor += [cursor] * n
        self.live += n
        self.metrics.peak_live_kv = max(self.metrics.peak_live_kv, self.live)
        self.keys += self.footprint.new(n)
        if self.unfed:
            self.engine.wake(self)

    def _position_message(self, what: str) -> str:
        limit = self.engine.position_limit
        return (
            f"session {self.id}: {what} would take the stream past the model's position limit of {limit} "
            f"(max_position_embeddings; the stream already holds {len(self.tokens)} tokens); stream "
            "positions are never renumbered, so evicting does not free them: use a model or config with a "
            "larger limit (e.g. YaRN rope scaling), or shorter episodes"
        )

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise SessionError(f"cannot {what}: session {self.id} is closed")

    def _check_idle(self, what: str) -> None:
        if self.generating:
            raise SessionError(f"cannot {what} while session {self.id} is generating; wait for it to finish")
