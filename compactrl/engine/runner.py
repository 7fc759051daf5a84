"""The model forward of one engine step: ragged prefill chunks and decode tokens in one batch.

All tokens of the step go through the linear layers together (``[1, N, d]``). Attention is
where sessions differ: single decode tokens of sessions without a shared prefix attend their
rows batched (one call of the decode attention kernel, :mod:`~compactrl.engine.decode_attention`,
or one SDPA per run of consecutive rows, each a view of the cache); prompt chunks over their own
row likewise (one call of :mod:`~compactrl.engine.chunk_attention`; without it, first chunks of
equal length share one causal SDPA and later ones attend per session); sessions reading a forked
prefix attend per session, merging the prefix and own-row parts by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import torch
import torch.nn.functional as F

from compactrl.engine.chunk_attention import ChunkAttention
from compactrl.engine.decode_attention import DecodeAttention
from compactrl.engine.decode_layers import DecodeLayers
from compactrl.engine.fused import FusedProjection
from compactrl.engine.kv_cache import KVCache
from compactrl.engine.linear import Linears
from compactrl.masks import chunked_mask
from compactrl.models.attention import attend
from compactrl.models.decoder import CausalLM


@dataclass
class Feed:
    """Feed stream tokens ``[start, start + n)`` of a session into cache entries ``[entry, entry + n)``."""

    session: object
    tokens: list[int]
    start: int
    entry: int
    row: int
    chain: list  # [(Segment, mask)] of the session
    logits: bool  # compute logits after the last token
    keep_q: int = 0  # hand over the last keep_q queries per layer (a session's token evictor)
    queries: list = field(default_factory=list)  # [keep_q, H, D] per layer, post-RoPE

    @property
    def n(self) -> int:
        return len(self.tokens)


def _attn_lse(q, k, v, mask):
    """Attention of ``q [1,H,n,D]`` over ``k, v [1,Hkv,N,D]`` under ``mask [n|1, N]``, with log-sum-exp."""
    _, H, n, D = q.shape
    hkv = k.shape[1]
    q5 = q.view(1, hkv, H // hkv, n, D)
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse).nan_to_num(0.0)
    return (p @ v.unsqueeze(2)).view(1, H, n, D), lse.view(1, H, n, 1)


def _session_attention(q, kv: KVCache, layer: int, f: Feed) -> torch.Tensor:
    """A prefill chunk (or a chained decode token): own row causally, plus any shared prefixes."""
    end = f.entry + f.n
    k, v = kv.k[layer][f.row : f.row + 1, :, :end], kv.v[layer][f.row : f.row + 1, :, :end]
    ent = torch.arange(end, device=q.device)
    own = kv.valid[f.row, :end][None, :] & (
        ent[None, :] <= f.entry + torch.arange(f.n, device=q.device)[:, None]
    )
    if not f.chain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=own[None, None], enable_gqa=True)
    outs, lses = [], []
    for seg, mask in f.chain:
        r = slice(seg.row, seg.row + 1)
        o, lse = _attn_lse(q, kv.k[layer][r, :, : seg.n], kv.v[layer][r, :, : seg.n], mask[None, :])
        outs.append(o)
        lses.append(lse)
    o, lse = _attn_lse(q, k, v, own)
    outs.append(o)
    lses.append(lse)
    lse_all = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(torch.exp(l - lse_all) * o for o, l in zip(outs, lses, strict=True))


def _attend_rows(q, K, V, mask, a: int, b: int, row: int, n: int) -> torch.Tensor:
    """Queries ``a:b`` of a decode batch over cache rows ``row : row + b - a`` (a view), ``n`` entries."""
    rows = slice(row, row + b - a)
    return F.scaled_dot_product_attention(
        q[a:b], K[rows, :, :n], V[rows, :, :n], attn_mask=mask[a:b, ..., :n]
    )


def _fresh(f: Feed) -> bool:
    """A chunk that starts an empty row (no prefix): plain causal attention over itself."""
    return f.entry == 0 and not f.chain


def step_order(feeds: list[Feed]) -> tuple[list[Feed], list[Feed]]:
    """A step's feeds in token order: single decode tokens (no shared prefix) first, by row (their
    attention is one batched call over a block of rows, their queries a plain slice), then fresh
    chunks by length (each length's tokens one block, which one causal SDPA reads as views), then
    the rest."""
    dec = sorted((f for f in feeds if f.n == 1 and not f.chain), key=lambda f: f.row)
    rest = sorted((f for f in feeds if f.n > 1 or f.chain), key=lambda f: (not _fresh(f), f.n))
    return dec, rest


def thread_tokens(feeds: list[Feed], device) -> torch.Tensor:
    """Which of the step's tokens, in step order, belong to a session's own thread
    (``Session.adapter_from``: the gated adapters act there)."""
    dec, rest = step_order(feeds)
    marks = [f.session.adapter_from is not None and p >= f.session.adapter_from
             for f in dec + rest for p in range(f.start, f.start + f.n)]  # fmt: skip
    return torch.tensor(marks, device=device)


@torch.inference_mode()
def forward_step(
    model: CausalLM,
    kv: KVCache,
    feeds: list[Feed],
    projections: list[FusedProjection],
    linears: Linears | None = None,
    attention: DecodeAttention | None = None,
    layers: DecodeLayers | None = None,
    chunks: ChunkAttention | None = None,
) -> dict[int, torch.Tensor]:
    """Write every fed token's K/V into its row and return float32 logits for feeds that ask.
    ``linears`` runs the linear layers and the head (see :mod:`compactrl.engine.linear`);
    ``attention`` the batched decode tokens' attention (SDPA when ``None``); ``layers`` all layers
    of the step in one call, where it applies (decode tokens, and prompt chunks over their own rows
    with ``chunks``); ``chunks`` the attention of prompt chunks over their own rows (SDPA when
    ``None``)."""
    device = kv.device
    lin = linears or Linears(model, "native")
    dec, rest = step_order(feeds)
    order, B = dec + rest, len(dec)
    offsets, N = {}, 0
    for f in order:
        offsets[id(f)] = N
        N += f.n
    tokens = torch.tensor([t for f in order for t in f.tokens], device=device)
    positions = torch.tensor([p for f in order for p in range(f.start, f.start + f.n)], device=device)
    kernel = B > 0 and attention is not None and attention.kind == "kernel"
    if B:
        d_rows = torch.tensor([f.row for f in dec], device=device)
        d_ent = torch.tensor([f.entry for f in dec], device=device)
        kv.valid[d_rows, d_ent] = True
        kv.pos[d_rows, d_ent] = positions[:B]
        length = max(f.entry for f in dec) + 1  # the longest row's entries up to its new token
    if kernel:
        d_len = d_ent + 1  # each row's entries up to its new token
    elif B:
        # maximal runs of consecutive rows: each is a view of the cache (no copy) with its own length
        runs, b0 = [], 0
        for b in range(1, B + 1):
            if b == B or dec[b].row != dec[b - 1].row + 1:
                runs.append((b0, b, dec[b0].row, max(f.entry for f in dec[b0:b]) + 1))
                b0 = b
        gather = len(runs) > 4  # many scattered rows: one gathered copy beats many small calls
        visible = kv.valid[d_rows, :length][:, None, None, :]
        d_mask = torch.zeros(visible.shape, dtype=kv.dtype, device=device).masked_fill_(
            ~visible, float("-inf")
        )

    own = [f for f in rest if not f.chain] if chunks is not None and chunks.kind == "kernel" else []
    if own:  # (offset, row, first entry, tokens) of each chunk over its own row: one kernel call
        own_rows = torch.tensor([[offsets[id(f)], f.row, f.entry, f.n] for f in own])
    later = [f for f in rest if f.chain] if own else [f for f in rest if not _fresh(f)]
    # fresh chunks come first in rest, by length (step_order): each group's tokens are one block
    fresh = [] if own else [list(g) for _, g in groupby((f for f in rest if _fresh(f)), key=lambda f: f.n)]
    capture = [f for f in feeds if f.keep_q]
    for f in rest:
        o = offsets[id(f)]
        kv.valid[f.row, f.entry : f.entry + f.n] = True
        kv.pos[f.row, f.entry : f.entry + f.n] = positions[o : o + f.n]
    x = model.model.embed_tokens(tokens)
    cos, sin = model.rope(positions[None], x.dtype)
    one_call = (
        layers is not None
        and (kernel or not B)
        and len(own) == len(rest)  # no chunk reads a forked prefix, and the chunk kernel is in use
        and layers.applies(N, prefill=bool(rest), keep_queries=bool(capture))
    )
    if one_call:  # each token's cache row and entry; decode tokens attend first, then the chunks
        rows, ents = (d_rows, d_ent) if not rest else (
            torch.tensor([f.row for f in order for _ in range(f.n)], device=device),
            torch.tensor([e for f in order for e in range(f.entry, f.entry + f.n)], device=device),
        )  # fmt: skip
        lens = d_len if B else torch.zeros(0, dtype=torch.int64)
        layers(x, cos[0], sin[0], kv, rows, ents, lens, length if B else 0, own_rows if rest else None)
    for li, layer in enumerate([] if one_call else model.model.layers):
        q, k, v = projections[li](layer.input_layernorm(x), cos[0], sin[0], lin)  # [N, heads, D]
        for f in capture:  # only sessions with a token evictor pay for this
            end = offsets[id(f)] + f.n
            f.queries.append(q[end - f.keep_q : end])
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
        K, V = kv.k[li], kv.v[li]
        if B:
            K[d_rows, :, d_ent] = k[:B]
            V[d_rows, :, d_ent] = v[:B]
        for f in rest:
            o = offsets[id(f)]
            K[f.row, :, f.entry : f.entry + f.n] = k[o : o + f.n].transpose(0, 1)
            V[f.row, :, f.entry : f.entry + f.n] = v[o : o + f.n].transpose(0, 1)
        if kernel:
            attention(q[:B], K, V, kv.valid, d_rows, d_len, length, out[:B])
        elif B:
            # GQA decode: the G query heads sharing a KV head go in as G queries, so each KV row is
            # read once per KV head instead of once per query head (about 2x faster on CPU)
            qd = q[:B].reshape(B, K.shape[1], -1, q.shape[-1])
            if gather:
                kd, vd = K.index_select(0, d_rows)[:, :, :length], V.index_select(0, d_rows)[:, :, :length]
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d_mask)
            else:
                parts = [_attend_rows(qd, K, V, d_mask, *run) for run in runs]
                od = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[:B] = od.reshape(B, *q.shape[1:])
        if own:
            chunks(q, K, V, kv.valid, own_rows, out)
        for group in fresh:  # first chunks of equal length: one causal SDPA on views of the block
            a, b = offsets[id(group[0])], offsets[id(group[-1])] + group[-1].n
            qs, ks, vs = (t[a:b].unflatten(0, (len(group), -1)).transpose(1, 2) for t in (q, k, v))
            og = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            out[a:b] = og.transpose(1, 2).flatten(0, 1)
        for f in later:
            o = offsets[id(f)]
            heads = q[o : o + f.n].transpose(0, 1)[None]
            out[o : o + f.n] = _session_attention(heads, kv, li, f)[0].transpose(0, 1)
        x = x + lin.linear(layer.self_attn.o_proj, out.view(N, -1))
        x = x + lin.mlp(layer.mlp, layer.post_attention_layernorm(x))
    want = [i for i, f in enumerate(feeds) if f.logits]
    if not want:
        return {}
    last = torch.tensor([offsets[id(feeds[i])] + feeds[i].n - 1 for i in want], device=device)
    logits = lin.logits(model, model.model.norm(x[last]))
    return {i: logits[k] for k, i in enumerate(want)}


@torch.no_grad()
def prefill_stream(
    model: CausalLM,
    tokens: list[int],
    evict_at: torch.Tensor,
    chunk: int = 256,
    linears: Linears | None = None,
    projections: list[FusedProjection] | None = None,
):
    """Recompute a whole stream's K/V under its eviction mask (exact, by the stream invariant).

    Used to resume a preempted session: returns per-layer ``k, v [Hkv, T, D]`` of every token
    and the float32 logits after the last one. ``linears`` (and the engine's ``projections``)
    run the linear layers as the engine's steps do.
    """
    lin = linears or Linears(model, "native")
    device = next(model.parameters()).device
    T = len(tokens)
    ids = torch.tensor(tokens, device=device)[None]
    mask = chunked_mask(evict_at.to(device), chunk)
    x = model.model.embed_tokens(ids)
    cos, sin = model.rope(torch.arange(T, device=device)[None], x.dtype)
    ks, vs = [], []
    for li, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if (lin.upcast or lin.onednn) and projections:  # the step's fused projection and GEMM
            h = layer.input_layernorm(x)[0]
            q, k, v = (t.transpose(0, 1)[None] for t in projections[li](h, cos[0], sin[0], lin))
        else:
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        ks.append(k[0])
        vs.append(v[0])
        a = attend(q, k, v, mask)
        x = x + lin.linear(attn.o_proj, a.transpose(1, 2).reshape(1, T, -1))
        x = x + lin.mlp(layer.mlp, layer.post_attention_layernorm(x))
    return ks, vs, lin.logits(model, model.model.norm(x[0, -1]))
