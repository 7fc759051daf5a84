"""Human view of traces (``compactrl trace show FILE``): the stream as styled text, grouped by turn.

Everything is printed as rich :class:`~rich.text.Text` built with explicit styles, never markup strings, so
token text such as ``[bold]`` is shown literally.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from rich.console import Console
from rich.text import Text

from compactrl.trace import NO_CURSOR, Trace

LABEL, TRAINABLE, EVICTED, MARKER, EVENT, NOTE = (
    "bold cyan",
    "green",
    "dim strike",
    "dim red",
    "bold yellow",
    "italic magenta",
)


class TokenTexter(Protocol):
    def token_text(self, token_id: int) -> str: ...


class TraceViewError(IndexError, ValueError):
    """A trace index or step outside the valid range; the message names the range."""


def _turn_span(trace: Trace, idx: np.ndarray) -> str:
    a, b = int(trace.turn[idx].min()), int(trace.turn[idx].max())
    return f"turn {a}" if a == b else f"turns {a}–{b}"


def header(trace: Trace) -> Text:
    T = len(trace)
    peak = int(trace.live_counts().max()) if T else 0
    fields = [
        ("T", T),
        ("turns", len(np.unique(trace.turn))),
        ("segments", len(np.unique(trace.segment))),
        ("trainable", int(trace.trainable.sum())),
        ("evicted", trace.num_evicted),
        ("evictions", len(trace.eviction_events())),
        ("peak live", peak),
    ]
    text = Text().append(f"rollout {trace.rollout_id or '(unnamed)'}", style="bold")
    for name, value in fields:
        text.append(f" · {name}={value}")
    return text


def _body(trace: Trace, idx: np.ndarray, console: Console, tokenizer, at: int | None) -> None:
    """Print tokens ``idx`` (increasing) grouped by (turn, role, segment, cursor) runs.

    Stream mode (``at is None``): eviction events become rule lines before token ``e`` and evicted tokens are
    struck through with a ``⟨evicted @ e⟩`` marker after each span. ``at`` mode: gaps in ``idx`` (tokens
    evicted before step ``at``) become ``… N evicted …`` lines.
    """
    T = len(trace)
    events = {} if at is not None else dict(trace.eviction_events())
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
        k = (int(trace.turn[j]), trace.role[j], int(trace.segment[j]), int(trace.cursor[j]))
        if k != key:
            flush()
            label = f"[turn {k[0]} · {k[1]} · seg {k[2]}" + (f" · cursor {k[3]}" if k[3] != NO_CURSOR else "")
            line, key = Text().append(label + "] ", style=LABEL), k
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
    """Print each trace (or only ``traces[index]``): a header of counts, then the stream grouped by turn.

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
