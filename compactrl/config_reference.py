"""What a config resolves to, and the reference of every config field.

* :func:`show` loads a config file exactly as ``train`` / ``rollout`` do (``--set`` overrides, variant
  switching) and prints it as TOML with every default filled in; the printed text loads back to an
  equal config.
* :func:`reference` is the Markdown of ``docs/config.md``: each field's dotted path, type, default and
  description, generated from the pydantic models (a test keeps the file in sync).

Two kinds of config exist: ``train`` (:class:`~compactrl.rl.config.TrainConfig`, for ``train`` and
``eval``) and ``rollout`` (:class:`~compactrl.agent.batch.RolloutConfig`)."""

from __future__ import annotations

import functools
import math
import operator
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import annotated_types
import pydantic

from compactrl.agent.batch import RolloutConfig
from compactrl.config import ConfigError, _variants, load_config, read_toml
from compactrl.rl.config import TrainConfig

KINDS: dict[str, type[pydantic.BaseModel]] = {"train": TrainConfig, "rollout": RolloutConfig}
USED_BY = {"train": "`compactrl train`, `compactrl eval`", "rollout": "`compactrl rollout`"}
REGENERATE = "compactrl config reference --out docs/config.md"


# ----------------------------------------------------------------------------- which kind of config


def detect_kind(path: str | Path, overrides: list[str] = ()) -> str:
    """``train`` or ``rollout``, told from the top-level fields the file (and ``--set``) sets that only
    one of the two configs has (a train config has ``steps``, a rollout config ``episodes``)."""
    p = Path(path)
    data = read_toml(p)
    keys = set(data) | {o.partition("=")[0].strip().split(".")[0] for o in overrides}
    train_f, rollout_f = set(TrainConfig.model_fields), set(RolloutConfig.model_fields)
    train_only, rollout_only = sorted(keys & (train_f - rollout_f)), sorted(keys & (rollout_f - train_f))
    if train_only and not rollout_only:
        return "train"
    if rollout_only and not train_only:
        return "rollout"
    if train_only:
        why = f"it sets train fields {train_only} and rollout fields {rollout_only}"
    else:
        why = "it sets only fields both kinds have (a train config sets e.g. steps, a rollout one episodes)"
    raise ConfigError(f"cannot tell whether {p} is a train or a rollout config: {why}; "
                      "pass --kind train or --kind rollout")  # fmt: skip


def resolve(path: str | Path | None, overrides: list[str] = (), kind: str | None = None):
    """``(kind, config)``: the config loaded through :func:`compactrl.config.load_config`."""
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"--kind {kind!r} is not one of {' | '.join(KINDS)}")
    if kind is None:
        if path is None:
            raise ConfigError("without a CONFIG file, pass --kind train or --kind rollout")
        kind = detect_kind(path, list(overrides))
    return kind, load_config(KINDS[kind], path, list(overrides))


# ----------------------------------------------------------------------------- TOML out

_BARE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _key(k: str) -> str:
    return k if k and set(k) <= _BARE else _string(k)


def _string(s: str) -> str:
    body = "".join(
        _ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in s
    )
    return f'"{body}"'


def toml_value(v: Any) -> str:
    """One TOML value (no None: TOML has no null)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_key(str(k))} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"{v!r} ({type(v).__name__}) has no TOML form")


def _table(m: pydantic.BaseModel, path: list[str], lines: list[str]) -> None:
    subtables = []
    if path:
        lines += ["", "[" + ".".join(_key(p) for p in path) + "]"]
    for name in sorted(type(m).model_fields, key=lambda n: n != "name"):  # a variant's name first
        v = getattr(m, name)
        if isinstance(v, pydantic.BaseModel):
            subtables.append((name, v))
        elif v is None:
            lines.append(f"# {_key(name)} = (unset)")
        else:
            lines.append(f"{_key(name)} = {toml_value(v)}")
    for name, v in subtables:
        _table(v, [*path, name], lines)


def to_toml(cfg: pydantic.BaseModel, header: str = "") -> str:
    """The config as a TOML document: every field, unset ones as ``# field = (unset)`` comments."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    _table(cfg, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def show(path: str | Path | None, overrides: list[str] = (), kind: str | None = None) -> str:
    kind, cfg = resolve(path, overrides, kind)
    src = str(path) if path is not None else "the built-in defaults"
    sets = "".join(f" --set {o}" for o in overrides)
    header = (f"{src}{sets}: a {kind} config ({USED_BY[kind].replace('`', '')}), every default filled in\n"
              "generated by `compactrl config show`; fields are described in docs/config.md")  # fmt: skip
    return to_toml(cfg, header)


