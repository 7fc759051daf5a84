"""The linear layers of an engine step, and float32 logits for a low-precision model.

A bfloat16 (or float16) GEMM multiplies its inputs exactly, accumulates in float32 and rounds the
output once. CUDA and x86 CPUs with AVX512-BF16 or AMX (through oneDNN) do that in hardware.
An AVX2-only CPU (AMD Zen 3, older Xeons) has no such path: there torch's bfloat16
GEMM is *slower* than float32 from a few rows up (on SmolLM2-135M's shapes, one core of an AMD
EPYC: 1.6x at 8 rows, 5x at 32, 7x at 128). :class:`Linears` then runs the same math as a
float32 GEMM: it converts the weight to float32 a block of rows at a time into one reused buffer
(a low-precision value and the product of two are exact in float32) and rounds the output to
the model dtype. That reads the weights at half float32's bytes and computes at float32 speed,
so it beats the native kernel everywhere past one row and a float32 model up to ~32 rows
(memory-bound decode; equal beyond, where the GEMM dominates), needs no second copy of the
weights, and always reads the live parameters (in-place updates need no bookkeeping). A step
feeding a single token keeps the native kernel, faster for one row (a matrix-vector product).
Outputs are rounded where the native kernel rounds them (each projection; SiLU and the gate
product in the model dtype), so K/V and activations are what the model dtype gives, up to
float32 summation order.

Logits are float32 and, for a low-precision model, computed by a float32 head from the final
bfloat16 hidden state, as the trainer's :func:`~compactrl.models.decoder.token_logprobs` does:
bfloat16 logits carry ~3 significant digits (steps of 0.125 at a logit of 20), which would
perturb every sampled token's probability by several percent and, unless the trainer rounded
identically, show up as engine/trainer mismatch.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from compactrl.engine.kernels import compile_c, traced

MatmulMode = Literal["auto", "native", "float32", "onednn"]
LOW_PRECISION = (torch.bfloat16, torch.float16)


def has_native_low_precision_matmul(device: torch.device | str) -> bool:
    """Whether bfloat16 GEMMs run at least at float32 speed on ``device``: CUDA, or a CPU with
    bfloat16 dot products in hardware (AVX512-BF16 or AMX) and a oneDNN that uses them. Decided
    from the CPU's features, not by timing at start, so a run's kernels (and its bfloat16
    rounding) depend on the machine alone. Plain AVX512 emulates bfloat16 and is left out."""
    if torch.device(device).type != "cpu":
        return True
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False
    return onednn and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@cache
def load_gemv() -> ctypes.CDLL | str:
    """The one-row kernel (``gemv.c``), or the reason there is none (no C compiler, a failed build)."""
    P, I, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    return compile_c(Path(__file__).with_name("gemv.c"), {"gemv": ([P, P, P, I64, I64, I, I], None)})


@cache
def load_panel_gemm() -> ctypes.CDLL | str:
    """The float32 GEMM on packed panels (``panel_gemm.c``), or the reason there is none."""
    P, I, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    signatures = {"panel_gemm": ([P, P, P, I64, I64, I64, I, I], None), "panel_width": ([], I)}
    return compile_c(Path(__file__).with_name("panel_gemm.c"), signatures)


@cache
def load_panel_gemm_bf16() -> ctypes.CDLL | str:
    """The bfloat16 GEMM on packed panels (``panel_gemm_bf16.c``, AVX512-BF16), or the reason there
    is none (a CPU without bfloat16 dot products among them)."""
    P, I, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    signatures = {"panel_gemm_bf16": ([P, P, P, I64, I64, I64, I, I, I], None), "panel_width_bf16": ([], I)}
    return compile_c(Path(__file__).with_name("panel_gemm_bf16.c"), signatures)


def panels(weight: torch.Tensor, width: int, swiglu: bool = False) -> torch.Tensor:
    """``weight [N, K]`` as ``panel_gemm.c`` reads it: ``[ceil(N / width), K, width]``, zero-padded;
    bfloat16 as ``panel_gemm_bf16.c`` reads it, by pairs of k: ``[ceil(N / width), K / 2, width, 2]``.
    ``swiglu``: ``weight`` is gate and up stacked, each panel gets half a panel of each (the same
    features; each zero-padded to whole half panels), for the kernels' SiLU(gate) * up epilogue."""
    n, k = weight.shape
    if swiglu:
        half = width // 2
        gate_up = torch.stack([F.pad(w, (0, 0, 0, -(n // 2) % half)) for w in weight.chunk(2)])
        weight = gate_up.view(2, -1, half, k).transpose(0, 1).reshape(-1, k)
    w = F.pad(weight, (0, 0, 0, -weight.shape[0] % width))
    if weight.dtype == torch.bfloat16:
        return w.view(-1, width, k // 2, 2).transpose(1, 2).contiguous()
    return w.view(-1, width, k).transpose(1, 2).contiguous()


class Linears:
    """How an engine step runs linear layers (module docstring).

    ``mode``: ``native`` (the modules' own kernels), ``float32`` (float32 GEMMs on weights converted
    block by block), ``onednn`` (oneDNN GEMMs on weights reordered once into its blocked layout, as
    vLLM's CPU worker runs them: a CPU, float32 or native bfloat16; gate and up projections in one
    GEMM; a single float32 row left to the module's matrix-vector product, see :meth:`stacks`; the
    reordered copies take the weights' memory again and are redone when a weight changes),
    ``auto`` (``onednn`` on a CPU for float32, and for bfloat16 where the CPU has native bfloat16
    GEMMs; ``float32`` for steps of 2+ tokens on a CPU without them; else ``native``). Float64 and
    float16 models run natively; the head of a low-precision model always runs in float32.
    Under ``auto`` on a CPU, C kernels take the products: one row (decode at batch 1) by ``gemv.c``
    on the weights as they are (float32 or bfloat16), 2+ rows (decode batches, prefill chunks) by
    ``panel_gemm.c`` (float32) or ``panel_gemm_bf16.c`` (bfloat16 on a CPU with AVX512-BF16) on a
    packed copy in place of oneDNN's; a bfloat16 model's float32 head reads its bfloat16 weights
    there (no float32 copy). oneDNN keeps ``mode="onednn"`` and whatever the kernels do not take.
    """

    def __init__(self, model: nn.Module, mode: MatmulMode = "auto"):
        if mode not in ("auto", "native", "float32", "onednn"):
            raise ValueError(f"matmul mode {mode!r} is not one of auto, native, float32, onednn")
        p = next(model.parameters())
        self.low_precision = p.dtype in LOW_PRECISION
        native = has_native_low_precision_matmul(p.device)
        cpu_onednn = p.device.type == "cpu" and torch.backends.mkldnn.is_available()
        self.onednn = mode == "onednn" or (
            mode == "auto"
            and cpu_onednn
            and (p.dtype == torch.float32 or (p.dtype == torch.bfloat16 and native))
        )
        if self.onednn and not cpu_onednn:
            raise ValueError("matmul mode onednn runs on a CPU with oneDNN; use native on this device")
        if self.onednn and not (p.dtype == torch.float32 or (p.dtype == torch.bfloat16 and native)):
            raise ValueError(
                f"matmul mode onednn needs float32, or bfloat16 on a CPU with native bfloat16 GEMMs "
                f"(AVX512-BF16 or AMX); this model is {p.dtype}: use auto"
            )
        self._packs: dict[tuple[int, ...], tuple] = {}
        self.upcast = self.low_precision and (mode == "float32" or (mode == "auto" and not native))
        self.min_rows = 2 if mode == "auto" else 1  # auto: one row (a GEMV) stays native
        # float32 elements converted per block: ~4 MB stays in a CPU's cache; GPUs take big blocks
        self.block = 1 << 20 if p.device.type == "cpu" else 1 << 26
        self._buf: torch.Tensor | None = None
        # one row (decode at batch 1) through gemv.c: float32 and bfloat16 weights
        gemv = mode == "auto" and p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16)
        lib = load_gemv() if gemv else "not used"
        self.gemv = None if isinstance(lib, str) else lib.gemv
        # 2+ float32 rows (decode batches, prefill) through panel_gemm.c, on panels packed instead of
        # oneDNN's copy
        lib = load_panel_gemm() if mode == "auto" and self.onednn and p.dtype == torch.float32 else ""
        self.panel_gemm = None if isinstance(lib, str) else lib.panel_gemm
        self.panel_width = 0 if isinstance(lib, str) else lib.panel_width()
        # 2+ bfloat16 rows through panel_gemm_bf16.c where the CPU has bfloat16 dot products
        lib = load_panel_gemm_bf16() if mode == "auto" and self.onednn and p.dtype == torch.bfloat16 else ""
        self.panel_gemm_bf16 = None if isinstance(lib, str) else lib.panel_gemm_bf16
        self.panel_width_bf16 = 0 if isinstance(lib, str) else lib.panel_width_bf16()

    @property
    def kind(self) -> str:
        """What runs the GEMMs, for reports."""
        if self.panel_gemm is not None:
            kind = "panel_gemm (2+ rows)"
        elif self.panel_gemm_bf16 is not None:
            kind = "panel_gemm_bf16 (2+ rows)"
        elif self.onednn:
            kind = "onednn (prepacked)"
        elif not self.low_precision:
            kind = "native"
        else:
            kind = ("float32 (2+ rows)" if self.min_rows > 1 else "float32") if self.upcast else "native"
        return kind + (", gemv (1 row)" if self.gemv is not None else "")

    # ---- float32 GEMM of low-precision weights --------------------------------------------------
    def _buffer(self, n: int, device) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < n or self._buf.device != device:
            with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
                self._buf = torch.empty(n, dtype=torch.float32, device=device)
        return self._buf[:n]

    @torch.no_grad()
    def mm32(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` in float32 (``x [..., in]`` any dtype), the weight converted a block
        of rows at a time."""
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).float()
        n_out, n_in = weight.shape
        out = torch.empty(x.shape[0], n_out, dtype=torch.float32, device=x.device)
        rows = max(1, min(n_out, self.block // n_in))
        for s in range(0, n_out, rows):
            w = weight[s : s + rows]
            w32 = self._buffer(w.numel(), w.device).view(w.shape).copy_(w)
            torch.mm(x, w32.t(), out=out[:, s : s + rows])
        if bias is not None:
            out += bias
        return out.view(*lead, n_out)

    def _wants(self, m: nn.Module, x: torch.Tensor) -> bool:
        return self.upcast and type(m) is nn.Linear and x.numel() >= self.min_rows * x.shape[-1]

    # ---- one row --------------------------------------------------------------------------------
    def _one_row(self, x: torch.Tensor, *layers: nn.Module) -> bool:
        return (
            self.gemv is not None
            and x.numel() == x.shape[-1]
            and all(type(m) is nn.Linear and m.weight.is_contiguous() for m in layers)
        )

    def row(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` in float32 for one row ``x [..., in]`` (any dtype) and a contiguous
        float32 or bfloat16 ``weight``, by ``gemv.c``: each weight row streamed once, float32 sums.
        Kept to a few calls: on a decode step at batch 1 it runs 151 times."""
        n_out, n_in = weight.shape
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        out = x.new_empty((*x.shape[:-1], n_out))
        args = x.data_ptr(), weight.data_ptr(), out.data_ptr(), n_out, n_in, weight.dtype == torch.bfloat16
        traced("compactrl::gemv", self.gemv, *args, torch.get_num_threads())
        return out if bias is None else out.add_(bias)

    # ---- stacked GEMMs on packed weights ----------------------------------------------------
    def _width(self, dtype: torch.dtype, n_in: int) -> int:
        """The panel width of the C kernel that runs products of ``dtype`` inputs (0: oneDNN does)."""
        if dtype == torch.float32 and self.panel_gemm is not None:
            return self.panel_width
        if dtype == torch.bfloat16 and self.panel_gemm_bf16 is not None and n_in % 2 == 0:
            return self.panel_width_bf16
        return 0

    def fuses_swiglu(self, mlp: nn.Module, dtype: torch.dtype) -> bool:
        """Whether ``mlp``'s gate and up run as one panel GEMM on ``dtype`` inputs with SiLU(gate) * up
        computed in its epilogue: a panel kernel for ``dtype``, plain layers without bias."""
        gate, up = mlp.gate_proj, mlp.up_proj
        plain = type(gate) is type(up) is nn.Linear and gate.bias is None and up.bias is None
        return bool(self._width(dtype, gate.in_features)) and plain

    @torch.no_grad()
    def _stack(self, layers: tuple[nn.Linear, ...], dtype: torch.dtype, swiglu: bool = False):
        """``layers``' weights stacked and packed in ``dtype`` for the GEMM that runs them (a C
        kernel's panels where one runs ``dtype``, oneDNN's reordered copy otherwise) and their bias;
        redone when a weight changed since (an in-place update bumps its version; a replaced one
        has a new address). ``swiglu``: gate and up panels for the fused epilogue (see :func:`panels`)."""
        ws = [m.weight for m in layers]
        stamp = tuple((w.data_ptr(), w._version) for w in ws)
        width = self._width(dtype, ws[0].shape[1])
        key = (*(id(m) for m in layers), dtype, width, swiglu)
        hit = self._packs.get(key)
        if hit is None or hit[0] != stamp:
            with torch.inference_mode(False):  # kept across steps, in and out of inference mode
                w = torch.cat([w.detach().to(dtype) for w in ws])
                b = None if layers[0].bias is None else torch.cat([m.bias.detach().to(dtype) for m in layers])
                w = panels(w, width, swiglu) if width else torch.ops.mkldnn._reorder_linear_weight(w)
                hit = self._packs[key] = (stamp, w, b)
        return hit[1:]

    def prepare(self, model: nn.Module) -> None:
        """Under ``onednn``, pack every weight now (at engine start) rather than in the first step."""
        if not self.onednn:
            return
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            for group in (qkv, (a.o_proj,), (m.gate_proj, m.up_proj), (m.down_proj,)):
                if self.stacks(*group):
                    dtype = group[0].weight.dtype
                    self._stack(group, dtype, swiglu=m.gate_proj in group and self.fuses_swiglu(m, dtype))
        head = model.lm_head
        if self.stacks(head):
            self._stack((head,), self._operands(head.weight.dtype, head.in_features, torch.float32))

    def _operands(self, x_dtype: torch.dtype, n_in: int, dtype: torch.dtype) -> torch.dtype:
        """What a GEMM with output ``dtype`` multiplies in: bfloat16 inputs stay bfloat16 where
        ``panel_gemm_bf16.c`` runs (a bfloat16 model's float32 head too: the same products from half
        the weight bytes, no float32 copy), else ``dtype``."""
        return torch.bfloat16 if x_dtype == torch.bfloat16 and self._width(x_dtype, n_in) else dtype

    def stacks(self, *layers: nn.Module, x: torch.Tensor | None = None) -> bool:
        """Whether :meth:`stacked` runs ``layers`` (on ``x``) as one GEMM: ``onednn``, plain linear
        layers, and not a single row that ``gemv.c`` (or, for float32, torch's own matrix-vector
        product) reads at the memory's speed (on SmolLM2's layers, one core: 0.89x oneDNN's time)."""
        one_row = (
            x is not None
            and x.numel() == x.shape[-1]
            and (x.dtype == torch.float32 or (self.gemv is not None and x.dtype == torch.bfloat16))
        )
        return self.onednn and not one_row and all(type(m) is nn.Linear for m in layers)

    def stacked(self, x: torch.Tensor, *layers: nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The outputs of ``layers`` on ``x``, concatenated, in ``dtype`` (default ``x``'s), from one
        GEMM (see :meth:`stacks`)."""
        dtype = dtype or x.dtype
        operands = self._operands(x.dtype, x.shape[-1], dtype)
        w, b = self._stack(layers, operands)
        x2 = x.reshape(-1, x.shape[-1]).to(operands)
        if self._width(operands, x.shape[-1]):
            y = self.on_panels(x2, w, sum(m.out_features for m in layers), b, dtype)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")
        return y.view(*x.shape[:-1], -1)

    def on_panels(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        n_out: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """``x [M, in] @ weight.T + bias`` by ``panel_gemm.c`` (float32 ``x``) or ``panel_gemm_bf16.c``
        (bfloat16 ``x``) on the weight's ``panels``: float32 sums, the output in ``dtype``. A bias is
        added to the float32 sums before rounding, as a native bfloat16 GEMM adds it. ``swiglu``
        (no bias; ``dtype`` ``x``'s): gate and up panels in, SiLU(gate) * up ``[M, n_out / 2]`` out."""
        x, cols = x.contiguous(), n_out // 2 if swiglu else n_out
        if x.dtype == torch.float32:
            out = x.new_empty(x.shape[0], cols)
            args = x.data_ptr(), panels.data_ptr(), out.data_ptr(), x.shape[0], n_out, x.shape[1], int(swiglu)
            traced("compactrl::panel_gemm", self.panel_gemm, *args, torch.get_num_threads())
            return out if bias is None else out.add_(bias)
        rounded = dtype == torch.bfloat16 and bias is None  # else float32 sums, rounded after the bias
        out = x.new_empty(x.shape[0], cols, dtype=torch.bfloat16 if rounded else torch.float32)
        args = x.data_ptr(), panels.data_ptr(), out.data_ptr(), x.shape[0], n_out, x.shape[1]
        args += int(rounded), int(swiglu), torch.get_num_threads()
        traced("compactrl::panel_gemm_bf16", self.panel_gemm_bf16, *args)
        return out if bias is None else out.add_(bias).to(dtype)

    # ---- layers -------------------------------------------------------------------------------
    def linear(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._one_row(x, m):
            return self.row(x, m.weight, m.bias).to(x.dtype)
        if self.stacks(m, x=x):
            return self.stacked(x, m)
        if not self._wants(m, x):
            return m(x)
        return self.mm32(x, m.weight, m.bias).to(x.dtype)

    def packed(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x [N, in], weight, bias)`` for a packed weight (the fused q/k/v)."""
        if self._one_row(x):
            return self.row(x, weight, bias).to(x.dtype)
        if not (self.upcast and x.shape[0] >= self.min_rows):
            return F.linear(x, weight, bias)
        return self.mm32(x, weight, bias).to(x.dtype)

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU, each projection through :meth:`linear` (under ``onednn``, gate and up as one GEMM)."""
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        if self.stacks(gate, up, x=x):
            if self.fuses_swiglu(mlp, self._operands(x.dtype, x.shape[-1], x.dtype)):
                w, _ = self._stack((gate, up), x.dtype, swiglu=True)
                rows = x.reshape(-1, x.shape[-1])
                act = self.on_panels(rows, w, 2 * gate.out_features, None, x.dtype, swiglu=True)
                return self.linear(down, act.view(*x.shape[:-1], -1))
            g, u = self.stacked(x, gate, up).chunk(2, dim=-1)
            return self.linear(down, F.silu(g) * u)
        if not (self._wants(down, x) or self._one_row(x, gate, up, down)):
            return mlp(x)
        return self.linear(down, F.silu(self.linear(gate, x)) * self.linear(up, x))

    def logits(self, lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[..., vocab]`` of final-norm ``hidden [..., d]``; a low-precision model's head
        runs in float32 (as :func:`~compactrl.models.decoder.token_logprobs`)."""
        head = lm.lm_head
        if self._one_row(hidden, head):
            return self.row(hidden, head.weight, head.bias)
        if self.stacks(head):  # a low-precision head: float32 products, see _head_weights
            return self.stacked(hidden, head, dtype=torch.float32)
        if not (self.low_precision and type(head) is nn.Linear):
            return head(hidden).float()
        return self.mm32(hidden, head.weight, head.bias)
