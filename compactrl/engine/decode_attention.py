"""Decode attention of an engine step: one query token per session over its cache row, holes skipped.

torch's SDPA on CPU is a flash kernel built for blocks of queries; a decode step has one query
token per session (three query heads per KV head on SmolLM2) and spends its time in per-block
small GEMMs and the additive hole mask. The C kernel in ``decode_attention.c`` reads each row's K
and V once for all query heads of a KV head, skips evicted entries (they cost no bandwidth),
accumulates in float32 and writes into the step's output buffer. On SmolLM2's shapes it takes 1.5
to 2.7 times less time than SDPA in float32, 1.3 to 2.2 in bfloat16 (``docs/engine_speed.md``).

It is compiled on first use for this CPU (:mod:`~compactrl.engine.kernels`). ``attention =
"auto"`` uses it on a CPU where it builds and falls back to SDPA elsewhere; ``"kernel"`` refuses
to start without it; ``"sdpa"`` never uses it.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Literal

import torch

from compactrl.engine.kernels import compile_c, traced

AttentionMode = Literal["auto", "kernel", "sdpa"]
SOURCE = Path(__file__).with_name("decode_attention.c")
MAX_G, MAX_D = 16, 256  # the C kernel's fixed bounds on query heads per KV head and head size
DTYPES = (torch.float32, torch.bfloat16)
KERNEL_ERRORS = ("", "G or D past the kernel's bounds", "a row longer than longest or the cache")  # by code


@cache
def load_kernel() -> ctypes.CDLL | str:
    """The compiled kernel, or the reason there is none (no C compiler, a failed build)."""
    return build(SOURCE)


def build(source: Path) -> ctypes.CDLL | str:
    """``source`` (this kernel's C, possibly another revision of it) compiled and loaded."""
    P, I, I64, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    args = [P, I64, P, P, P, I64, P, P, P, I, I, I, I, I64, F, I, P, I64, I]
    return compile_c(source, {"decode_attention": (args, I)})


def unsupported(device: torch.device, dtype: torch.dtype, group: int, head_dim: int) -> str:
    """Why the kernel cannot run a model here ('' when it can): ``group`` query heads per KV head."""
    if device.type != "cpu":
        return f"the kernel runs on CPU, the model is on {device.type}"
    if dtype not in DTYPES:
        return f"the kernel reads float32 or bfloat16 caches, the model is {dtype}"
    if group > MAX_G or head_dim > MAX_D:
        return f"the kernel takes up to {MAX_G} query heads per KV head and head size {MAX_D}"
    lib = load_kernel()
    return lib if isinstance(lib, str) else ""


class DecodeAttention:
    """Runs decode attention with the kernel (``kind == "kernel"``) or leaves it to SDPA (``"sdpa"``).
    A subclass for another kernel names its own ``unsupported`` and ``load_kernel``."""

    unsupported = staticmethod(unsupported)
    load_kernel = staticmethod(load_kernel)

    def __init__(self, mode: AttentionMode, device, dtype: torch.dtype, group: int, head_dim: int):
        why = "" if mode == "sdpa" else self.unsupported(torch.device(device), dtype, group, head_dim)
        if mode == "kernel" and why:
            raise ValueError(f"attention = 'kernel' cannot run: {why}; set attention = 'auto' or 'sdpa'")
        self.kind = "sdpa" if mode == "sdpa" or why else "kernel"
        self.lib = self.load_kernel() if self.kind == "kernel" else None
        self.scratch = torch.empty(0)  # grown by __call__ to what a step needs, then kept

    @classmethod
    def of(cls, model, mode: AttentionMode = "auto") -> DecodeAttention:
        p, c = next(model.parameters()), model.config
        return cls(mode, p.device, p.dtype, c.num_attention_heads // c.num_key_value_heads, c.head_dim)

    def __call__(self, q, K, V, valid, rows, lens, longest: int, out) -> None:
        """``q [B, H, D]`` (heads contiguous) of one token per session over ``K, V [rows, Hkv, cap, D]``
        rows ``rows [B]``, entries ``[0, lens[b])`` where ``valid [rows, cap]``, into ``out [B, H, D]``;
        ``longest`` is ``max(lens)``, known to the caller without reading the tensor."""
        B, H, D = q.shape
        Hkv, G, threads = K.shape[1], H // K.shape[1], torch.get_num_threads()
        need = threads * G * longest
        if self.scratch.numel() < need:  # grows to the longest row seen, then stays
            self.scratch = torch.empty(need)
        assert q.stride(2) == 1 and q.stride(1) == D and K.is_contiguous() and V.is_contiguous()
        assert out.is_contiguous() and valid.is_contiguous() and q.dtype == K.dtype == V.dtype == out.dtype
        assert rows.is_contiguous() and lens.is_contiguous() and rows.dtype == lens.dtype == torch.int64
        args = (
            q.data_ptr(), q.stride(0), K.data_ptr(), V.data_ptr(), valid.data_ptr(), valid.shape[1],
            rows.data_ptr(), lens.data_ptr(), out.data_ptr(), B, Hkv, G, D, K.shape[2], D**-0.5,
            int(q.dtype == torch.bfloat16), self.scratch.data_ptr(), longest, threads,
        )  # fmt: skip
        err = traced("compactrl::decode_attention", self.lib.decode_attention, *args)
        assert err == 0, KERNEL_ERRORS[err]
