"""Human view of traces (``compactrl trace show FILE``): the stream as styled text, one labelled group per
chat message.

Everything is printed as rich :class:`~rich.text.Text` built with explicit styles, never markup strings, so
token text such as ``[bold]`` is shown literally.

Turns: a rollout gives the tokens of one chat message (header, content, close) one ``turn`` id, and the
view shows one group per message, labelled as the trace says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from rich.console import Console
from rich.text import Text

from compactrl.trace import NO_CURSOR, Trace

LABEL, TRAINABLE, EVICTED, MARKER, EVENT, NOTE, ALERT = (
    "bold cyan",
    "green",
    "dim strike",
    "dim red",
    "bold yellow",
    "italic magenta",
    "bold red",
)


class TokenTexter(Protocol):
    def token_text(self, token_id: int) -> str: ...


class TraceViewError(IndexError, ValueError):
    """A trace index or step outside the valid range; the message names the range."""


@dataclass
class Message:
    """A run of tokens shown as one group: one chat message."""

    start: int  # token indices [start, end)
    end: int
    turn: int
    role: str
    segment: int
    cursor: int
    sampled: bool  # holds policy-sampled (trainable) tokens

    def label(self) -> str:
        text = f"turn {self.turn} · {self.role} · seg {self.segment}"
        return text + (f" · cursor {self.cursor}" if self.cursor != NO_CURSOR else "")


def messages(trace: Trace) -> list[Message]:
    """Maximal runs of equal (turn, role, segment, cursor), in stream order."""
    T = len(trace)
    if not T:
        return []
    role = np.asarray(trace.role)
    change = (
        (np.diff(trace.turn) != 0)
        | (role[1:] != role[:-1])
        | (np.diff(trace.segment) != 0)
        | (np.diff(trace.cursor) != 0)
    )
    bounds = [0, *(np.flatnonzero(change) + 1).tolist(), T]
    return [
        Message(
            a,
            b,
            int(trace.turn[a]),
            trace.role[a],
            int(trace.segment[a]),
            int(trace.cursor[a]),
            bool(trace.trainable[a:b].any()),
        )  # fmt: skip
        for a, b in zip(bounds, bounds[1:])
    ]


def _turn_span(trace: Trace, idx: np.ndarray) -> str:
    a, b = int(trace.turn[idx].min()), int(trace.turn[idx].max())
    return f"turn {a}" if a == b else f"turns {a}–{b}"


def _count(meta: dict, key: str) -> int | None:
    v = meta.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def header(trace: Trace) -> Text:
    """One line of counts. ``turns`` counts messages; ``actions`` the assistant messages the policy sampled
    (environment turns; a trace's ``meta["actions"]``, when the rollout wrote it, takes precedence, since
    a pick compaction's answer is a sampled assistant message too). With ``meta["position_limit"]`` the
    stream length is shown against the model's position limit (stream positions are never renumbered,
    so the limit bounds the whole episode), in red when fewer positions are left than the trace's
    longest message holds: the episode ran into the limit."""
    T = len(trace)
    peak = int(trace.live_counts().max()) if T else 0
    msgs = messages(trace)
    actions = _count(trace.meta, "actions")
    if actions is None:
        actions = sum(m.role == "assistant" and m.sampled for m in msgs)
    fields = [
        ("T", T),
        ("turns", len(msgs)),
        ("actions", actions),
        ("segments", len(np.unique(trace.segment))),
        ("trainable", int(trace.trainable.sum())),
        ("evicted", trace.num_evicted),
        ("evictions", len(trace.eviction_events())),
        ("peak live", peak),
    ]
    text = Text().append(f"rollout {trace.rollout_id or '(unnamed)'}", style="bold")
    for name, value in fields:
        text.append(f" · {name}={value}")
    limit = _count(trace.meta, "position_limit")
    if limit:
        text.append(f" · positions {T:,} / {limit:,}")
        left = limit - T
        if left < max((m.end - m.start for m in msgs), default=1):
            text.append(f" (at the limit: {max(left, 0):,} left)" if left >= 0 else " (past the limit)",
                        style=ALERT)  # fmt: skip
    return text


def _body(trace: Trace, idx: np.ndarray, console: Console, tokenizer, at: int | None) -> None:
    """Print tokens ``idx`` (increasing) grouped by message (:func:`messages`), each group labelled.

    Stream mode (``at is None``): eviction events become rule lines before token ``e`` and evicted tokens are
    struck through with a ``⟨evicted @ e⟩`` marker after each span. ``at`` mode: gaps in ``idx`` (tokens
    evicted before step ``at``) become ``… N evicted …`` lines.
    """
    T = len(trace)
    events = {} if at is not None else dict(trace.eviction_events())
    msgs = messages(trace)
    group = np.zeros(T, dtype=np.int64)
    for n, m in enumerate(msgs):
        group[m.start : m.end] = n
    line: Text | None = None
    key = None
    span_e = T  # eviction step of the open struck-through span, T = none open
    prev = -1

    def close_span() -> None:
        nonlocal span_e
        if line is not None and span_e < T:
            line.append(f"⟨evicted @ {span_e}⟩ ", style=MARKER)
        span_e = T

    def flush() -> None:
        nonlocal line, key
        close_span()
        if line is not None:
            console.print(line)
        line, key = None, None

    for j in map(int, idx):
        if j in events:
            flush()
            removed = events[j]
            console.print(
                Text(
                    f"── eviction @ {j}: removed {len(removed)} tokens ({_turn_span(trace, removed)}) ──",
                    style=EVENT,
                )
            )
        if at is not None and j > prev + 1:
            flush()
            console.print(Text(f"… {j - prev - 1} evicted …", style=NOTE))
        prev = j
        k = int(group[j])
        if k != key:
            flush()
            line, key = Text().append(f"[{msgs[k].label()}] ", style=LABEL), k
        e = int(trace.evict_at[j]) if at is None else T
        if e != span_e:
            close_span()
            span_e = e
        tid = int(trace.tokens[j])
        piece = tokenizer.token_text(tid) if tokenizer is not None else f"{tid} "
        styles = [TRAINABLE] if trace.trainable[j] else []
        styles += [EVICTED] if e < T else []
        styles += ["reverse"] if j == at else []
        line.append(piece, style=" ".join(styles))
    flush()


def show_traces(
    traces: list[Trace],
    console: Console,
    tokenizer: TokenTexter | None = None,
    index: int | None = None,
    at: int | None = None,
    max_tokens: int | None = None,
) -> None:
    """Print each trace (or only ``traces[index]``): a header of counts, then the stream grouped by message.

    ``at=i`` shows only what the model saw when it fed token ``i`` (``trace.visible(i)``); ``max_tokens``
    truncates each printed stream with a note. ``tokenizer`` is any object with ``token_text(int) -> str``;
    without one the token ids are printed.
    """
    if index is not None:
        if not 0 <= index < len(traces):
            valid = f"valid indices are 0..{len(traces) - 1}" if traces else "the file holds no traces"
            raise TraceViewError(f"trace index {index} is out of range: {valid}")
        traces = [traces[index]]
    if not traces:
        console.print(Text("no traces", style=NOTE))
    for n, trace in enumerate(traces):
        T = len(trace)
        if n:
            console.print()
        console.print(header(trace))
        if at is not None:
            if not 0 <= at < T:
                raise TraceViewError(
                    f"at={at} is out of range for trace {trace.rollout_id!r} with T={T}: valid steps are "
                    f"0..{T - 1}"
                )
            idx = trace.visible(at)
            console.print(
                Text(f"context when feeding token {at}: {len(idx)} live of {at + 1} fed", style=NOTE)
            )
        else:
            idx = np.arange(T)
            console.print(
                Text()
                .append("legend: ", style="dim")
                .append("policy-sampled (trainable)", style=TRAINABLE)
                .append(" · prompt/env · ")
                .append("evicted", style=EVICTED)
            )
        shown = idx if max_tokens is None else idx[:max_tokens]
        _body(trace, shown, console, tokenizer, at)
        if len(shown) < len(idx):
            console.print(
                Text(
                    f"… truncated: showing {len(shown)} of {len(idx)} tokens (raise max_tokens for more) …",
                    style=NOTE,
                )
            )
