"""Attention of a step's prompt chunks: each chunk's queries over its own cache row, causal, holes
masked, every chunk of the step in one call.

torch's SDPA runs a fresh prompt's causal attention at about 50 GFLOP/s on one core of the CPUs
measured (float32 or bfloat16), a chunk appended to a row with holes slower still (an additive
mask, the math path). The C kernel in ``chunk_attention.c`` tiles the scores and the weighted
sum as a GEMM kernel does, with an online softmax in between; on SmolLM2's shapes it takes
several times less time (``docs/engine_speed.md``). Chunks reading a forked prefix (a chain of
segments) stay on the torch path.

Compiled on first use for this CPU (:mod:`~compactrl.engine.kernels`); the engine's ``attention``
mode governs it as it does the decode kernel: ``auto`` uses it where it builds, ``kernel``
refuses to start without it, ``sdpa`` never uses it.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from compactrl.engine.decode_attention import DTYPES, DecodeAttention
from compactrl.engine.kernels import compile_c, traced

SOURCE = Path(__file__).with_name("chunk_attention.c")
MAX_G, MAX_D = 16, 256  # the C kernel's fixed bounds on query heads per KV head and head size
KERNEL_ERRORS = ("", "G or D past the kernel's bounds", "a chunk past the cache", "a chunk past the scratch")
SCRATCH_FLOATS = 1 << 23  # 32 MB: a step's chunks share it in groups (each at least one chunk)


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "chunk_attention": ([_P, _I64, _P, _P, _P, _I64, _P, _I, _P, _I, _I, _I, _I64, _F, _I, _P, _I64, _I], _I),
    "scratch_floats": ([_P, _I, _I, _I], _I64),
    "vector_floats": ([], _I),
}


@cache
def load_kernel(source: Path = SOURCE) -> ctypes.CDLL | str:
    """The compiled kernel, or the reason there is none (no C compiler, a failed build).
    ``source``: another revision's file, for A/Bs against it (the same C signature)."""
    return compile_c(source, SIGNATURES)


def unsupported(device: torch.device, dtype: torch.dtype, group: int, head_dim: int) -> str:
    """Why the kernel cannot run a model here ('' when it can): ``group`` query heads per KV head."""
    if device.type != "cpu":
        return f"the kernel runs on CPU, the model is on {device.type}"
    if dtype not in DTYPES:
        return f"the kernel reads float32 or bfloat16 caches, the model is {dtype}"
    lib = load_kernel()
    if isinstance(lib, str):
        return lib
    step = lib.vector_floats()  # a head is read as whole vectors
    if group > MAX_G or head_dim > MAX_D or head_dim % step:
        return f"the kernel takes up to {MAX_G} query heads per KV head, head sizes of {step}k up to {MAX_D}"
    return ""


class ChunkAttention(DecodeAttention):
    """Runs chunk attention with the kernel (``kind == "kernel"``) or leaves it to SDPA (``"sdpa"``);
    chosen as the decode kernel is (:class:`DecodeAttention`), with this kernel's bounds."""

    unsupported = staticmethod(unsupported)
    load_kernel = staticmethod(load_kernel)

    def scratch_for(self, chunks: torch.Tensor, Hkv: int, D: int) -> tuple[int, int]:
        """The address and size in floats of scratch for a call on ``chunks`` (each one's keys packed
        and values as float32): up to ``SCRATCH_FLOATS`` for the step, which the kernel fills a
        group of chunks at a time, or one chunk's need if more (a long row); grown, then kept."""
        need = self.lib.scratch_floats(chunks.data_ptr(), chunks.shape[0], Hkv, D)
        one = max(self.lib.scratch_floats(c.data_ptr(), 1, Hkv, D) for c in chunks.split(1))
        size = max(one, min(need, SCRATCH_FLOATS))
        if self.scratch.numel() < size:
            self.scratch = torch.empty(size)
        return self.scratch.data_ptr(), self.scratch.numel()

    def __call__(self, q, K, V, valid, chunks, out) -> None:
        """``q [N, H, D]`` (heads contiguous) of a step's tokens; ``chunks [C, 4]`` int64 rows of
        (offset of the chunk's first token in ``q`` and ``out``, cache row, its first entry, tokens):
        each token attends to entries ``[0, its own]`` of its row where ``valid [rows, cap]``, in
        ``K, V [rows, Hkv, cap, D]``; the results go to ``out [N, H, D]``."""
        H, D = q.shape[1:]
        Hkv = K.shape[1]
        assert q.stride(2) == 1 and q.stride(1) == D and K.is_contiguous() and V.is_contiguous()
        assert out.is_contiguous() and valid.is_contiguous() and q.dtype == K.dtype == V.dtype == out.dtype
        assert chunks.is_contiguous() and chunks.dtype == torch.int64
        args = (
            q.data_ptr(), q.stride(0), K.data_ptr(), V.data_ptr(), valid.data_ptr(), valid.shape[1],
            chunks.data_ptr(), chunks.shape[0], out.data_ptr(), Hkv, H // Hkv, D, K.shape[2], D**-0.5,
            int(q.dtype == torch.bfloat16), *self.scratch_for(chunks, Hkv, D), torch.get_num_threads(),
        )  # fmt: skip
        err = traced("compactrl::chunk_attention", self.lib.chunk_attention, *args)
        assert err == 0, KERNEL_ERRORS[err]
