"""The stream data model: one rollout as one token stream.

Token ``i`` has RoPE position ``i``. An eviction between feeding token ``e-1`` and
token ``e`` sets ``evict_at[j] = e`` for every token ``j`` it removes; tokens never
evicted have ``evict_at[j] = T``. Query ``i`` may attend key ``j`` iff
``j <= i < evict_at[j]``. Everything that crosses the engine/trainer boundary is a
:class:`Trace`; re-prefill mode produces one trace per segment sharing a ``rollout_id``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant", "tool", "summary")
RECORD_FIELDS = ("tokens", "evict_at", "trainable", "role", "turn")  # what a trace file must hold per token
NO_CURSOR = -1


class TraceError(ValueError):
    """A trace that breaks the stream invariant; the message names the field and the fix."""


@dataclass
class Trace:
    tokens: np.ndarray  # int64 [T]
    evict_at: np.ndarray  # int64 [T], j < evict_at[j] <= T; T means never evicted
    trainable: np.ndarray  # bool [T], tokens sampled by the policy
    logprobs: np.ndarray  # float64 [T], sampling log-prob of trainable tokens, NaN elsewhere
    turn: np.ndarray  # int32 [T], non-decreasing
    role: list[str]  # one of ROLES per token
    segment: np.ndarray  # int32 [T], non-decreasing; bumps at each compaction
    cursor: np.ndarray  # int32 [T], tool-output cursor id, NO_CURSOR elsewhere
    rollout_id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_tokens(
        cls,
        tokens,
        *,
        evict_at=None,
        trainable=None,
        logprobs=None,
        turn=None,
        role=None,
        segment=None,
        cursor=None,
        rollout_id: str = "",
        meta: dict | None = None,
    ) -> Trace:
        """Build and validate a trace; unspecified fields get neutral defaults."""
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)

        def arr(x, default, dtype):
            return np.full(T, default, dtype=dtype) if x is None else np.asarray(x, dtype=dtype)

        trace = cls(
            tokens=tokens,
            evict_at=arr(evict_at, T, np.int64),
            trainable=arr(trainable, False, bool),
            logprobs=arr(logprobs, np.nan, np.float64),
            turn=arr(turn, 0, np.int32),
            role=list(role) if role is not None else ["user"] * T,
            segment=arr(segment, 0, np.int32),
            cursor=arr(cursor, NO_CURSOR, np.int32),
            rollout_id=rollout_id,
            meta=dict(meta or {}),
        )
        trace.validate()
        return trace

    def __len__(self) -> int:
        return len(self.tokens)

    # ---- invariants ----------------------------------------------------------------
    def validate(self, vocab_size: int | None = None) -> Trace:
        """Check every field against the stream invariant; raise TraceError naming the problem."""
        T = len(self.tokens)
        where = f"trace {self.rollout_id!r}" if self.rollout_id else "trace"
        if self.tokens.ndim != 1:
            raise TraceError(f"{where}: tokens must be a flat list of ids, got shape {self.tokens.shape}")
        for name in ("evict_at", "trainable", "logprobs", "turn", "segment", "cursor"):
            n = len(getattr(self, name))
            if n != T:
                raise TraceError(f"{where}: {name} has {n} entries but tokens has {T}; give one per token")
        if len(self.role) != T:
            raise TraceError(f"{where}: role has {len(self.role)} entries but tokens has {T}")
        if T and self.tokens.min() < 0:
            raise TraceError(f"{where}: negative token id {int(self.tokens.min())}")
        if vocab_size is not None and T and self.tokens.max() >= vocab_size:
            j = int(np.argmax(self.tokens >= vocab_size))
            raise TraceError(
                f"{where}: token {j} has id {int(self.tokens[j])} >= vocab_size {vocab_size}; "
                "the trace was made with another tokenizer"
            )
        idx = np.arange(T)
        bad = np.flatnonzero((self.evict_at <= idx) | (self.evict_at > T))
        if len(bad):
            j = int(bad[0])
            raise TraceError(
                f"{where}: evict_at[{j}] = {int(self.evict_at[j])} is outside ({j}, {T}]; a token can only "
                f"be evicted after it was fed (evict_at > index), and never-evicted tokens use T = {T}"
            )
        if T and self.trainable[0]:
            raise TraceError(f"{where}: token 0 is marked trainable but nothing predicts it; mark it False")
        lp = self.logprobs[self.trainable]
        finite = lp[np.isfinite(lp)]
        if len(finite) and finite.max() > 1e-6:
            raise TraceError(f"{where}: a sampling log-prob is positive ({finite.max():.3g}); pass log-probs")
        for name in ("turn", "segment"):
            a = getattr(self, name)
            if T > 1 and (np.diff(a) < 0).any():
                j = int(np.argmax(np.diff(a) < 0)) + 1
                raise TraceError(f"{where}: {name} decreases at token {j}; {name} ids must be non-decreasing")
        unknown = set(self.role) - set(ROLES)
        if unknown:
            raise TraceError(f"{where}: unknown role(s) {sorted(unknown)}; use one of {ROLES}")
        return self

    # ---- views -----------------------------------------------------------------------
    @property
    def num_evicted(self) -> int:
        return int((self.evict_at < len(self)).sum())

    def thread_mask(self) -> np.ndarray:
        """The tokens an auxiliary thread (``meta["aux"]``) wrote or was prompted with, from its
        ``fork_at`` on; none in a main trace. A thread adapter (gated LoRA) acts on exactly these."""
        own = np.zeros(len(self), bool)
        if self.meta.get("aux"):
            own[self.meta["fork_at"] :] = True
        return own

    def visible(self, i: int) -> np.ndarray:
        """Indices of the keys query ``i`` attends: what the model saw when it fed token i."""
        j = np.arange(i + 1)
        return j[self.evict_at[: i + 1] > i]

    def live_counts(self) -> np.ndarray:
        """Live-context size seen by each query (the KV the engine held at that step)."""
        T = len(self)
        delta = np.zeros(T + 1, dtype=np.int64)
        np.add.at(delta, np.arange(T), 1)
        np.add.at(delta, self.evict_at, -1)
        return np.cumsum(delta)[:T]

    def eviction_events(self) -> list[tuple[int, np.ndarray]]:
        """``[(e, evicted indices)]`` in stream order, one per distinct eviction step."""
        evicted = np.flatnonzero(self.evict_at < len(self))
        steps = np.unique(self.evict_at[evicted])
        return [(int(e), evicted[self.evict_at[evicted] == e]) for e in steps]

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "tokens": self.tokens.tolist(),
            "evict_at": self.evict_at.tolist(),
            "trainable": self.trainable.astype(int).tolist(),
            "logprobs": [None if math.isnan(x) else x for x in self.logprobs.tolist()],
            "turn": self.turn.tolist(),
            "role": self.role,
            "segment": self.segment.tolist(),
            "cursor": self.cursor.tolist(),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        """A trace from its JSON record; the per-token fields of :data:`RECORD_FIELDS` are required."""
        if not isinstance(d, dict) or "tokens" not in d:
            raise TraceError("a trace record must be a JSON object with at least a 'tokens' list")
        unknown = set(d) - {
            "rollout_id",
            "tokens",
            "evict_at",
            "trainable",
            "logprobs",
            "turn",
            "role",
            "segment",
            "cursor",
            "meta",
        }
        if unknown:
            raise TraceError(f"unknown trace field(s) {sorted(unknown)}; check the writer's version")
        missing = [k for k in RECORD_FIELDS if k not in d]
        if missing:  # defaults would silently make every token a trainable-free user token
            raise TraceError(f"a trace record needs {missing} (every writer stores them); check the writer")
        lp = d.get("logprobs")
        if lp is not None:
            lp = [np.nan if x is None else x for x in lp]
        try:
            return cls.from_tokens(
                d["tokens"],
                evict_at=d.get("evict_at"),
                trainable=d.get("trainable"),
                logprobs=lp,
                turn=d.get("turn"),
                role=d.get("role"),
                segment=d.get("segment"),
                cursor=d.get("cursor"),
                rollout_id=str(d.get("rollout_id", "")),
                meta=d.get("meta"),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, TraceError):
                raise
            raise TraceError(f"trace {d.get('rollout_id', '')!r}: a field has the wrong type ({e})") from e


def save_traces(path: str | Path, traces: list[Trace]) -> None:
    """Write traces as JSONL, one trace per line (atomically, so a crash never leaves half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for t in traces:
            f.write(json.dumps(t.to_dict()) + "\n")
    tmp.replace(path)


def load_traces(path: str | Path) -> list[Trace]:
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file {path} does not exist")
    traces = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                traces.append(Trace.from_dict(json.loads(line)))
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not valid JSON ({e.msg}); one trace object per line") from e
            except TraceError as e:
                raise TraceError(f"{path}:{n}: {e}") from e
    return traces
