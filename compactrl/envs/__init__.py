"""Environments: the protocol (base.py), the built-in envs, and the registry that names them
(``[env]`` in a run's TOML: ``name = ...`` or ``import = "pkg.module:EnvClass"``)."""

from compactrl.envs.base import HELD_OUT_SEED, Env, EnvError, EnvSettings, Reset, Step, guarded
from compactrl.envs.browse.env import BrowseConfig
from compactrl.envs.count import CountConfig
from compactrl.envs.recall import RecallConfig
from compactrl.envs.registry import ImportedEnv, env_config_type, make_env, registered
from compactrl.envs.rooms import RoomsConfig
from compactrl.envs.textworld_env import TextWorldConfig

EnvConfig = env_config_type()
ENV_FIELD = (
    "the environment: `name` picks a registered env (the built-in ones below, or an installed package's "
    "`compactrl.envs` entry point), or `import = 'package.module:EnvClass'` names a class by import "
    "path; the table's other fields are the env's keyword arguments (checked by its `Config` model, "
    "else by its `__init__` signature)"
)

__all__ = [
    "ENV_FIELD", "HELD_OUT_SEED", "BrowseConfig", "CountConfig", "Env", "EnvConfig", "EnvError",
    "EnvSettings", "ImportedEnv", "RecallConfig", "Reset", "RoomsConfig", "Step", "TextWorldConfig",
    "guarded", "make_env", "registered",
]  # fmt: skip
