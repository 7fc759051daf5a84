"""`compactrl config`: a run config with every default resolved, and the field reference."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from compactrl.cli.common import PLAIN, SetOption, fail, out

app = typer.Typer(help="Run configs: one resolved with every default, the field reference.", **PLAIN)


@app.command("show")
def config_show_cmd(
    config: Annotated[
        Path | None, typer.Argument(help="TOML config (default: built-in defaults; needs --kind).")
    ] = None,
    overrides: SetOption = None,
    kind: Annotated[
        str | None, typer.Option(help="train | rollout (default: told from the file's fields).")
    ] = None,
) -> None:
    """Print a config as train / eval / rollout resolve it (with --set), every default filled in, as TOML."""
    from compactrl.config import ConfigError
    from compactrl.config_reference import show

    try:
        text = show(config, overrides or [], kind)
    except ConfigError as e:
        fail(str(e))
    print(text, end="")


@app.command("reference")
def config_reference_cmd(
    output: Annotated[
        Path | None, typer.Option("--out", help="Write the Markdown here (docs/config.md).")
    ] = None,
    check: Annotated[bool, typer.Option(help="Only check that --out is up to date (exit 1 if not).")] = False,
) -> None:
    """The reference of every config field (path, type, default, description) as Markdown."""
    from compactrl.config_reference import REGENERATE, reference

    text = reference()
    if output is None:
        if check:
            fail("--check needs --out FILE")
        print(text, end="")
    elif check:
        if not output.is_file() or output.read_text(encoding="utf-8") != text:
            fail(f"{output} is out of date; regenerate it: {REGENERATE}", code=1)
        out.print(f"{output} is up to date")
    else:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as e:
            fail(f"cannot write {output}: {e.strerror or e}")
        out.print(f"wrote {output}")
