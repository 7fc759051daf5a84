"""Train a tiny byte-level BPE tokenizer offline, so tests and toy models need no Hub download.

The corpus is built from docstrings of pure-Python stdlib modules plus generated lines, with every
ordering fixed, so the same Python version always produces a byte-identical tokenizer.json.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _Backend

from compactrl.models.tokenizer import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 32768
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)

# ChatML as in Qwen2.5, without tools and without an implicit default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Llama 3's format (as in Llama 3.1 without tools or a date header): bos, then header/content/eot.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
CHAT_FORMATS = ("chatml", "llama3")

# Qwen2's split pattern: digits one at a time, which helps tiny models with arithmetic.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Pure-Python modules only: C-accelerated or platform-dependent ones (os, selectors, decimal, datetime)
# could give different docstrings on different machines.
_DOC_MODULES = (
    "abc",
    "argparse",
    "ast",
    "base64",
    "calendar",
    "colorsys",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "difflib",
    "email.message",
    "enum",
    "fnmatch",
    "fractions",
    "graphlib",
    "html",
    "html.parser",
    "ipaddress",
    "json",
    "json.decoder",
    "json.encoder",
    "logging",
    "numbers",
    "pprint",
    "queue",
    "random",
    "sched",
    "shlex",
    "statistics",
    "string",
    "tarfile",
    "textwrap",
    "tokenize",
    "urllib.parse",
    "uuid",
    "zipfile",
)

_FRUITS = ("apple", "banana", "cherry", "grape", "mango")
_NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin")
_ROLES = ("system", "user", "assistant", "tool")


def _docstrings() -> Iterator[str]:
    """Docstrings parsed from the modules' source files (not imported objects, which other
    libraries may have patched), in file order."""
    for name in _DOC_MODULES:
        source = Path(inspect.getsourcefile(importlib.import_module(name))).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield ast.get_docstring(node) or ""


def _synthetic_lines() -> Iterator[str]:
    """Arithmetic, fruit counting, chat turns and a bit of code and JSON, generated without randomness."""
    for i in range(600):
        a, b = (i * 37) % 101, (i * 53 + 7) % 97
        f1, f2 = _FRUITS[i % 5], _FRUITS[(i // 5) % 5]
        who = _NAMES[(i // 3) % 5]
        role = _ROLES[i % 4]
        yield f"{who} has {a} {f1}s and {b} {f2}s, so {who} has {a + b} pieces of fruit in total."
        yield f"What is {a} + {b}? The answer is {a + b}. What is {a} * {b}? The answer is {a * b}."
        yield f"{role}\nPlease count the {f1}s in the basket. There are {a} {f1}s and {i % 13} left over."
        yield f"assistant\nSure! I counted {a} {f1}s, {b} {f2}s and {i} grapes. Is there anything else?"
        yield f"user\nThanks, {who}. Can you summarize what we discussed so far? Step {i} of {i + a}."
        yield f'{{"name": "{f1}", "count": {a}, "price": {b}.{i % 100:02d}, "ok": {str(i % 2 == 0).lower()}}}'
        yield f"def count_{f1}(basket):\n    return sum(1 for x in basket if x == '{f1}')  # {i}"
        yield f"-{a}.{b} {i * 1009 % 100000} {i:04d} 0x{i * 31:04x} {a / (b + 1):.3f}"


def corpus() -> list[str]:
    """The fixed training corpus (exposed so callers can inspect or hash it)."""
    return [t for t in (*_docstrings(), *_synthetic_lines()) if t.strip()]


def _build_backend(vocab_size: int, specials: tuple[str, ...]) -> _Backend:
    tok = _Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _write(path: Path, text: str) -> None:
    path.write_bytes(text.encode("utf-8"))  # bytes, so no platform newline translation


def train_tiny_tokenizer(
    out_dir: str | os.PathLike[str], vocab_size: int = 2048, chat_format: str = "chatml"
) -> Tokenizer:
    """Train and save a Hugging Face-format tokenizer folder; vocab_size is an upper bound incl. specials.

    ``chat_format`` picks the special tokens and chat template: ``chatml`` (Qwen) or ``llama3``.
    """
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {chat_format!r}")
    llama3 = chat_format == "llama3"
    specials = LLAMA3_SPECIAL_TOKENS if llama3 else SPECIAL_TOKENS
    minimum = 256 + len(specials)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + specials), got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = _build_backend(vocab_size, specials)
    _write(out / "tokenizer.json", backend.to_str(pretty=True))
    template = LLAMA3_CHAT_TEMPLATE if llama3 else CHAT_TEMPLATE
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>" if llama3 else None,
        "eos_token": "<|eot_id|>" if llama3 else EOS_TOKEN,
        "pad_token": "<|end_of_text|>" if llama3 else PAD_TOKEN,
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        # transformers 5 still reads this name (and saves it as extra_special_tokens).
        "additional_special_tokens": list(specials[2:] if llama3 else specials[1:]),
        "chat_template": template,
    }
    _write(out / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    _write(out / "chat_template.jinja", template)
    return Tokenizer.from_dir(out)
