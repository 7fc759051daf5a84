"""The trainer forward: per-token log-probs of whole compacted rollouts in one pass each.

A stream trace is fed once, at positions = stream index, under the eviction mask; because a
kept token's K/V were computed with exactly the visibility it had in the engine, this
reproduces the engine's log-probs. The re-prefill view (one sample per segment, kept tokens
recomputed at fresh positions) is what other frameworks train on; it is here as the baseline
and the negative control.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch

from compactrl.masks import Stream, chunked_mask, dense_mask, flex_block_mask, pack, pack_greedy, streams
from compactrl.models.decoder import CausalLM, token_logprobs, topk_logprobs
from compactrl.models.lora import adapter_mask
from compactrl.trace import Trace

Backend = Literal["chunked", "dense", "flex"]


def _row_mask(evict_at: torch.Tensor, backend: Backend, chunk: int):
    if backend == "chunked":
        return chunked_mask(evict_at, chunk)
    if backend == "dense":
        return dense_mask(evict_at)
    if backend == "flex":
        return flex_block_mask(evict_at)
    raise ValueError(f"unknown attention backend {backend!r}; use 'chunked', 'dense' or 'flex'")


def _rows(model: CausalLM, traces: list[Trace], backend: Backend, chunk: int, max_row_tokens: int | None,
          splice_forks: bool):  # fmt: skip
    """Validate, pack (each auxiliary thread into the main trace it forked from, where exact), and
    yield ``(streams, packed row, final hidden states)`` per row."""
    device = next(model.parameters()).device
    cfg = model.config
    for t in traces:
        t.validate(vocab_size=cfg.vocab_size)
        if not 0 < len(t) <= cfg.max_position_embeddings:
            raise ValueError(
                f"trace {t.rollout_id!r} has {len(t)} tokens; the model takes 1 to "
                f"max_position_embeddings = {cfg.max_position_embeddings} positions"
            )
    ss = streams(traces, splice_forks)
    rows = [[k] for k in range(len(ss))] if max_row_tokens is None else pack_greedy(ss, max_row_tokens)
    for row in rows:
        row_streams = [ss[k] for k in row]
        packed = pack(row_streams, device)
        mask = _row_mask(packed.evict_at, backend, chunk)
        with adapter_mask(model, partial(_thread_tokens, row_streams, device)):
            hidden = model.hidden_states(packed.tokens, packed.positions, mask)[0]
        yield row_streams, packed, hidden


def _thread_tokens(row_streams: list[Stream], device) -> torch.Tensor:
    """A packed row's auxiliary-thread tokens (where a gated thread adapter acts)."""
    return torch.as_tensor(np.concatenate([s.thread for s in row_streams]), device=device)


def _queries(row_streams: list[Stream], packed, copy_shared: bool):
    """Per member trace of the row: ``(trace, main trace, first output computed, row index of the
    query before each computed output)``. With ``copy_shared`` a fork's outputs over the prefix it
    shares with its main trace are the main's (the same queries under the same mask)."""
    for s, start in zip(row_streams, packed.starts, strict=True):
        for k, idx, shared in zip(s.members, s.index, s.shared, strict=True):
            lo = max(shared, 1) if copy_shared else 1
            yield k, s.members[0], lo, torch.as_tensor(start + idx[lo - 1 : -1])


def _wanted_rows(plan: list, wanted: list) -> torch.Tensor:
    """Which of a row's computed outputs (``plan`` of :func:`_queries`) are wanted: a trace's own
    positions, and a main trace's positions that a fork copies (its shared prefix) where the fork
    wants them."""
    rows, main_at = [], {}
    for k, m, lo, _ in plan:  # a main trace comes before its forks
        want = torch.as_tensor(np.asarray(wanted[k], dtype=bool))
        rows.append(want[lo:].clone())
        if k == m:
            main_at[k] = len(rows) - 1
        elif lo > 1:
            rows[main_at[m]][: lo - 1] |= want[1:lo]
    return torch.cat(rows)


def _join(first: torch.Tensor, main: torch.Tensor | None, lo: int, computed: torch.Tensor) -> torch.Tensor:
    """A trace's outputs: ``first`` (row 0, nothing predicts token 0), the main's over [1, lo), then
    the computed ones."""
    return torch.cat([first, main[1:lo] if lo > 1 else computed[:0], computed])


