"""What a result was made with: the weights it read (hashed), the package versions, the commit,
the thread count and the CPU. Two runs of one config that disagree can then be told apart: the
same hashes and versions point at the computation, a different hash at an earlier stage."""

from __future__ import annotations

import hashlib
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "numpy", "tokenizers", "safetensors", "jinja2", "bm25s", "transformers", "peft", "gguf")


def weights_hash(folder: str | Path) -> str | None:
    """sha256 (first 16 hex digits) over a folder's ``*.safetensors`` in name order; None without any."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:  # about a second for SmolLM2's 540 MB
        with open(f, "rb") as fh:
            h.update(f.name.encode() + hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        here = Path(__file__).parent
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """The vector and matrix units torch's CPU kernels (and oneDNN's) can use here: what decides
    whether bfloat16 GEMMs run natively (AVX512-BF16, AMX) or emulated."""
    checks = {
        "avx2": "_is_avx2_supported",
        "avx512": "_is_avx512_supported",
        "avx512_vnni": "_is_vnni_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx": "_is_amx_tile_supported",
    }
    return [name for name, fn in checks.items() if getattr(torch.cpu, fn, lambda: False)()]


def provenance_line(p: dict) -> str:
    """A provenance record in one line: weights, commit, torch, threads, CPU."""
    weights = ", ".join(f"{k} {v}" for k, v in p["weights"].items())
    commit = f"{(p['commit'] or 'no git')[:12]}{' (dirty)' if p['dirty'] else ''}"
    torch_v = p["versions"].get("torch", "?")
    return f"weights {weights} · commit {commit} · torch {torch_v} · threads {p['threads']} · {p['cpu']}"


def provenance(weights: dict[str, str | Path | None]) -> dict:
    """``weights``: a name for each folder the result read (model, adapters) -> its folder."""
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "weights": {k: weights_hash(v) for k, v in weights.items() if v},
        "versions": versions | {"python": platform.python_version()},
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if dirty is None else bool(dirty),  # tracked files changed since the commit
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels torch dispatches to
        "cpu_features": cpu_features(),
    }
