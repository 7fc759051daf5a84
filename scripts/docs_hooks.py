"""MkDocs hooks (mkdocs.yml `hooks:`): pages generated at build time from the code, so they cannot
drift from it. `docs/cli_reference.md` gets every command's usage, arguments and options from the
`compactrl` typer app itself."""

import click
import typer.cli
from typer.main import get_command


def on_page_markdown(markdown: str, page, **_) -> str:
    if page.file.src_uri != "cli_reference.md":
        return markdown
    from compactrl.cli import app

    cmd = get_command(app)
    ctx = click.Context(cmd, info_name="compactrl")
    generated = typer.cli.get_docs_for_click(obj=cmd, ctx=ctx, name="compactrl", title="CLI reference")
    intro = "Every command, its arguments and options, generated from the `compactrl` command itself.\n\n"
    return generated.replace("# CLI reference\n\n", "# CLI reference\n\n" + intro, 1)
