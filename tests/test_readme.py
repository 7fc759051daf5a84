"""The README's Python snippets run, each on its own, in a fresh process (against a tiny model
written where the snippets expect it), and its Quickstart commands parse."""

import re
import shlex
import subprocess
import sys
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


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_each_python_snippet_runs_on_its_own(workdir, index):
    code = "import torch; torch.set_num_threads(1)\n" + SNIPPETS[index]
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
