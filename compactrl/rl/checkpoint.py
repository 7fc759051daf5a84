"""Training checkpoints that resume a run exactly: model, optimizer, RNG states, step, data position.

A checkpoint is a folder ``step_<N>`` holding the model as a Hugging Face folder
(``config.json`` + ``model.safetensors`` + the tokenizer files, loadable by compactrl and
transformers), the optimizer and any extra modules (the critic) as safetensors, the scalars and
RNG states as JSON, and last ``manifest.json``: every file's size and SHA-256. It is written to a
``.partial-*`` folder and renamed into place, and a checkpoint counts only when its manifest
matches its files, so a truncated or half-written one is told apart, named, and skipped in favour
of the newest complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from compactrl.models.loading import copy_tokenizer_files, save_model
from compactrl.models.lora import has_lora
from compactrl.rl.monitor import note

STATE = "trainer_state.json"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, naming the file and what is wrong with it."""


class CheckpointWriteError(OSError):
    """The file system refused a checkpoint (read-only, full, ...); the partial write was removed."""


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for name, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{name}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    for key, v in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_state() -> dict:
    """Python's, NumPy's and torch's RNG states; and each GPU's once this process has used CUDA
    (before that no CUDA random number was drawn, and asking would start CUDA on every GPU)."""
    py = random.getstate()
    st = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict) -> None:
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    np.random.set_state(("MT19937", np.array(st["numpy"], dtype=np.uint32), st["numpy_pos"], 0, 0.0))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    cuda = st.get("cuda")
    if not cuda:
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == len(cuda):
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in cuda])
    else:
        note(f"the checkpoint holds the RNG states of {len(cuda)} GPU(s), this process sees {gpus}: not "
             "restored, so sampling on the GPU will not repeat the uninterrupted run's")  # fmt: skip


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1) + "\n")


def check_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first file that is missing, truncated or changed."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        if (path / STATE).is_file():
            raise CheckpointError(
                f"{manifest} is missing: the checkpoint was not finished or predates manifests"
            )
        raise CheckpointError(
            f"{path} is not a checkpoint (no {MANIFEST}); point at a checkpoints/step_* folder"
        )
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest} is unreadable ({e})") from e
    for name, want in entries.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(
                f"{f} has {f.stat().st_size} bytes, the manifest says {want['bytes']} (truncated?)"
            )
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{f} does not match its SHA-256 in the manifest (corrupted)")


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model,
    optimizer: torch.optim.Optimizer,
    state: dict,
    modules: dict[str, torch.nn.Module] | None = None,
    keep: int = 2,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step_<step>`` atomically; keep the newest ``keep`` complete ones.
    With ``tokenizer_dir`` its tokenizer files join the model, a folder any loader takes whole.
    A file-system failure removes the partial folder and raises :class:`CheckpointWriteError`."""
    root = Path(run_dir) / "checkpoints"
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".partial-"))
        save_model(model, tmp / "model")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp / "model")
        tensors, meta = _optimizer_tensors(optimizer)
        save_file(tensors, tmp / "optimizer.safetensors")
        for name, module in (modules or {}).items():
            weights = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
            save_file(weights, tmp / f"{name}.safetensors", metadata=getattr(module, "metadata", None))
        payload = {
            "step": step,
            "state": state,
            "optimizer": meta,
            "rng": rng_state(),
            "modules": sorted(modules or {}),
        }
        (tmp / STATE).write_text(json.dumps(payload) + "\n")
        _write_manifest(tmp)  # last: a folder without it is not a checkpoint
        final = root / f"step_{step:08d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        where = e.filename or root
        raise CheckpointWriteError(f"cannot write checkpoint {where}: {e.strerror or e}") from e
    complete = [p for p in checkpoints(run_dir) if (p / MANIFEST).is_file()]
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The ``step_*`` folders of a run, oldest first (complete or not)."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if p.is_dir())


def latest_checkpoint(run_dir: str | Path, skipped: list[str] | None = None) -> Path | None:
    """The newest checkpoint whose files match its manifest; each newer one that does not is
    appended to ``skipped`` with the reason, so the caller can say what it fell back from."""
    for path in reversed(checkpoints(run_dir)):
        try:
            check_checkpoint(path)
            return path
        except CheckpointError as e:
            if skipped is not None:
                skipped.append(str(e))
    return None


def resolve_checkpoint(path: str | Path, skipped: list[str] | None = None) -> Path:
    """A checkpoint folder as given, or the newest complete one of a run folder (or its
    ``checkpoints/``); anything else is a :class:`CheckpointError` that says what to pass."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (path / STATE).is_file():
        check_checkpoint(path)
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    if (run_dir / "checkpoints").is_dir():
        found = latest_checkpoint(run_dir, skipped)
        if found is None:
            raise CheckpointError(f"{run_dir / 'checkpoints'} holds no complete checkpoint")
        return found
    raise CheckpointError(
        f"{path} is neither a checkpoint (a checkpoints/step_* folder) nor a run folder with checkpoints/"
    )


def remove_partial_writes(run_dir: str | Path) -> list[Path]:
    """Delete ``.partial-*`` folders a killed process left behind; returns them."""
    found = sorted((Path(run_dir) / "checkpoints").glob(".partial-*"))
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def load_checkpoint(
    path: str | Path,
    model,
    optimizer: torch.optim.Optimizer,
    modules: dict[str, torch.nn.Module] | None = None,
    checked: bool = False,
) -> dict:
    """Restore weights, optimizer, extra modules and RNG states in place; returns step and state.
    The checkpoint is checked against its manifest first (unless ``checked``: the caller just did,
    e.g. :func:`latest_checkpoint`); a bad file is named."""
    path = Path(path)
    if not checked:
        check_checkpoint(path)
    try:
        payload = json.loads((path / STATE).read_text())
    except ValueError as e:
        raise CheckpointError(f"{path / STATE} is not valid JSON ({e})") from e
    if not has_lora(model):  # with adapters the base stays the run's initial model; they come as a module
        weights = load_file(path / "model" / "model.safetensors")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise CheckpointError(
                f"{path}: checkpoint weights do not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]}); resume with the run's own model"
            )
    _load_optimizer(optimizer, load_file(path / "optimizer.safetensors"), payload["optimizer"])
    for name, module in (modules or {}).items():
        f = path / f"{name}.safetensors"
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint was written without {name!r}")
        module.load_state_dict(load_file(f))
    set_rng_state(payload["rng"])
    return {"step": payload["step"], "state": payload["state"]}
