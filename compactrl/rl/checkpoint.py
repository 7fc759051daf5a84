"""Training checkpoints that resume a run exactly: model, optimizer, RNG states, step, data position.

A checkpoint is a folder ``step_<N>`` holding the model as a Hugging Face folder
(``config.json`` + ``model.safetensors`` + the tokenizer files, loadable by compactrl and
transformers), the optimizer and any extra modules (the critic) as safetensors, and the scalars
and RNG states as JSON. It is written to a temporary folder and renamed into place, so a crash
mid-write never leaves a half checkpoint that ``latest`` would pick up.
"""

from __future__ import annotations

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

STATE = "trainer_state.json"


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
    py = random.getstate()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(st: dict) -> None:
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    np.random.set_state(("MT19937", np.array(st["numpy"], dtype=np.uint32), st["numpy_pos"], 0, 0.0))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))


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
    """Write ``run_dir/checkpoints/step_<step>`` atomically; keep the newest ``keep``. With
    ``tokenizer_dir`` its tokenizer files join the model, a folder any loader takes whole."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".partial-"))
    save_model(model, tmp / "model")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, tmp / "model")
    tensors, meta = _optimizer_tensors(optimizer)
    save_file(tensors, tmp / "optimizer.safetensors")
    for name, module in (modules or {}).items():
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
            tmp / f"{name}.safetensors",
        )
    payload = {
        "step": step,
        "state": state,
        "optimizer": meta,
        "rng": rng_state(),
        "modules": sorted(modules or {}),
    }
    (tmp / STATE).write_text(json.dumps(payload) + "\n")
    final = root / f"step_{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / STATE).is_file())
    return found[-1] if found else None


def load_checkpoint(path: str | Path, model, optimizer: torch.optim.Optimizer,
                    modules: dict[str, torch.nn.Module] | None = None) -> dict:  # fmt: skip
    """Restore weights, optimizer, extra modules and RNG states in place; returns step and state."""
    path = Path(path)
    if not (path / STATE).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {STATE}); resume from a step_* folder")
    payload = json.loads((path / STATE).read_text())
    if not has_lora(model):  # with adapters the base stays the run's initial model; they come as a module
        weights = load_file(path / "model" / "model.safetensors")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise ValueError(
                f"{path}: checkpoint weights do not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]}); resume with the run's own model"
            )
    _load_optimizer(optimizer, load_file(path / "optimizer.safetensors"), payload["optimizer"])
    for name, module in (modules or {}).items():
        module.load_state_dict(load_file(path / f"{name}.safetensors"))
    set_rng_state(payload["rng"])
    return {"step": payload["step"], "state": payload["state"]}