# ----------------------------------------------------------------------------- the reference


@dataclass
class Row:
    type: str
    description: str
    defaults: dict[str, str] = field(default_factory=dict)  # kind -> rendered default


@dataclass
class Section:
    path: str  # dotted; "" is the top level
    doc: str = ""
    kinds: list[str] = field(default_factory=list)
    variant: str | None = None  # the value of `name` that selects it, for a variant of a union
    default_variant: dict[str, str] = field(default_factory=dict)  # on a union: kind -> default name
    rows: dict[str, Row] = field(default_factory=dict)


def _strip_optional(ann: Any) -> tuple[Any, bool]:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) < len(typing.get_args(ann)):
            return functools.reduce(operator.or_, args), True
    return ann, False


def _submodel(ann: Any) -> type[pydantic.BaseModel] | None:
    ann, _ = _strip_optional(ann)
    return ann if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel) else None


def _type_name(ann: Any) -> str:
    ann, optional = _strip_optional(ann)
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    origin, args, variants = typing.get_origin(ann), typing.get_args(ann), _variants(ann)
    if variants:
        name = "table: " + " \\| ".join(f"`{v}`" for v in variants)
    elif origin is typing.Literal:
        name = " \\| ".join(toml_value(a) for a in args)
    elif origin in (list, tuple) or ann in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        name = f"list[{_type_name(inner[0])}]" if inner else "list"
    elif origin is dict or ann is dict:
        name = "table"
    elif isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
        name = "table"
    elif isinstance(ann, type):
        name = ann.__name__
    else:
        name = str(ann).replace("typing.", "")
    return f"{name} (optional)" if optional else name


_REQUIRED = object()  # a field a variant must set (no default)
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _constraints(f: pydantic.fields.FieldInfo) -> str:
    out = []
    for m in f.metadata:
        for attr, op in _BOUNDS.items():
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                out.append(f"{op} {toml_value(getattr(m, attr))}")
        if isinstance(m, annotated_types.MinLen):
            out.append(f"at least {m.min_length} long")
    return ", ".join(out)


def _default_text(v: Any) -> str:
    if v is _REQUIRED:
        return "required"
    if v is None:
        return "unset"
    if isinstance(v, pydantic.BaseModel):
        return "set"
    return f"`{toml_value(v)}`".replace("|", "\\|")


def _doc(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    if not doc or doc == (pydantic.BaseModel.__doc__ or "").strip():
        return ""
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "`")


def _walk(cls, inst, path: str, kind: str, sections: dict[str, Section], key: str | None = None,
          variant: str | None = None) -> None:  # fmt: skip
    sec = sections.setdefault(key or path, Section(path, doc=_doc(cls), variant=variant))
    if kind not in sec.kinds:
        sec.kinds.append(kind)
    for name, f in cls.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        value = getattr(inst, name, _REQUIRED)
        variants = _variants(f.annotation)
        if variants:
            union = sections.setdefault(dotted, Section(dotted, doc=f.description or ""))
            union.kinds.append(kind)
            if value is None:  # an optional union, off by default: a row says so
                _row(sec, name, f, kind, None)
            union.default_variant[kind] = "unset" if value is None else value.name
            for vname, vcls in variants.items():
                vinst = value if type(value) is vcls else vcls.model_construct()
                _walk(vcls, vinst, dotted, kind, sections, key=f"{dotted}:{vname}", variant=vname)
            continue
        sub = _submodel(f.annotation)
        if sub is not None:
            if value is None:  # an optional section, off by default: a row says so
                _row(sec, name, f, kind, None)
                value = sub.model_construct()
            _walk(sub, value, dotted, kind, sections)
            continue
        _row(sec, name, f, kind, value)


def _row(sec: Section, name: str, f: pydantic.fields.FieldInfo, kind: str, value: Any) -> None:
    typ = _type_name(f.annotation)
    if bounds := _constraints(f):
        typ += f", {bounds}"
    desc = f.description or ""
    if name == "name" and sec.variant is not None:
        desc = desc or f"selects this variant: `{sec.path}.name = {toml_value(sec.variant)}`"
    row = sec.rows.setdefault(name, Row(typ, desc))
    row.defaults[kind] = _default_text(value)


