"""What every command shares: the consoles, error exits, the progress bar, argument checks and
the JSON / report lines the benchmarks all print."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Plain help (no rich panels): typer's rich help prints every flag as `--json <bool>`.
PLAIN = {"no_args_is_help": True, "rich_markup_mode": None}

out = Console()
err = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="SECTION.FIELD=VALUE", help="Override a config field (repeatable)."),
]


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def stopped(message: str) -> None:
    """A run the user stopped (Ctrl-C): what happened and what to type next, exit 130, no ``error:``."""
    err.print(message, highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def command_line(command: str, config: Path | None, overrides: list[str] | None, *flags: str) -> str:
    """The command that runs this config again, every ``--set`` shown, quoted for a shell."""
    import shlex

    words = ["compactrl", command, *([str(config)] if config else [])]
    words += [w for o in overrides or [] for w in ("--set", o)]
    return shlex.join([*words, *flags])


@contextmanager
def progress_bar(label: str):
    """Yields ``progress(total) -> advance(info=None)`` for the library's long loops (stderr, tty
    only); ``info`` (e.g. the step's reward) is shown next to the bar until the next one."""
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=err, transient=True, disable=not sys.stderr.isatty()) as bar:

        def progress(total: int):
            task = bar.add_task(label, total=total, info="")
            return lambda info=None: bar.update(task, advance=1, **({"info": info} if info else {}))

        yield progress


def check_model_args(model_dir: Path | None, size: str) -> None:
    from compactrl.models.tiny import SIZES

    if size not in SIZES:
        fail(f"--size {size!r} is not one of {list(SIZES)}")
    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"--model {model_dir} has no config.json")


def check_device(device: str) -> None:
    import torch

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"--device {device!r} is not one of cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda but torch sees no CUDA device (is this a CPU build of torch?)")


def check_vllm_python(vllm_python: str | None) -> None:
    if vllm_python is not None and not Path(vllm_python).exists():
        fail(f"--vllm-python {vllm_python} does not exist")


def os_error(e: OSError) -> str:
    """One line for a file-system failure: the path and the cause, not a traceback."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e} (check the path's permissions and free space)"


def emit_json(data: dict, path: Path | None = None) -> None:
    text = json.dumps(data, indent=2)
    if path:
        path.write_text(text + "\n")
    print(text)


def load_run_config(model, path: Path | None, overrides: list[str] | None):
    """The config, or a one-line error; a config of another command's kind says which command runs it."""
    from compactrl.agent.batch import RolloutConfig
    from compactrl.config import ConfigError, load_config
    from compactrl.rl.config import TrainConfig

    try:
        return load_config(model, path, overrides or [])
    except ConfigError as e:
        for kind, other in {"rollout": RolloutConfig, "train": TrainConfig}.items():
            if other is not model and path is not None and _validates(other, path, overrides):
                fail(f"{path} is a {kind} config: run it with compactrl {kind}")
        fail(str(e))


def _validates(model, path: Path, overrides: list[str] | None) -> bool:
    from contextlib import redirect_stderr
    from io import StringIO

    from compactrl.config import ConfigError, load_config

    try:
        with redirect_stderr(StringIO()):  # its notes belong to a load that is not the one asked for
            load_config(model, path, overrides or [])
    except ConfigError:
        return False
    return True


def save_result(
    result: dict,
    output: Path | None,
    as_json: bool,
    plot: Callable[[dict, Path], Path] | None = None,
) -> bool:
    """A benchmark's result: its JSON to ``--out`` (and its figure beside it), then with ``--json``
    the JSON on stdout. True when it was printed, so that the caller prints nothing else."""
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")
        if plot:
            plot(result, output.with_suffix(".png"))
    if as_json:
        emit_json(result)
    return as_json


def model_label(model: dict, key: str = "source") -> str:
    return f"{model[key]} ({model['parameters']:,} params)"


def machine_line(result: dict, key: str = "source") -> str:
    """`cpu · N threads · model (P params)`, the line a benchmark's report opens with."""
    m = result["machine"]
    return f"{m['cpu']} · {m['threads']} threads · {model_label(result['model'], key)}"


def print_table(columns: list[str], rows: list[list[str]], title: str | None = None) -> None:
    """A bench's table (the same columns and cells its documentation renders as markdown)."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title)
    for c in columns:
        table.add_column(c, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    out.print(table)
