"""The README's and the guides' Python snippets run, each on its own, in a fresh process (against a
tiny model written where the snippets expect it); every command of the Quickstart and Getting
started parses against the CLI, its config and `--set` overrides included; the site builds with
`mkdocs build --strict` (a broken link or a missing page fails)."""

import json
import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from compactrl.cli import app
from compactrl.models.tiny import write_tiny_model

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
GETTING_STARTED = (ROOT / "docs" / "getting_started.md").read_text()
PAGES = [README, GETTING_STARTED, (ROOT / "docs" / "serving.md").read_text()]
SNIPPETS = [code for page in PAGES for code in re.findall(r"```python\n(.*?)```", page, re.S)]


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    write_tiny_model(d / "runs" / "tiny", family="qwen3", size="tiny", seed=0)
    return d


@contextmanager
def server_if_asked(snippet: str, workdir: Path):
    """A snippet that talks to `compactrl serve` at 127.0.0.1:8000 gets one (the tiny model)."""
    if "127.0.0.1:8000" not in snippet:
        yield
        return
    import threading

    import uvicorn

    from compactrl.engine import Engine
    from compactrl.serve.app import create_app
    from compactrl.serve.server import Server

    server = Server(Engine.from_pretrained(workdir / "runs" / "tiny"), model_name="tiny")
    srv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=8000, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive(), "the README's server did not start (is port 8000 taken?)"
        time.sleep(0.01)
    try:
        yield
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_each_python_snippet_runs_on_its_own(workdir, index):
    code = "import torch; torch.set_num_threads(1)\n" + SNIPPETS[index]
    with server_if_asked(SNIPPETS[index], workdir):
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300
        )
    assert run.returncode == 0, f"README snippet {index} failed:\n{SNIPPETS[index]}\n{run.stderr[-2000:]}"


def bash_commands(page: str) -> list[str]:
    """The `compactrl ...` lines of a page's bash blocks, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    lines = [line for b in blocks for line in b.splitlines() if line.startswith("compactrl ")]
    return [line.split("  #")[0].strip() for line in lines]


def parse(line: str) -> None:
    """Parse a command line as `compactrl` would (options, types, arguments) without running it, and
    load its config with its --set overrides as the command would: a wrong option, a missing config
    file or a bad --set fails here."""
    import typer

    from compactrl.agent.batch import RolloutConfig
    from compactrl.config import ConfigError, load_config
    from compactrl.rl.config import TrainConfig

    cmd, args = typer.main.get_command(app), shlex.split(line)[1:]
    ctx = cmd.make_context("compactrl", args)
    while hasattr(cmd, "resolve_command"):  # a group keeps its command's name apart from the rest
        name, cmd, rest = cmd.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        ctx = cmd.make_context(name, rest, parent=ctx)
    kind = {"rollout": RolloutConfig, "train": TrainConfig, "eval": TrainConfig}.get(ctx.info_name)
    if kind is None:
        return
    try:
        load_config(kind, ctx.params["config"], ctx.params["overrides"] or [])
    except ConfigError as e:  # a model an earlier command of the page makes is no parse error
        problems = [line.strip() for line in str(e).splitlines()[1:]]
        made_earlier = ("model.path:", "strategy.thread_adapter:")
        if not problems or not all(p.startswith(made_earlier) for p in problems):
            raise


def test_quickstart_and_getting_started_commands_parse_against_the_cli():
    lines = bash_commands(README.split("## Quickstart", 1)[1]) + bash_commands(GETTING_STARTED)
    assert len(lines) >= 20
    for line in lines:
        parse(line)


@pytest.mark.parametrize(
    "line, error",
    [("compactrl rollout nonexistent.toml --set x.y=1", "does not exist"),
     ("compactrl train configs/quickstart.toml --set train.lrr=1", "did you mean"),
     ("compactrl train configs/quickstart.toml --no-such-flag", "No such option"),
     ("compactrl verify enigne", "No such command")],
)  # fmt: skip
def test_a_broken_command_fails_to_parse(line, error):
    with pytest.raises(Exception, match=error):
        parse(line)


def test_the_site_builds_strict(tmp_path):
    """mkdocs.yml's site, broken links and pages missing from the nav included, as CI builds it."""
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "cli_reference" / "index.html").read_text().count("compactrl train") >= 2


def test_every_result_table_is_what_its_json_renders(tmp_path):
    """A page's marked tables equal their JSON's rendering; a number edited by hand is caught."""
    from compactrl.docs_tables import BLOCK, sync

    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if BLOCK.search(p.read_text())]
    assert len(pages) >= 2
    for page in pages:
        assert sync(page, ROOT) == [], f"{page.name}: run python scripts/docs_tables.py"
    edited = tmp_path / "page.md"
    text = (ROOT / "docs" / "sidequest_replicate.md").read_text()
    edited.write_text(text.replace("| a-full | 0.23", "| a-full | 0.25", 1))
    assert len(sync(edited, ROOT)) == 1  # the four-hop block, not the two-hop one
    sync(edited, ROOT, write=True)
    assert edited.read_text() == text


def test_every_study_result_is_rendered_on_a_page():
    """Each `compactrl study` result under docs/ is read by some page's table, so a study's page
    cannot quote numbers its JSON does not hold; a table naming a row its JSON lacks is refused."""
    from compactrl.docs_tables import BLOCK, render

    specs = [m.group(2) for p in (ROOT / "docs").glob("*.md") for m in BLOCK.finditer(p.read_text())]
    rendered = {a for spec in specs for a in spec.split()[1:]}
    studies = [p for p in (ROOT / "docs").glob("*.json") if "study" in json.loads(p.read_text())]
    assert len(studies) >= 4
    assert [p.name for p in studies if f"docs/{p.name}" not in rendered] == []
    with pytest.raises(ValueError, match="has no rows"):
        render("memory docs/bench_sidequest_hops4_replicate.json rows=hops4-policy-full,no-such-row", ROOT)


def test_the_site_home_shows_the_readmes_results():
    """docs/index.md repeats the README's results table (links relative to docs/): one set of numbers."""
    results = README[README.index("## Results") : README.index("## Where to go next")]
    results = results.replace("](docs/", "](")
    home = (ROOT / "docs" / "index.md").read_text()
    assert results.strip() in home and "## Results" in results
