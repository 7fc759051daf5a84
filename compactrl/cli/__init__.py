"""The one `compactrl` command. Subcommands parse and check their arguments, then call the library."""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer

from compactrl.cli import bench, config, models, run, serve, trace, verify
from compactrl.cli.common import PLAIN

app = typer.Typer(add_completion=False, help=__doc__, **PLAIN)


def _print_version(asked: bool) -> None:
    if asked:
        print(f"compactrl {version('compactrl')}")
        raise typer.Exit()


Version = Annotated[
    bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version, exit.")
]


@app.callback()
def _options(_: Version = False) -> None:
    pass


for name, command in (  # the order `compactrl --help` lists them in
    ("rollout", run.rollout_cmd),
    ("train", run.train_cmd),
    ("eval", run.eval_cmd),
    ("cost", run.cost_cmd),
    ("serve", serve.serve_cmd),
    ("init-model", models.init_model),
    ("import-gguf", models.import_gguf_cmd),
    ("plot", run.plot_cmd),
    ("study", run.study_cmd),
):
    app.command(name)(command)
for name, group in (
    ("trace", trace.app),
    ("verify", verify.app),
    ("bench", bench.app),
    ("config", config.app),
):
    app.add_typer(group, name=name)

__all__ = ["app"]
