"""A training run's folder: one run per folder, and the config changes a resume may make.

``compactrl train`` into a folder that already holds something is refused unless the user says
``--resume`` (continue the run there) or ``--overwrite`` (delete it and start over), so two runs
never mix their metrics and checkpoints. A resumed run must use the config it was started with,
except for :data:`SAFE_ON_RESUME`, which do not change what steps already taken mean.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

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


def open_run_dir(run_dir: Path, cfg: BaseModel, resume: bool, overwrite: bool, keep: list[Path] = ()) -> None:
    """Check ``run_dir`` for a new run or a resume before any heavy work; with ``overwrite`` empty it.
    ``keep`` are paths the run reads (its model) that overwriting must not delete."""
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
    if not overwrite:
        held = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())[:5])
        raise RunDirError(
            f"{run_dir} already holds a run ({held}); continue it with --resume, delete it and start "
            f"over with --overwrite, or train into another folder (--set out=DIR)"
        )
    for k in keep:
        if Path(k).resolve().is_relative_to(run_dir.resolve()):
            raise RunDirError(f"--overwrite would delete {k}, which this run loads: move it out of {run_dir}")
    shutil.rmtree(run_dir)