def collect() -> dict[str, Section]:
    """Every section of both kinds of config, keyed by dotted path (``train:`` / ``rollout:`` for the
    two top levels, ``env:count`` for a variant)."""
    sections: dict[str, Section] = {}
    for kind, cls in KINDS.items():
        _walk(cls, cls(), "", kind, sections, key=f"{kind}:")
    return dict(sorted(sections.items(), key=lambda kv: not kv[0].endswith(":")))  # top levels first


def undescribed() -> list[str]:
    """Dotted paths of fields without a description (a test keeps this empty)."""
    return [f"{s.path}.{n}" if s.path else n
            for s in collect().values() for n, r in s.rows.items() if not r.description.strip()]  # fmt: skip


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _defaults(row: Row, kinds: list[str]) -> str:
    values = [row.defaults.get(k) for k in kinds]
    if len(set(values)) == 1:
        return values[0]
    return "; ".join(f"{k}: {row.defaults[k]}" for k in kinds if k in row.defaults)


def _table_md(sec: Section) -> list[str]:
    lines = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, row in sorted(sec.rows.items(), key=lambda kv: kv[0] != "name"):  # a variant's name first
        dotted = f"{sec.path}.{name}" if sec.path else name
        lines.append(f"| `{dotted}` | {row.type} | {_defaults(row, sec.kinds)} | {_cell(row.description)} |")
    return lines


def _kinds_text(kinds: list[str]) -> str:
    return " and ".join(f"{k} configs" for k in kinds) if len(kinds) < len(KINDS) else "both kinds"


def reference() -> str:
    """The Markdown of docs/config.md."""
    sections = collect()
    out = [
        "# Config reference",
        "",
        f"<!-- generated by `{REGENERATE}` from the pydantic models; edit the Field(description=...) "
        "in the source, not this file (tests/test_config_reference.py checks it is in sync) -->",
        "",
        "Runs are configured by TOML files; every field has a default, so a file sets only what it "
        "changes, and unknown fields are refused. There are two kinds of config:",
        "",
        *(f"- **{k}** (`{c.__name__}`, in `{c.__module__}`): {USED_BY[k]}" for k, c in KINDS.items()),
        "",
        "Any field can be overridden on the command line with `--set section.field=value` (repeatable; "
        "the value is a TOML literal, else a string; `--set evictor=` removes a section the file set). "
        "`env`, `strategy` and (in train configs) `objective` are each one of several "
        "variants, picked by their `name`; `--set strategy.name=summary` switches the variant and drops "
        "the old variant's fields the new one lacks. `compactrl config show CONFIG [--set ...]` prints "
        "a config as it resolves, with every default filled in. \"unset\" means the field is left out "
        "(TOML has no null). Where the two kinds of config default a field differently, both defaults "
        "are given.",
        "",
        "Contents: " + ", ".join(
            f"[{_title(s)}](#{_anchor(_title(s))})" for k, s in sections.items() if s.variant is None
        ),
        "",
    ]  # fmt: skip
    for key, sec in sections.items():
        if sec.variant is not None:
            continue
        title = _title(sec)
        out += [f"## {title}", ""]
        if key.endswith(":"):
            out += [f"The top-level fields of a {key[:-1]} config ({USED_BY[key[:-1]]}).", ""]
        elif sec.default_variant:
            names = [s.variant for s in sections.values() if s.path == sec.path and s.variant]
            if len(set(sec.default_variant.values())) == 1:
                defaults = _variant_text(next(iter(sec.default_variant.values())))
            else:
                defaults = "; ".join(f"{k} configs: {_variant_text(v)}"
                                     for k, v in sec.default_variant.items())  # fmt: skip
            out += [
                (sec.doc[0].upper() + sec.doc[1:].rstrip(".") + ". " if sec.doc else "")
                + f"One of {len(names)} variants, picked by `{sec.path}.name`: "
                + ", ".join(f"`{n}`" for n in names)
                + f" (default: {defaults}).",
                "",
            ]
            for v in sections.values():
                if v.path == sec.path and v.variant is not None:
                    out += [f"### `{sec.path}.name = {toml_value(v.variant)}`", ""]
                    if v.doc:
                        out += [v.doc, ""]
                    out += [*_table_md(v), ""]
            continue
        else:
            where = f" In {_kinds_text(sec.kinds)} only." if len(sec.kinds) < len(KINDS) else ""
            if sec.doc or where:
                out += [(sec.doc + where).strip(), ""]
        out += [*_table_md(sec), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _variant_text(name: str) -> str:
    return name if name == "unset" else f"`{name}`"


def _title(sec: Section) -> str:
    if not sec.path:
        return f"Top level: {sec.kinds[0]} configs"
    return f"[{sec.path}]"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as dashes."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
