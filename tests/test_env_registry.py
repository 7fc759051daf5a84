"""Your own environment: a class named by import path, or an installed package's entry point, runs
through rollout and train as the built-in envs do; its settings are checked before anything runs."""

import json
import os
import subprocess
import sys

import pytest
from pydantic import TypeAdapter

from compactrl.agent.batch import RolloutConfig, rollout
from compactrl.config import ConfigError, load_config
from compactrl.envs import CountConfig, EnvConfig, ImportedEnv, make_env, registered
from compactrl.rl.loop import TrainConfig, train

VAULT = '''
"""A user's env: remember a code, say it back."""
import random

from pydantic import BaseModel, Field, field_validator

from compactrl.envs import Reset, Step


class VaultEnv:
    name = "vault"

    def __init__(self, digits: int = 3, turns: int = 2):
        self.digits, self.turns = digits, turns

    def reset(self, seed: int) -> Reset:
        self.code, self.t = str(random.Random(seed).randrange(10**self.digits)), 0
        return Reset(task=f"Remember the code {self.code}, then say it.", max_tokens=4)

    def step(self, action: str) -> Step:
        self.t += 1
        return Step("Again.", float(self.code in action), self.t >= self.turns)

    def close(self) -> None:
        pass


class CheckedSettings(BaseModel):
    model_config = {"extra": "forbid"}
    digits: int = Field(3, ge=1, le=6)

    @field_validator("digits")
    @classmethod
    def _odd(cls, v):
        if v % 2 == 0:
            raise ValueError("digits must be odd")
        return v


class CheckedVault(VaultEnv):
    Config = CheckedSettings

    def __init__(self, digits: int = 3):
        super().__init__(digits, turns=1)
'''


@pytest.fixture
def vault(tmp_path, monkeypatch):
    """A package ``vaultpkg`` on sys.path, as a user's own code would be; with an installed
    distribution's metadata that registers ``vault`` as a ``compactrl.envs`` entry point."""
    (tmp_path / "vaultpkg").mkdir()
    (tmp_path / "vaultpkg" / "__init__.py").write_text(VAULT)
    info = tmp_path / "vaultpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vaultpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[compactrl.envs]\nvault = vaultpkg:VaultEnv\nbroken = vaultpkg:NoSuchEnv\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_an_env_class_by_import_path_runs_through_rollout_and_train(vault, tmp_path):
    sets = ["env.import=vaultpkg:VaultEnv", "env.digits=2", "threads=1"]
    cfg = load_config(RolloutConfig, None, [*sets, f"out={tmp_path / 'r'}", "episodes=3", "concurrency=3"])
    assert isinstance(cfg.env, ImportedEnv) and cfg.env.kwargs() == {"digits": 2, "turns": 2}
    summary = rollout(cfg)
    assert summary["episodes"] == 3 and summary["errors"] == 0 and summary["mean_turns"] == 2
    rows = [json.loads(x) for x in (tmp_path / "r" / "episodes.jsonl").read_text().splitlines()]
    assert {r["env"] for r in rows} == {"vault"}
    again = TypeAdapter(EnvConfig).validate_python(cfg.env.model_dump())  # as a run folder's config holds it
    assert again == cfg.env and cfg.env.model_dump()["import"] == "vaultpkg:VaultEnv"
    short = ["env=", *sets, f"out={tmp_path / 't'}", "steps=1", "prompts=2", "group_size=2"]
    tcfg = load_config(TrainConfig, "configs/quickstart.toml", short)
    assert train(tcfg)["step"] == 1


def test_an_env_class_by_entry_point_is_picked_by_name_like_the_built_in_ones(vault, tmp_path):
    """In a fresh process (entry points are read once): ``env.name = "vault"`` from the installed
    metadata; a third-party entry point that does not load is skipped with a warning naming it."""
    run = tmp_path / "r"
    env = os.environ | {"PYTHONPATH": f"{vault}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    sets = ["env.name=vault", "env.turns=3", f"out={run}", "episodes=2", "threads=1"]
    cmd = [sys.executable, "-m", "compactrl.cli", "rollout", *(x for s in sets for x in ("--set", s))]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "broken = 'vaultpkg:NoSuchEnv' failed to load" in p.stderr
    rows = [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    assert [r["turns"] for r in rows] == [3, 3] and {r["env"] for r in rows} == {"vault"}
    assert {"browse", "count", "recall", "rooms", "textworld"} <= set(registered())  # the same registry


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"name": "nope"}, "agent, browse, count, recall, rooms, textworld"),
        ({"import": "vaultpkg:NoSuchEnv"}, "cannot import 'vaultpkg:NoSuchEnv'"),
        ({"import": "vaultpkg.VaultEnv"}, "is not 'package.module:Name'"),
        ({"import": "vaultpkg:VaultEnv", "digitz": 2}, "vaultpkg:VaultEnv(digitz): digitz: Extra inputs"),
        ({"import": "vaultpkg:VaultEnv", "digits": "two"}, "digits: Input should be a valid integer"),
        ({"import": "vaultpkg:CheckedVault", "digits": 4}, "digits: Value error, digits must be odd"),
        ({"import": "vaultpkg:CheckedVault", "turns": 4}, "turns: Extra inputs are not permitted"),
    ],
)
def test_bad_env_settings_name_the_class_and_the_field_before_anything_runs(vault, tmp_path, env, says):
    (tmp_path / "c.toml").write_text("[env]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in env.items()))
    with pytest.raises(ConfigError) as e:
        load_config(RolloutConfig, tmp_path / "c.toml")
    assert says in str(e.value), str(e.value)


def test_an_env_with_its_own_settings_model_gets_them_checked_and_made(vault):
    cfg = TypeAdapter(EnvConfig).validate_python({"import": "vaultpkg:CheckedVault", "digits": 5})
    env = make_env(cfg)
    assert (env.digits, env.turns) == (5, 1) and cfg.name == "vault"


def test_the_built_in_envs_are_entry_points_of_the_installed_package():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="compactrl.envs")}
    assert (
        eps["count"] == "compactrl.envs.count:CountEnv" and eps["browse"] == "compactrl.envs.browse:BrowseEnv"
    )
    assert registered()["count"].Config is CountConfig  # its settings model: the [env] table of name "count"
