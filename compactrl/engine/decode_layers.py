"""All layers of a float32 or bfloat16 decode step in one C call (``decode_layers.c``).

A decode step of B single tokens runs each layer as ~25 small torch ops around its GEMMs and
attention; on a CPU each op costs microseconds of Python and dispatch whatever its size, about
0.4 to 0.9 ms a layer, a quarter to a third of a SmolLM2 step at batch 1 to 8. The C loop does
the same arithmetic (RMSNorm, q/k/v with bias, rotate-half RoPE, the cache writes, SwiGLU,
residual adds) and calls the engine's own GEMM and attention kernels, so it computes what the
torch path computes, up to float32 rounding order, and in bfloat16 rounds where the torch path
rounds (tested against it; ``verify engine`` gates it on real checkpoints).

It takes the steps the kernels cover: CPU, float32 (or bfloat16 where ``panel_gemm_bf16.c``
builds: a CPU with AVX512-BF16), every feed one decode token (no prefill
chunk in the step, no queries kept for a token evictor), any number of sessions, the attention kernel
in use, and a model of plain layers (no q/k-norm, no MLP or o-projection bias, no adapter
wrapped around a projection). Any other step runs the torch path, as before.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import nn

from compactrl.engine.chunk_attention import ChunkAttention
from compactrl.engine.decode_attention import KERNEL_ERRORS, DecodeAttention
from compactrl.engine.fused import FusedProjection
from compactrl.engine.kernels import compile_c, traced
from compactrl.engine.kv_cache import KVCache
from compactrl.engine.linear import Linears
from compactrl.models.decoder import CausalLM, RMSNorm

SLOTS = 10  # pointers per layer in the table, as decode_layers.c's enum orders them


@cache
def load_decode_layers() -> ctypes.CDLL | str:
    """The compiled loop, or the reason there is none (no C compiler, a failed build)."""
    P, I, I64, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    args = [P, I64, I64, I64, I64, I64, I64, I64, F, P, P, P, P, P, P, I64, P, I64, I64, P, P, I, P, P, P, I]
    args += [I64, P, I, P, P, I64]  # decode tokens, then the chunks: table, count, kernel, scratch, its size
    return compile_c(Path(__file__).with_name("decode_layers.c"), {"decode_layers": (args, I)})


def unsupported(model: CausalLM, linears: Linears, attention: DecodeAttention) -> str:
    """Why the one-call decode cannot run this engine's steps ('' when it can)."""
    p, c = next(model.parameters()), model.config
    if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 and bfloat16 models on a CPU, this one is {p.dtype} on {p.device.type}"
    if attention.kind != "kernel" or linears.gemv is None or panel_kernel(linears) is None:
        return "it needs the decode attention, gemv and panel GEMM kernels (they did not build here)"
    if not all(linears._width(p.dtype, n) for n in (c.hidden_size, c.intermediate_size)):
        return "the panel GEMM takes even layer widths in bfloat16"
    if c.qk_norm or c.head_dim % 2:
        return "q/k-norm models and odd head sizes run the torch path"
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.eps != norms[0].eps for n in norms):
            return "it takes RMSNorms with one eps"
        if a.o_proj.bias is not None or any(
            mm.bias is not None for mm in (m.gate_proj, m.up_proj, m.down_proj)
        ):
            return "it takes biases on q/k/v only"
    lib = load_decode_layers()
    return lib if isinstance(lib, str) else ""


def panel_kernel(linears: Linears):
    """The panel GEMM a step of 2+ sessions runs: ``panel_gemm.c`` or ``panel_gemm_bf16.c``."""
    return linears.panel_gemm or linears.panel_gemm_bf16


