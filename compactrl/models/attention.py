"""Attention under the eviction mask, in each of its forms (see :mod:`compactrl.masks`).

The chunked form is the CPU training path: every query chunk attends only the keys it can
see, so cost is ``T x (live context + chunk)``. Its backward is a custom autograd function
because plain autograd through ``index_select`` would allocate and sum a full ``[T]``-sized
key gradient per chunk: an O(T^2 / chunk) term that dominates long rollouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compactrl.masks import ChunkedMask


def attend(q, k, v, mask) -> torch.Tensor:
    """Scaled dot-product attention, q/k/v ``[B, H, T, D]`` (GQA allowed), under ``mask``:
    None (causal), a bool tensor ``[T, T]`` / ``[B, T, T]``, a ChunkedMask, or a flex BlockMask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if isinstance(mask, torch.Tensor):
        mask = mask[None, None] if mask.dim() == 2 else mask[:, None] if mask.dim() == 3 else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if isinstance(mask, ChunkedMask):
        if q.shape[0] != 1:
            raise ValueError("a ChunkedMask covers one row; pack streams into a single row (batch 1)")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _ChunkedAttention.apply(q, k, v, mask)
        return torch.cat([_sdpa(*_gather(q, k, v, c), c) for c in mask.chunks], dim=2)
    return _flex(q, k, v, mask)


def _gather(q, k, v, c):
    """The chunk's queries and the keys/values it can see."""
    return q[:, :, c.q_start : c.q_end], k.index_select(2, c.keys), v.index_select(2, c.keys)


def _sdpa(q, k, v, c):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask[None, None], enable_gqa=True)


class _ChunkedAttention(torch.autograd.Function):
    """Per-chunk SDPA graphs on small leaf tensors; backward scatters each chunk's key grads once."""

    @staticmethod
    def forward(ctx, q, k, v, mask: ChunkedMask):
        graphs = []
        with torch.enable_grad():
            for c in mask.chunks:
                leaves = [x.detach().requires_grad_() for x in _gather(q.detach(), k.detach(), v.detach(), c)]
                graphs.append((c, leaves, _sdpa(*leaves, c)))
        ctx.graphs, ctx.inputs = graphs, [(x.shape, x.dtype) for x in (q, k, v)]
        return torch.cat([g[2].detach() for g in graphs], dim=2)

    @staticmethod
    def backward(ctx, grad_out):
        # each gradient in its input's dtype (under autocast q, k, v and the output may differ)
        dq, dk, dv = (grad_out.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.inputs)
        for c, leaves, out in ctx.graphs:
            gq, gk, gv = torch.autograd.grad(out, leaves, grad_out[:, :, c.q_start : c.q_end].to(out.dtype))
            dq[:, :, c.q_start : c.q_end] = gq
            dk.index_add_(2, c.keys, gk.to(dk.dtype))
            dv.index_add_(2, c.keys, gv.to(dv.dtype))
        ctx.graphs = None
        return dq, dk, dv, None


_compiled_flex = None


def _flex(q, k, v, block_mask):
    global _compiled_flex
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and q.requires_grad:
            raise ValueError("flex attention has no backward on CPU; train with backend='chunked' there")
        if q.dtype == torch.float64:
            raise ValueError("flex attention on CPU supports float32/bfloat16/float16, not float64")
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
