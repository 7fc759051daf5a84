"""Typed run configs: TOML files plus ``--set a.b=c`` overrides, validated before any work starts.

Errors name the field and what it accepts; unknown fields are refused (a typo never silently
falls back to a default)."""

from __future__ import annotations

import difflib
import math
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import pydantic

M = TypeVar("M", bound=pydantic.BaseModel)


class ConfigError(ValueError):
    pass


def _parse_value(text: str) -> Any:
    """A TOML literal (``3``, ``true``, ``"x"``, ``[1, 2]``), else the raw string. TOML's ``inf`` and
    ``nan`` stay text: a string field keeps the word, and pydantic reads it as the number for a
    float field (an int field then names the problem)."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return text if isinstance(value, float) and not math.isfinite(value) else value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``--set a.b=c`` into the config's data; ``--set section=`` (empty) removes a section the file
    set, back to its default (an optional one such as ``[evictor]``: off)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} must look like section.field=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is a value, not a section")
        if not value.strip() and isinstance(node.get(leaf), dict):  # `--set evictor=`: drop the section
            del node[leaf]
            continue
        node[leaf] = _parse_value(value.strip())
    return data


def _default_names(model: type[pydantic.BaseModel], data: dict) -> dict:
    """A section that picks a variant by ``name`` (env, strategy) and was given fields without a
    name keeps the default variant, so ``--set env.n_rooms=6`` works on the defaults."""
    for key, field in model.model_fields.items():
        default = field.default
        if isinstance(data.get(key), dict) and isinstance(default, pydantic.BaseModel):
            named = "name" in data[key] or "import" in data[key]  # an env by import path names none
            if "name" in type(default).model_fields and not named:
                data[key] = {"name": default.name, **data[key]}
            _default_names(type(default), data[key])
    return data


def _variants(annotation: Any) -> dict[str, type[pydantic.BaseModel]]:
    """``name -> model`` of a field that is a union of variants picked by ``name`` (env, strategy, an
    optional evictor)."""
    out = {}
    for m in typing.get_args(annotation):
        if typing.get_origin(m) in (typing.Annotated, typing.Union, types.UnionType):
            out |= _variants(m)
        elif isinstance(m, type) and issubclass(m, pydantic.BaseModel) and "name" in m.model_fields:
            if m.model_fields["name"].default:  # (an env by import path is no named variant)
                out[m.model_fields["name"].default] = m
    return out


def _models_at(model: type[pydantic.BaseModel], loc: list[str]) -> list[type[pydantic.BaseModel]]:
    """The section model(s) at an error's location (a variant's tag in it picks that variant)."""
    found = [model]
    for part in loc:
        inner = []
        for m in found:
            if part in m.model_fields:
                ann = m.model_fields[part].annotation
                inner += list(_variants(ann).values()) or [
                    t
                    for t in (ann, *typing.get_args(ann))
                    if isinstance(t, type) and issubclass(t, pydantic.BaseModel)
                ]
        tagged = [m for m in found if "name" in m.model_fields and m.model_fields["name"].default == part]
        found = inner or tagged or found
    return found


def _did_you_mean(model: type[pydantic.BaseModel], loc: list[str]) -> str:
    """``; did you mean 'x'?`` for an unknown field a known one at that place is close to."""
    known = {f for m in _models_at(model, loc[:-1]) for f in m.model_fields}
    close = difflib.get_close_matches(loc[-1], sorted(known), n=1, cutoff=0.6) if loc else []
    return f"; did you mean {close[0]!r}?" if close else ""


def _switch_variants(model: type[pydantic.BaseModel], data: dict, overrides: list[str]) -> list[str]:
    """``--set strategy.name=X`` on a config that set another strategy's fields: drop the fields X
    does not have (they belonged to the old variant) and say which. Returns the notes."""
    notes = []
    for item in overrides:
        key, _, _ = item.partition("=")
        section, _, leaf = key.strip().partition(".")
        if leaf != "name" or section not in model.model_fields or not isinstance(data.get(section), dict):
            continue
        new = _variants(model.model_fields[section].annotation).get(data[section]["name"])
        if new is None:
            continue
        given = {k.strip().partition(".")[2] for k, _, _ in (o.partition("=") for o in overrides)
                 if k.strip().startswith(f"{section}.")}  # fmt: skip
        dropped = sorted(k for k in data[section] if k not in new.model_fields and k not in given)
        for k in dropped:
            del data[section][k]
        if dropped:
            notes.append(f"{section}.name={data[section]['name']}: dropped {section} field(s) {dropped} "
                         "of the variant the config had")  # fmt: skip
    return notes


def made_by(path: str | Path, configs: Path = Path("configs")) -> str | None:
    """The command that makes ``path``: the config under ``configs`` whose run folder (``out``, the
    deepest that holds it) it lies in, so that a missing model names the run to start first."""
    found = []
    for cfg in sorted(configs.rglob("*.toml")):
        try:
            data = tomllib.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            continue
        out = data.get("out")
        if isinstance(out, str) and Path(path) != Path(out) and Path(path).is_relative_to(out):
            found.append((len(Path(out).parts), "study" if "run" in data else "train", cfg.as_posix()))
    return f"compactrl {max(found)[1]} {max(found)[2]}" if found else None


def read_toml(path: str | Path) -> dict:
    """A config file's TOML; a missing file or bad TOML is a ConfigError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p} is not valid TOML: {e}") from e


def load_config(model: type[M], path: str | Path | None, overrides: list[str] = ()) -> M:
    data = read_toml(path) if path is not None else {}
    data = _default_names(model, apply_overrides(data, list(overrides)))
    for note in _switch_variants(model, data, list(overrides)):
        print(f"note: {note}", file=sys.stderr)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        given = {o.partition("=")[0].strip(): o for o in overrides}
        lines = []
        for err in e.errors():
            loc = [str(x) for x in err["loc"]]
            where = ".".join(loc) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            shown = "input" in err and not isinstance(err["input"], dict)  # not a whole section
            line = f"  {where}: {msg}" + (f" (got {err['input']!r})" if shown else "")

            # the --set that put the bad value there (pydantic adds the variant's name to the path)
            source = next((o for k, o in given.items() if k and _covers(k.split("."), loc)), None)
            hint = _did_you_mean(model, loc) if err["type"] == "extra_forbidden" else ""
            lines.append(line + (f", from --set {source}" if source else "") + hint)
        src = f"{path}" if path else "the built-in defaults"
        with_sets = " with" + "".join(f" --set {o}" for o in overrides) if overrides else ""
        raise ConfigError(f"{src}{with_sets} is invalid:\n" + "\n".join(lines)) from e


def _covers(key: list[str], loc: list[str]) -> bool:
    """Whether error location ``loc`` lies under override ``key`` (``loc`` may hold a variant tag)."""
    rest = iter(loc)
    return all(any(part == x for x in rest) for part in key)
