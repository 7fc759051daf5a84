"""The README's Python snippets run, each on its own, in a fresh process (against a tiny model
written where the snippets expect it), and its Quickstart commands parse."""

import re
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compactrl.cli import app
from compactrl.models.tiny import write_tiny_model

README = (Path(__file__).parent.parent / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


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


def test_quickstart_commands_name_real_commands_and_options():
    """Every `compactrl ...` line of the Quickstart block parses (``--help`` appended: no work)."""
    block = README.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("compactrl ")]
    assert len(lines) >= 10
    for line in lines:
        args = shlex.split(line)[1:]
        result = CliRunner().invoke(app, [*args, "--help"])
        assert result.exit_code == 0, f"{line}: {result.output}"
