"""Tokenizer: a thin wrapper over the `tokenizers` library that reads a Hugging Face tokenizer folder.

transformers is deliberately not used at runtime; it only serves as the test oracle. Everything the
chat template and generation loop need (special ids, chat template rendering) is reproduced here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

_HINT = "run `compactrl init-model DIR` or point at a Hugging Face model folder"


def _read_json(path: Path) -> Any:
    """Parse an optional JSON file; None if it is absent, ValueError naming the file if it is broken."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or delete it, or {_HINT}") from e


def _token_str(value: Any, field: str, path: Path) -> str | None:
    """tokenizer_config stores special tokens either as a string or as an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, str):
        return value
    raise ValueError(f"{path}: {field} must be a string or {{'content': ...}}, got {value!r}")


def _pick_template(value: Any, path: Path) -> str | None:
    """chat_template may be one string or a list of named templates, of which we use 'default'."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{path}: chat_template lists {sorted(map(str, named))} but no 'default' template")
    raise ValueError(f"{path}: chat_template must be a string, got {type(value).__name__}")


def _eos_ids_from_generation_config(value: Any, path: Path) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return ids


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers: plain json.dumps, without jinja's HTML escaping.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template with the same environment transformers uses, so renders match byte for byte."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Fail early with a readable message instead of deep inside a jinja template."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one {'role': ..., 'content': ...} message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}"
            )
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"a {type(m[key]).__name__}"
                raise ValueError(f"messages[{i}]['{key}'] must be a str, but it is {got}")
    return [dict(m) for m in messages]


class Tokenizer:
    """Text <-> token ids, special ids and chat rendering for one model."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tok = backend
        self._bos_token, self._eos_token, self._pad_token = bos_token, eos_token, pad_token
        self._bos_id = self._id_of(bos_token, "bos_token")
        self._pad_id = self._id_of(pad_token, "pad_token")
        eos = [self._id_of(eos_token, "eos_token")] if eos_token is not None else []
        for i in extra_eos_ids:
            if i not in eos:
                eos.append(i)
        self._eos_ids: list[int] = eos
        self._chat_template = chat_template
        added = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._special_ids = added | set(eos) | {i for i in (self._bos_id, self._pad_id) if i is not None}

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{field} {token!r} is not in the tokenizer vocabulary")
        return i

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json plus optional tokenizer_config / chat_template / generation_config files."""
        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"tokenizer folder {root} does not exist; {_HINT}")
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise ValueError(
                f"{tok_path} is missing (only fast tokenizers with a tokenizer.json are supported); {_HINT}"
            )
        try:
            backend = _Backend.from_str(tok_path.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{tok_path} could not be loaded ({e}); re-create it, or {_HINT}") from e

        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json(cfg_path) or {}
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{cfg_path} must contain a JSON object")
        template = _pick_template(cfg.get("chat_template"), cfg_path)
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():  # transformers 5 saves the template here; it wins over the config copy
            template = jinja_path.read_text(encoding="utf-8")

        gen_path = root / "generation_config.json"
        gen = _read_json(gen_path) or {}
        if not isinstance(gen, Mapping):
            raise ValueError(f"{gen_path} must contain a JSON object")
        try:
            return cls(
                backend,
                bos_token=_token_str(cfg.get("bos_token"), "bos_token", cfg_path),
                eos_token=_token_str(cfg.get("eos_token"), "eos_token", cfg_path),
                pad_token=_token_str(cfg.get("pad_token"), "pad_token", cfg_path),
                extra_eos_ids=_eos_ids_from_generation_config(gen.get("eos_token_id"), gen_path),
                chat_template=template,
            )
        except ValueError as e:
            raise ValueError(f"{root}: {e}") from e

    # --- encoding -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single ids, none are added."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. As in transformers, ids with no token (padded embedding rows) decode to ""."""
        if hasattr(ids, "tolist"):  # tensors / numpy arrays
            ids = ids.tolist()
        try:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"decode expects a sequence of non-negative ints ({e})") from e

    def token_text(self, token_id: int) -> str:
        """Readable text of a single token (byte-level tokens show as text, partial UTF-8 as U+FFFD)."""
        if not isinstance(token_id, int) or token_id < 0 or self._tok.id_to_token(token_id) is None:
            raise ValueError(
                f"{token_id!r} is not a token id of this tokenizer (vocab_size={self.vocab_size})"
            )
        return self._tok.decode([token_id], skip_special_tokens=False)

    # --- special tokens -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_id

    @property
    def special_ids(self) -> set[int]:
        return set(self._special_ids)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # --- chat -----------------------------------------------------------------------------------

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """Render messages with the jinja chat template exactly as transformers' apply_chat_template does."""
        if self._chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template.jinja and no "
                "chat_template in tokenizer_config.json); add one to the model folder"
            )
        msgs = _check_messages(messages)
        # transformers passes its special-token strings, omitting unset ones (None would render as "None").
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name, value in (
            ("bos_token", self._bos_token),
            ("eos_token", self._eos_token),
            ("pad_token", self._pad_token),
        ):
            if value is not None:
                variables[name] = value
        variables.update(kwargs)
        return _compile_template(self._chat_template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **variables
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat (same ids as transformers with tokenize=True)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs))
