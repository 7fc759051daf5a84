"""Compiling the engine's C kernels: on first use, for this CPU, cached.

Each kernel is one C file beside this module, built with the system's C compiler for the CPU it
runs on (``-march=native``) and cached under ``~/.cache/compactrl/kernels`` (or
``$XDG_CACHE_HOME``), keyed by source, flags and CPU, so a machine builds it once (about a
second) and nothing is compiled at install. A missing compiler or an unwritable cache is returned
as a reason, and each caller falls back to torch's own ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

# Reordered float sums (vectorised dot products) without -ffast-math itself: a library linked with
# it carries crtfastmath.o, whose constructor flushes denormals to zero for the whole process.
FAST_SUMS = [
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-freciprocal-math",
]
FLAGS = ["-O3", "-march=native", *FAST_SUMS, "-fopenmp", "-fPIC", "-shared"]


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def compile_c(source: Path, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | str:
    """``source`` compiled (or found in the cache) and loaded with its functions' ctypes
    ``signatures`` (name: (argument types, return type)), or the reason it cannot be."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return "no C compiler on PATH (install gcc or clang)"
    src = source.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *FLAGS, _cpu_identity()]).encode()).hexdigest()[:16]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    so = home / "compactrl" / "kernels" / f"{source.stem}-{key}.so"
    if not so.exists():
        try:
            so.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=so.parent) as tmp:  # built aside, then moved: atomic
                out = Path(tmp) / so.name
                cmd = [cc, *FLAGS, str(source), "-o", str(out), "-lm"]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode:
                    return f"{cc} failed to build {source.name}: {r.stderr.strip()[-500:]}"
                os.replace(out, so)
        except OSError as e:
            return f"cannot write the kernel to {so.parent} ({e}); set XDG_CACHE_HOME to a writable folder"
    lib = ctypes.CDLL(str(so))
    for name, (args, result) in signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    return lib


def traced(name: str, fn, *args):
    """``fn(*args)``, shown as ``name`` in a torch.profiler trace (a range opened only while one runs:
    a ctypes call is otherwise invisible to it, and a range costs microseconds per call)."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)