class DecodeLayers:
    """Runs a decode step's layers in one call where :func:`unsupported` allows (``why`` says why not)."""

    def __init__(
        self,
        model: CausalLM,
        linears: Linears,
        projections: list[FusedProjection],
        attention: DecodeAttention,
        chunks: ChunkAttention | None = None,
    ):
        self.model, self.linears, self.projections = model, linears, projections
        self.why = unsupported(model, linears, attention)
        self.fn = None if self.why else load_decode_layers().decode_layers
        kernels = () if self.why else (linears.gemv, panel_kernel(linears), attention.lib.decode_attention)
        self.kernels = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in kernels)  # C function pointers
        self.chunks = chunks if chunks is not None and chunks.kind == "kernel" else None  # prefill too
        attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
        norms = ("input_layernorm", "post_attention_layernorm")
        # where an adapter would go, as (a parent's submodule dict, name): nn.Module's getattr is slow
        self.slots = [(L.self_attn._modules, n) for L in model.model.layers for n in attn]
        self.slots += [(L.mlp._modules, n) for L in model.model.layers for n in mlp]
        self.slots += [(L._modules, n) for L in model.model.layers for n in norms]
        self.work, self.scratch = torch.empty(0), torch.empty(0)
        self._table: tuple[tuple, torch.Tensor] | None = None
        self.calls = 0  # steps run in one call
        self._modules: list[nn.Module] = []  # the layers' linear and norm modules, as applies() last saw them

    def applies(self, tokens: int, prefill: bool, keep_queries: bool) -> bool:
        """Whether a step of ``tokens`` (with prompt chunks over their own rows, ``prefill``; with
        queries kept for a token evictor) runs here."""
        # the product kernel this step needs, unless an A/B turned it off since
        product = self.linears.gemv if tokens == 1 else panel_kernel(self.linears)
        if self.fn is None or product is None or tokens < 1 or keep_queries:
            return False
        if prefill and self.chunks is None:
            return False
        self._modules = [d[n] for d, n in self.slots]  # as they are now: adapters come and go
        return all(type(m) in (nn.Linear, RMSNorm) for m in self._modules)

    def _weights(self, one_row: bool) -> list[list[torch.Tensor | None]]:
        """Per layer the tensors of decode_layers.c's table, K/V excepted (the modules' row-major
        weights for one row, the panel kernel's for more)."""
        out, dtype = [], next(self.model.parameters()).dtype
        for layer, proj in zip(self.model.model.layers, self.projections):
            a, m = layer.self_attn, layer.mlp
            qkv_w, qkv_b = proj.packed()
            if one_row:
                w = [qkv_w, a.o_proj.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
            else:
                panels = [
                    self.linears._stack(g, dtype)[0] for g in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,))
                ]
                panels += [self.linears._stack((m.gate_proj, m.up_proj), dtype, swiglu=True)[0], None]
                w = [*panels, self.linears._stack((m.down_proj,), dtype)[0]]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            out.append([*norms, w[0], qkv_b, w[1], w[2], w[3], w[4]])
        return out

    def table(self, one_row: bool, kv: KVCache) -> torch.Tensor:
        """The pointer table for this step, rebuilt when a weight or the cache moved or changed."""
        params = [t for m in self._modules for t in m._parameters.values() if t is not None]  # as applies saw
        key = (one_row, *((t.data_ptr(), t._version) for t in params), *(t.data_ptr() for t in kv.k + kv.v))
        if self._table is None or self._table[0] != key:
            ptrs = [
                [0 if t is None else t.data_ptr() for t in ts] + [kv.k[li].data_ptr(), kv.v[li].data_ptr()]
                for li, ts in enumerate(self._weights(one_row))
            ]
            self._table = key, torch.tensor(ptrs, dtype=torch.int64)
        return self._table[1]

    @torch.no_grad()
    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        rows,
        ents,
        lens,
        longest,
        chunks: torch.Tensor | None = None,
    ):
        """Every layer on ``x [B, d]`` (the model's dtype, in place; returned), token b written to cache
        ``rows[b]`` entry ``ents[b]``; ``cos, sin [B, D]``. The first ``len(lens)`` tokens are one
        decode token each, attending to entries ``[0, lens[b])`` (``longest`` the most); the rest
        prompt chunks, ``chunks [C, 4]`` as :class:`ChunkAttention` takes them."""
        c = self.model.config
        B, H, Hkv, D = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        threads = torch.get_num_threads()
        d, F, Q, bf16 = c.hidden_size, c.intermediate_size, (H + 2 * Hkv) * D, x.dtype == torch.bfloat16
        work = B * (2 * d + Q + H * D + 2 * F)  # decode_layers.c's work, in floats
        if bf16:  # the float32 residual stream and the 16-bit inputs of the kernels
            work += B * d + (B * (max(Q, d) + max(H * D, F, d)) + 1) // 2
        if self.work.numel() < work:
            self.work = torch.empty(work)
        if self.scratch.numel() < threads * (H // Hkv) * longest:  # grows to the longest row seen, then stays
            self.scratch = torch.empty(threads * (H // Hkv) * longest)
        table = self.table(B == 1, kv)
        n_dec, n_chunks = len(lens), 0 if chunks is None else chunks.shape[0]
        chunk_args = (0, 0, 0, 0)
        if n_chunks:
            kernel = ctypes.cast(self.chunks.lib.chunk_attention, ctypes.c_void_p).value
            chunk_args = (chunks.data_ptr(), kernel, *self.chunks.scratch_for(chunks, Hkv, D))
        eps = self.model.model.layers[0].input_layernorm.eps
        assert x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and kv.valid.is_contiguous()
        args = (
            x.data_ptr(), B, c.num_hidden_layers, c.hidden_size, H, Hkv, D, c.intermediate_size, eps,
            table.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows.data_ptr(), ents.data_ptr(),
            lens.data_ptr(), longest, kv.valid.data_ptr(), kv.valid.shape[1], kv.k[0].shape[2],
            self.work.data_ptr(), self.scratch.data_ptr(), threads, *self.kernels, int(bf16),
            n_dec, chunk_args[0], n_chunks, *chunk_args[1:],
        )  # fmt: skip
        err = traced("compactrl::decode_layers", self.fn, *args)
        self.calls += 1
        assert err == 0, KERNEL_ERRORS[err]
        return x