def stream_logprobs(
    model: CausalLM,
    traces: list[Trace],
    *,
    backend: Backend = "chunked",
    chunk: int = 256,
    max_row_tokens: int | None = None,
    logits_chunk: int = 1024,
    value_head: torch.nn.Module | None = None,
    candidates: list[torch.Tensor] | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    splice_forks: bool = True,
    wanted: list | None = None,
) -> list[torch.Tensor]:
    """``out[k][i] = log p(tokens[i] | what query i-1 saw)`` for each trace (``out[k][0] = 0``).

    One forward per row: each trace alone, or several packed into rows of at most
    ``max_row_tokens`` tokens. ``chunked`` costs T x live-context and has a CPU backward;
    ``flex`` is the CUDA path (forward-only on CPU); ``dense`` is the T^2 reference.
    With a ``value_head`` (the critic on the shared backbone) it returns ``(logprobs, values)``,
    ``values[k][i]`` being the value of the state in which token ``i`` was chosen. With
    ``candidates`` (``[T, m]`` token ids per trace) row ``i`` scores those ``m`` tokens at
    position ``i`` instead of the trace's own token (``[T, m]`` out; distillation's student side).
    ``temperature``: log-probs of the tempered distribution the engine sampled from. ``entropy``
    appends a column with that distribution's entropy at each position (``[T, 2]`` per trace).
    ``splice_forks``: SideQuest's forks fed inside their main trace's stream (:func:`streams`).
    ``wanted`` (a bool ``[T]`` per trace, e.g. its ``trainable``): outputs at those positions, 0
    where no trace wants them (a main trace also has those its forks want of their shared prefix);
    the head and its log-softmax, the largest GEMM of a step, run on those rows alone (values still
    come at every position).
    """
    out: list[torch.Tensor | None] = [None] * len(traces)
    values: list[torch.Tensor | None] = [None] * len(traces)
    for row_streams, packed, hidden in _rows(model, traces, backend, chunk, max_row_tokens, splice_forks):
        plan = list(_queries(row_streams, packed, copy_shared=candidates is None))
        h = hidden[torch.cat([q for *_, q in plan]).to(hidden.device)]
        if candidates is None:
            targets = torch.cat([torch.as_tensor(traces[k].tokens[lo:]) for k, _, lo, _ in plan])
        else:
            targets = torch.cat([candidates[k][1:] for k, *_ in plan])
        targets, kw = targets.to(h.device), dict(chunk=logits_chunk, temperature=temperature, entropy=entropy)
        if wanted is None:
            lp = token_logprobs(model, h, targets, **kw)
        else:
            keep = _wanted_rows(plan, wanted).to(h.device)
            some = token_logprobs(model, h[keep], targets[keep], **kw)
            lp = some.new_zeros((len(keep), *some.shape[1:]))
            lp[keep] = some
        v = value_head(h).float() if value_head is not None else None
        offset = 0
        for k, m, lo, q in plan:  # a main trace comes before its forks
            n = len(q)
            out[k] = _join(lp.new_zeros((1, *lp.shape[1:])), out[m], lo, lp[offset : offset + n])
            if v is not None:
                values[k] = _join(v.new_zeros(1), values[m], lo, v[offset : offset + n])
            offset += n
    if value_head is not None:
        return out, values  # type: ignore[return-value]
    return out  # type: ignore[return-value]


def full_context(trace: Trace) -> Trace:
    """The same tokens with nothing ever evicted (a distillation teacher's view)."""
    return dataclasses.replace(trace, evict_at=np.full(len(trace), len(trace), dtype=np.int64))


@torch.no_grad()
def stream_topk(
    model: CausalLM, traces: list[Trace], k: int, *, backend: Backend = "chunked", chunk: int = 256,
    max_row_tokens: int | None = None, logits_chunk: int = 1024, temperature: float = 1.0,
    splice_forks: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per trace, the ``k`` most likely tokens at each position and their log-probs (``[T, k]``
    each; row 0 is empty): a distillation teacher's or the reference anchor's side."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(traces)
    for row_streams, packed, hidden in _rows(model, traces, backend, chunk, max_row_tokens, splice_forks):
        for j, m, lo, q in _queries(row_streams, packed, copy_shared=True):
            ids, lp = topk_logprobs(model, hidden[q.to(hidden.device)], k, logits_chunk, temperature)
            main = out[m] or (None, None)
            out[j] = (_join(ids[:1] * 0, main[0], lo, ids), _join(lp[:1] * 0, main[1], lo, lp))
    return out  # type: ignore[return-value]


@dataclass
class Segment:
    """One re-prefill training sample: ``kept`` tokens re-fed, then the segment's new tokens."""

    tokens: np.ndarray  # kept + new
    stream_index: np.ndarray  # where each token sits in the original stream
    num_kept: int


def reprefill_segments(trace: Trace) -> list[Segment]:
    """The samples a re-prefill framework trains on for this rollout: one per segment.

    A segment starts at each eviction step ``e``; its sample is the tokens still live at ``e``
    (re-prefilled at fresh positions) followed by the tokens fed until the next eviction.
    """
    bounds = [0] + [e for e, _ in trace.eviction_events()] + [len(trace)]
    segments = []
    for e, nxt in zip(bounds[:-1], bounds[1:], strict=True):
        kept = np.flatnonzero(trace.evict_at[:e] > e)
        idx = np.concatenate([kept, np.arange(e, nxt)])
        segments.append(Segment(trace.tokens[idx], idx, len(kept)))
    return segments


def reprefill_logprobs(model: CausalLM, trace: Trace, *, original_positions: bool = False) -> torch.Tensor:
    """Log-probs of the stream's tokens as re-prefill mode computes them (the negative control).

    Each token ``i`` in a segment is scored from a fresh causal forward over the kept tokens plus
    the segment so far, at fresh positions (or the original ones). Entry 0 and entries no
    segment scores (the first token of the first segment) are 0.
    """
    device = next(model.parameters()).device
    out = torch.zeros(len(trace))
    for seg in reprefill_segments(trace):
        toks = torch.as_tensor(seg.tokens, device=device)
        idx = torch.as_tensor(seg.stream_index, device=device)
        pos = idx if original_positions else torch.arange(len(toks), device=device)
        hidden = model.hidden_states(toks, pos)[0]
        first = max(seg.num_kept, 1)
        lp = token_logprobs(model, hidden[first - 1 : -1], toks[first:])
        out[seg.stream_index[first:]] = lp.float().cpu()
    return out
