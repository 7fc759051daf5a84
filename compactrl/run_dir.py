"""A run's folder: one run per folder, and the config changes a resume may make.

``compactrl train`` or ``rollout`` into a folder that already holds a run is refused unless the user
says ``--resume`` (train: continue the run there) or ``--overwrite`` (delete it and start over), so
two runs never mix their metrics, traces and checkpoints; what a start that failed before its first
step left is no run, and the corrected command starts there. A resumed run must use the config it
was started with, except for :data:`SAFE_ON_RESUME`, which do not change what steps already taken mean.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

SAFE_ON_RESUME = {
    "steps": "more steps extend a run (not fewer than the checkpoint's)",
    "out": "the run folder may have been moved",
    "threads": "torch threads change speed, not the samples",
    "checkpoint_every": "how often checkpoints are written",
}


class RunDirError(ValueError):
    pass


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    flat: dict[str, Any] = {}
    for k, v in data.items():
        flat |= _flatten(v, f"{prefix}.{k}" if prefix else k)
    return flat


def config_changes(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """``(dotted field, saved value, new value)`` for each field that differs."""
    a, b = _flatten(saved), _flatten(new)
    missing = object()
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(a.keys() | b.keys())
            if a.get(k, missing) != b.get(k, missing)]  # fmt: skip


def _show(v: Any) -> str:
    return "(unset)" if not isinstance(v, (str, int, float, bool, list, dict, type(None))) else json.dumps(v)


# What a start writes before its first step: a folder holding only these (no step logged, no
# complete checkpoint) is what a start that failed left, and the corrected command may reuse it.
STARTED = {"config.json", "provenance.jsonl", "model", "reference", "metrics.jsonl", "tensorboard",
           "wandb_id", "checkpoints"}  # fmt: skip


def _progress(run_dir: Path) -> bool:
    """Whether the folder holds work: anything a start does not write, a logged step, or a checkpoint."""
    names = {p.name for p in run_dir.iterdir()}
    metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    return bool(
        names - STARTED
        or (metrics.is_file() and metrics.stat().st_size > 0)
        or (ckpts.is_dir() and any(ckpts.glob("step_*")))
    )


def saved_steps(run_dir: Path, default: int) -> int:
    """The ``steps`` the run in ``run_dir`` was started (or last extended) with; ``default`` if none."""
    try:
        return int(json.loads((run_dir / "config.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def open_run_dir(
    run_dir: Path,
    cfg: BaseModel,
    resume: bool,
    overwrite: bool,
    keep: list[Path] = (),
    command: Literal["train", "rollout"] = "train",
) -> None:
    """Check ``run_dir`` for a new run or a resume before any heavy work; with ``overwrite`` empty it,
    and likewise the leftovers of a start that never reached its first step (:data:`STARTED`).
    ``keep`` are paths the run reads (its model) that emptying the folder must not delete."""
    if resume and overwrite:
        raise RunDirError("--resume continues the run in the folder, --overwrite deletes it: pass one")
    used = run_dir.is_dir() and any(run_dir.iterdir())
    if resume:
        saved = run_dir / "config.json"
        if not saved.is_file():
            raise RunDirError(f"--resume: {run_dir} holds no run (no config.json); start it without --resume")
        try:
            old = json.loads(saved.read_text())
        except ValueError as e:
            raise RunDirError(f"--resume: {saved} is not valid JSON ({e}); restore it or start over") from e
        try:  # with the defaults filled in, so a field added since the run started is no change
            old = json.loads(type(cfg).model_validate(old).model_dump_json())
        except ValidationError:
            pass  # compared as saved: the fields that no longer validate show up as changes
        changed = [
            c for c in config_changes(old, json.loads(cfg.model_dump_json())) if c[0] not in SAFE_ON_RESUME
        ]
        if changed:
            lines = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in changed)
            raise RunDirError(
                f"--resume with a config that differs from {saved}: {lines}. A resume may change only "
                f"{', '.join(SAFE_ON_RESUME)}; use the run's own config, or start a new run (another out)"
            )
        return
    if not used:
        return
    if not overwrite and _progress(run_dir):
        held = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())[:5])
        again = "continue it with --resume, " if command == "train" else ""
        raise RunDirError(
            f"{run_dir} already holds a run ({held}); {again}delete it and start over with --overwrite, "
            f"or write into another folder (--set out=DIR)"
        )
    for k in keep:
        if Path(k).resolve().is_relative_to(run_dir.resolve()):
            what = "--overwrite" if overwrite else f"starting again in {run_dir}"
            raise RunDirError(f"{what} would delete {k}, which this run loads: move it out of {run_dir}")
    shutil.rmtree(run_dir)
