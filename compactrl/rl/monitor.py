"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard and Weights & Biases when on.

A run opened at step ``start`` (a resume) first drops what was logged past it, in every sink that
can: lines of ``metrics.jsonl`` and TensorBoard events (``purge_step``), so the resumed steps are
not there twice. W&B keeps its own history; rows carry ``step`` as their x axis there.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LogSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: bool = Field(
        True,
        description="write run_dir/tensorboard when the tensorboard package is installed "
        "(pip install 'compactrl[monitor]'); a note says when it is not",
    )
    wandb: bool = Field(False, description="also log to Weights & Biases (pip install 'compactrl[wandb]')")
    wandb_project: str = Field("compactrl", description="W&B project")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline: write run_dir/wandb for a later `wandb sync`"
    )


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def check_log_settings(settings: LogSettings) -> None:
    """Refuse a sink the user asked for but cannot have, before any heavy work."""
    if settings.wandb and importlib.util.find_spec("wandb") is None:
        raise ImportError("log.wandb = true needs the wandb package: pip install 'compactrl[wandb]'")


def _kept_rows(path: Path, start: int) -> list[str]:
    """The lines of ``metrics.jsonl`` up to step ``start``; a line cut short by a crash is dropped."""
    kept = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            note(f"{path}:{n} is not JSON (a write cut short?); dropped")
            continue
        if row.get("step", 0) <= start:
            kept.append(line)
    return kept


class Monitor:
    """Log one row per step to every sink that is on."""

    def __init__(self, run_dir: Path, settings: LogSettings, start: int, config: dict) -> None:
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            self.path.write_text("".join(line + "\n" for line in _kept_rows(self.path, start)))
        self.tensorboard = self.wandb = None
        if settings.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                note("TensorBoard is off: pip install 'compactrl[monitor]' (metrics.jsonl has every step)")
            else:
                self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start + 1)
        if settings.wandb:
            import wandb

            id_file = run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
            self.wandb = wandb.init(
                project=settings.wandb_project, id=run_id, resume="allow", dir=str(run_dir),
                config=config, mode=settings.wandb_mode, name=run_dir.name,
            )  # fmt: skip
            self.wandb.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tensorboard is not None:
            for k, v in scalars.items():
                self.tensorboard.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(scalars)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
