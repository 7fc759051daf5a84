"""Which env an ``[env]`` table names, and how its settings are checked.

Envs are registered as entry points of the group ``compactrl.envs`` (``name = "pkg.module:EnvClass"``);
compactrl's own register there too (pyproject.toml), so an installed package's envs are picked by
``env.name`` exactly as the built-in ones are. An env not installed as a package is named by import
path: ``[env] import = "my_pkg.envs:VaultEnv"``. Either way the table's other fields are the class's
keyword arguments, checked before anything runs: by the class's own ``Config`` (a pydantic model), else
by its ``__init__`` signature's annotations.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import typing
import warnings
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationError, create_model, model_validator

from compactrl.envs.base import Env, EnvSettings

GROUP = "compactrl.envs"
BUILT_IN = ("agent", "browse", "count", "recall", "rooms", "textworld")


def load_class(path: str) -> Any:
    """``"pkg.module:Name"`` (importable) or ``"path/to/file.py:Name"`` -> the object; a ValueError
    that says what is wrong and how to write it."""
    module, _, attr = path.rpartition(":")
    if not module or not attr:
        raise ValueError(f"import path {path!r} is not 'package.module:Name' (or 'file.py:Name')")
    try:
        if module.endswith(".py"):
            obj = _load_file(Path(module).expanduser())
        else:
            obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {type(e).__name__}: {e}") from None
    return obj


def _load_file(path: Path):
    """A Python file as a module (once per file), so a config may name code that is not a package."""
    if not path.is_file():
        raise ImportError(f"{path} does not exist")
    name = f"compactrl_user_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


@cache  # one model per class: an import-path env's table is checked at every config load
def settings_model(cls: type, name: str | None) -> type[EnvSettings]:
    """The settings model of an env class: its ``Config``, else one read from its ``__init__``;
    with ``name``, its ``name`` field is that literal (the tag an ``[env]`` table picks it by)."""
    own = getattr(cls, "Config", None)
    picks = Field(name, description=f"selects {cls.__qualname__}")
    tag = {} if name is None else {"name": (Literal[name], picks)}
    if own is not None:
        if name is None or ("name" in own.model_fields and own.model_fields["name"].default == name):
            return own
        return create_model(f"{cls.__name__}Settings", __base__=own, **tag)
    hints = typing.get_type_hints(cls.__init__)
    fields: dict[str, Any] = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            default = ... if p.default is p.empty else p.default
            arg = Field(default, description=f"{cls.__name__}({p.name}=...)")
            fields[p.name] = (hints.get(p.name, Any), arg)
    return create_model(f"{cls.__name__}Settings", __base__=EnvSettings, **fields, **tag)


@cache
def registered() -> dict[str, type]:
    """name -> env class, from the ``compactrl.envs`` entry points. A third-party entry point that
    fails to load is skipped with a warning naming it; compactrl's own must load."""
    out = {}
    for ep in entry_points(group=GROUP):
        try:
            out[ep.name] = ep.load()
        except Exception as e:  # noqa: BLE001 - one broken plugin must not take every env down
            if ep.name in BUILT_IN:
                raise
            warnings.warn(
                f"env entry point {ep.name} = {ep.value!r} failed to load ({e}); skipped", stacklevel=1
            )
    missing = [n for n in BUILT_IN if n not in out]
    if missing:
        raise RuntimeError(
            f"compactrl's envs {missing} are not registered (entry points of {GROUP!r}); install the "
            "package so its metadata is current: pip install -e ."
        )
    return out


class ImportedEnv(EnvSettings):
    """``[env] import = "pkg.module:EnvClass"`` and the class's keyword arguments beside it."""

    model_config = EnvSettings.model_config | {
        "extra": "allow",
        "validate_by_name": True,
        "serialize_by_alias": True,
    }

    import_: str = Field(alias="import", description="the env class, as 'package.module:ClassName'")
    name: str = Field("", description="the env's name in results (default: the class's `name` attribute)")

    @model_validator(mode="after")
    def _check(self):
        cls = load_class(self.import_)
        given = dict(self.__pydantic_extra__ or {})
        try:
            checked = settings_model(cls, None).model_validate(given)
        except ValidationError as e:
            why = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ValueError(f"{self.import_}({', '.join(given)}): {why}") from None
        self.__pydantic_extra__.update(checked.model_dump(exclude={"name"}))
        if not self.name:
            object.__setattr__(self, "name", getattr(cls, "name", cls.__name__))
        return self

    def kwargs(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})


def _tag(v: Any) -> str | None:
    if isinstance(v, dict):
        return "import" if "import" in v or "import_" in v else v.get("name")
    return "import" if isinstance(v, ImportedEnv) else getattr(v, "name", None)


def env_config_type():
    """The ``[env]`` field's type: a union of every registered env's settings, picked by ``name``, and
    the import-path form."""
    members = [Annotated[settings_model(cls, n), Tag(n)] for n, cls in registered().items()]
    why = (f"the env is named by `name` (one of {', '.join(sorted(registered()))}, or an installed "
           f"package's '{GROUP}' entry point) or by `import = 'package.module:EnvClass'`")  # fmt: skip
    pick = Discriminator(_tag, custom_error_type="unknown_env", custom_error_message=why)
    return Annotated[Union[(*members, Annotated[ImportedEnv, Tag("import")])], pick]  # noqa: UP007


def make_env(cfg: EnvSettings) -> Env:
    if isinstance(cfg, ImportedEnv):
        return load_class(cfg.import_)(**cfg.kwargs())
    return registered()[cfg.name](**cfg.model_dump(exclude={"name"}))
