"""The attention input projection of an engine step, fused: one GEMM for q, k and v, one q/k-norm
and one RoPE for q and k together. Bit-identical to :meth:`Attention.project` in float32 and
about a third cheaper at decode batch sizes on CPU, where a step is many small ops.

The layer's q/k/v (and q/k-norm) parameters are re-pointed to views of one packed buffer, so no
weight is stored twice and in-place updates (``Engine.update_weights``, an optimizer step on a
shared model) reach the fused GEMM. If a parameter is replaced instead (``.to()``, a new
``.data``), the pack is rebuilt on the next call; a wrapped projection (a LoRA adapter) is not
fused and goes through the module's own path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compactrl.engine.linear import Linears
from compactrl.models.decoder import Attention, rotate_half


def _pack(params: list[nn.Parameter], dim: int = 0) -> torch.Tensor:
    """Concatenate ``params`` into one buffer and make each parameter a view of its slice."""
    buf = torch.cat([p.data for p in params], dim)
    at = 0
    for p in params:
        n = p.shape[dim]
        p.data = buf.narrow(dim, at, n)
        at += n
    return buf


class FusedProjection:
    """``q, k, v`` token-major (``[N, heads, head_dim]``) with RoPE applied, for one layer."""

    def __init__(self, attn: Attention):
        self.attn = attn
        self._ptrs: tuple[int, ...] = ()
        if self.fusable:
            self._repack()

    @property
    def fusable(self) -> bool:
        """Plain linear projections; a wrapped one (a LoRA adapter injected later) runs unfused."""
        a = self.attn
        return type(a.q_proj) is nn.Linear and type(a.k_proj) is nn.Linear and type(a.v_proj) is nn.Linear

    def _params(self) -> list[nn.Parameter]:
        a = self.attn
        ps = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
        ps += [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias] if a.q_proj.bias is not None else []
        return ps + ([a.q_norm.weight, a.k_norm.weight] if a.qk_norm else [])

    @torch.inference_mode(False)  # may run inside the engine's step; the buffer must stay trainable
    def _repack(self) -> None:
        a = self.attn
        self.weight = _pack([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
        self.bias = _pack(biases) if biases[0] is not None else None
        if a.qk_norm:  # q-norm weight for the H query heads, k-norm weight for the Hkv key heads
            self.norms = torch.stack([a.q_norm.weight.data, a.k_norm.weight.data])
            a.q_norm.weight.data, a.k_norm.weight.data = self.norms[0], self.norms[1]
            self.head_norm = torch.tensor([0] * a.n_heads + [1] * a.n_kv, device=self.norms.device)
        self._ptrs = tuple(p.data_ptr() for p in self._params())

    def packed(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed q/k/v weight and bias, repacked first if a parameter was replaced since."""
        if tuple(p.data_ptr() for p in self._params()) != self._ptrs:
            self._repack()
        return self.weight, self.bias

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linears: Linears | None = None):
        """``x [N, d]``, ``cos, sin [N, head_dim]`` -> q ``[N, H, D]``, k and v ``[N, Hkv, D]``.
        ``linears`` picks the GEMM kernel for a low-precision model (see :mod:`compactrl.engine.linear`)."""
        a = self.attn
        if not self.fusable:
            q, k, v = a.project(x[None], cos[None], sin[None])
            return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
        weight, bias = self.packed()
        H, Hkv, D = a.n_heads, a.n_kv, a.head_dim
        if linears is None:
            qkv = F.linear(x, weight, bias)
        elif linears.stacks(a.q_proj, a.k_proj, a.v_proj, x=x):  # its own stacked copy, kept in step
            qkv = linears.stacked(x, a.q_proj, a.k_proj, a.v_proj)
        else:
            qkv = linears.packed(x, weight, bias)
        qkv = qkv.view(-1, H + 2 * Hkv, D)
        qk = qkv[:, : H + Hkv]
        if a.qk_norm:
            w = self.norms[self.head_norm]
            if qk.dtype == torch.float32:
                qk = F.rms_norm(qk, (D,), None, a.q_norm.eps) * w
            else:  # as RMSNorm does it: normalise in float32, round, then scale
                qk = w * F.rms_norm(qk.float(), (D,), None, a.q_norm.eps).to(qk.dtype)
        cos, sin = cos[:, None], sin[:, None]
        qk = qk * cos + rotate_half(qk) * sin
        return qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]
