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

from compactrl.compaction.sidequest import thread_mask
from compactrl.masks import chunked_mask, dense_mask, flex_block_mask, pack, pack_greedy
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


def _rows(model: CausalLM, traces: list[Trace], backend: Backend, chunk: int, max_row_tokens: int | None):
    """Validate, pack, and yield ``(trace indices, packed row, final hidden states)`` per row."""
    device = next(model.parameters()).device
    cfg = model.config
    for t in traces:
        t.validate(vocab_size=cfg.vocab_size)
        if not 0 < len(t) <= cfg.max_position_embeddings:
            raise ValueError(
                f"trace {t.rollout_id!r} has {len(t)} tokens; the model takes 1 to "
                f"max_position_embeddings = {cfg.max_position_embeddings} positions"
            )
    rows = (
        [[k] for k in range(len(traces))] if max_row_tokens is None else pack_greedy(traces, max_row_tokens)
    )
    for row in rows:
        packed = pack([traces[k] for k in row], device)
        mask = _row_mask(packed.evict_at, backend, chunk)
        with adapter_mask(model, partial(_thread_tokens, [traces[k] for k in row], device)):
            hidden = model.hidden_states(packed.tokens, packed.positions, mask)[0]
        yield row, packed, hidden


def _thread_tokens(row: list[Trace], device) -> torch.Tensor:
    """A packed row's auxiliary-thread tokens (where a gated thread adapter acts)."""
    return torch.as_tensor(np.concatenate([thread_mask(t) for t in row]), device=device)


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
    """
    out: list[torch.Tensor | None] = [None] * len(traces)
    values: list[torch.Tensor | None] = [None] * len(traces)
    for row, packed, hidden in _rows(model, traces, backend, chunk, max_row_tokens):
        h = torch.cat([hidden[s : s + n - 1] for s, n in zip(packed.starts, packed.lengths, strict=True)])
        if candidates is None:
            targets = torch.cat([packed.tokens[s + 1 : s + n] for s, n in zip(packed.starts, packed.lengths)])
        else:
            targets = torch.cat([candidates[k][1:].to(h.device) for k in row])
        lp = token_logprobs(model, h, targets, chunk=logits_chunk, temperature=temperature, entropy=entropy)
        v = value_head(h).float() if value_head is not None else None
        offset = 0
        for k, n in zip(row, packed.lengths, strict=True):
            out[k] = torch.cat([lp.new_zeros((1, *lp.shape[1:])), lp[offset : offset + n - 1]])
            if v is not None:
                values[k] = torch.cat([v.new_zeros(1), v[offset : offset + n - 1]])
            offset += n - 1
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
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per trace, the ``k`` most likely tokens at each position and their log-probs (``[T, k]``
    each; row 0 is empty): a distillation teacher's or the reference anchor's side."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(traces)
    for row, packed, hidden in _rows(model, traces, backend, chunk, max_row_tokens):
        for j, s, n in zip(row, packed.starts, packed.lengths, strict=True):
            ids, lp = topk_logprobs(model, hidden[s : s + n - 1], k, logits_chunk, temperature)
            out[j] = (torch.cat([ids[:1] * 0, ids]), torch.cat([lp[:1] * 0, lp]))
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
