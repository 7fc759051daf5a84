"""Tokenizer wrapper and tiny tokenizer: round trips, special ids, and parity with transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactrl.models.tiny_tokenizer import CHAT_TEMPLATE, train_tiny_tokenizer
from compactrl.models.tokenizer import Tokenizer

CHAT = [
    {"role": "system", "content": "You count fruit."},
    {"role": "user", "content": "I have 3 apples and 12 bananas. How many?"},
    {"role": "assistant", "content": "15 pieces of fruit: 3 + 12 = 15."},
    {"role": "user", "content": "Und jetzt 🍒 cherries — 水果?\n  indented\tline"},
]

TEXTS = [
    "",
    "apple banana cherry grape mango",
    "  leading and trailing spaces  ",
    "Numbers: 0 7 42 1234567890 -3.14 1e-9 0xFF",
    "Unicode: café naïve Ωμέγα 日本語 العربية 🍎🍌🍒🍇🥭 e\u0301 \u200b",
    "lines\r\nwindows\n\n\ttabs\u00a0nbsp",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x * 2  # comment\n",
    '{"json": [1, 2, {"k": null}]}',
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tok")
    train_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def _hf_chat_ids(hf, messages, add_generation_prompt: bool) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    # transformers 5 returns a BatchEncoding by default (return_dict=True); 4.x returns the list.
    ids = out if isinstance(out, list) else out["input_ids"]
    return list(ids)


# --- tiny tokenizer -------------------------------------------------------------------------------


def test_writes_hf_folder(tok_dir: Path, tok: Tokenizer) -> None:
    assert sorted(p.name for p in tok_dir.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["eos_token"], cfg["pad_token"], cfg["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert cfg["chat_template"] == CHAT_TEMPLATE == (tok_dir / "chat_template.jinja").read_text()
    assert tok.vocab_size == 2048


def test_training_is_deterministic(tmp_path: Path, tok_dir: Path) -> None:
    train_tiny_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "again" / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_training_is_deterministic_across_processes(tmp_path: Path, tok_dir: Path) -> None:
    """A fresh interpreter with another hash seed and thread count must still give the same bytes."""
    out = tmp_path / "subprocess"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    code = "import sys; from compactrl.models.tiny_tokenizer import train_tiny_tokenizer as t; t(sys.argv[1])"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, cwd=root)
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_vocab_size_argument(tmp_path: Path) -> None:
    assert train_tiny_tokenizer(tmp_path / "small", vocab_size=400).vocab_size == 400
    with pytest.raises(ValueError, match="vocab_size"):
        train_tiny_tokenizer(tmp_path / "tiny", vocab_size=100)


# --- encode / decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_fixed(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_round_trip_any_unicode(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    ids = {t: tok.encode(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert all(len(v) == 1 for v in ids.values())
    flat = {v[0] for v in ids.values()}
    assert len(flat) == 3 and flat == tok.special_ids
    assert tok.eos_token_ids == ids["<|im_end|>"]
    assert tok.pad_token_id == ids["<|endoftext|>"][0]
    assert tok.bos_token_id is None
    assert tok.token_text(ids["<|im_start|>"][0]) == "<|im_start|>"
    # A special token inside text splits the text around it.
    assert tok.encode("ab<|im_end|>cd") == tok.encode("ab") + ids["<|im_end|>"] + tok.encode("cd")
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>"), skip_special_tokens=True) == "user\nhi"


def test_encode_adds_no_special_tokens(tok_dir: Path, tmp_path: Path, tok: Tokenizer) -> None:
    """Llama-style tokenizer.json files add a BOS in their post-processor; encode must not."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_file(str(tok_dir / "tokenizer.json"))
    eot = tok.encode("<|endoftext|>")[0]
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eot)]
    )
    assert backend.encode("apple").ids[0] == eot
    folder = tmp_path / "bos"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    assert Tokenizer.from_dir(folder).encode("apple") == tok.encode("apple")


def test_token_text(tok: Tokenizer) -> None:
    text = "apple pie, 12 grapes!"
    assert "".join(tok.token_text(i) for i in tok.encode(text)) == text
    for bad in (-1, tok.vocab_size, 10**9):
        with pytest.raises(ValueError, match="token id"):
            tok.token_text(bad)


# --- parity with transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(tok: Tokenizer, hf, add_generation_prompt: bool) -> None:
    ours = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    assert ours == _hf_chat_ids(hf, CHAT, add_generation_prompt)
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.render_chat(CHAT, add_generation_prompt=add_generation_prompt) == text
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert text.startswith("<|im_start|>system\nYou count fruit.<|im_end|>\n")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_ids_match_transformers(tok: Tokenizer, hf) -> None:
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_ids == [hf.eos_token_id]
    assert tok.pad_token_id == hf.pad_token_id and hf.bos_token_id is None
    assert set(hf.all_special_ids) <= tok.special_ids


def test_template_environment_matches_transformers(tok_dir: Path, tmp_path: Path, hf) -> None:
    """Exercises whitespace control, tojson, loop controls and unset bos_token like real Hub templates."""
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m.role == 'assistant' %}{% continue %}{% endif %}\n"
        "  {{ m | tojson }}|{{ eos_token }}|{{ extra }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}GEN{% endif %}"
    )
    folder = tmp_path / "custom"
    shutil.copytree(tok_dir, folder)
    (folder / "chat_template.jinja").write_text(template)
    ours = Tokenizer.from_dir(folder).render_chat(CHAT, add_generation_prompt=True, extra="x")
    theirs = hf.apply_chat_template(
        CHAT, chat_template=template, tokenize=False, add_generation_prompt=True, extra="x"
    )
    assert ours == theirs
    assert "🍒" in ours and "None" not in ours


def test_loads_folder_saved_by_transformers(tok: Tokenizer, hf, tmp_path: Path) -> None:
    hf.save_pretrained(tmp_path / "saved")
    again = Tokenizer.from_dir(tmp_path / "saved")
    assert again.chat_template == tok.chat_template
    assert again.apply_chat_template(CHAT, add_generation_prompt=True) == tok.apply_chat_template(
        CHAT, add_generation_prompt=True
    )
    assert again.eos_token_ids == tok.eos_token_ids and again.special_ids == tok.special_ids


# --- folder loading -------------------------------------------------------------------------------


def _copy(tok_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(tok_dir, folder)
    return folder


def test_jinja_file_wins_over_config_template(tok_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tok_dir, tmp_path)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(folder).render_chat(CHAT[:2]) == f"[{CHAT[0]['content']}][{CHAT[1]['content']}]"
    (folder / "chat_template.jinja").unlink()
    assert Tokenizer.from_dir(folder).chat_template == CHAT_TEMPLATE


def test_generation_config_adds_eos_ids(tok_dir: Path, tmp_path: Path, tok: Tokenizer) -> None:
    folder = _copy(tok_dir, tmp_path)
    im_end, eot = tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    loaded = Tokenizer.from_dir(folder)
    assert loaded.eos_token_ids == [im_end, eot]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    loaded = Tokenizer.from_dir(folder)
    assert loaded.eos_token_ids == [im_end, 7] and 7 in loaded.special_ids


def test_only_tokenizer_json_is_required(tok_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", folder)
    bare = Tokenizer.from_dir(folder)
    assert bare.eos_token_ids == [] and bare.pad_token_id is None and bare.chat_template is None
    assert bare.decode(bare.encode("apple 🍎")) == "apple 🍎"
    with pytest.raises(ValueError, match="no chat template"):
        bare.render_chat(CHAT)


def test_missing_folder_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist.*init-model"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_missing_tokenizer_json_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json is missing.*init-model"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_json_error_names_file(tok_dir: Path, tmp_path: Path, name: str) -> None:
    folder = _copy(tok_dir, tmp_path)
    (folder / name).write_text("{not json")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        Tokenizer.from_dir(folder)


def test_unknown_special_token_in_config(tok_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tok_dir, tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|nonexistent|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="nonexistent.*not in the tokenizer vocabulary"):
        Tokenizer.from_dir(folder)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list of"),
        ({"role": "user", "content": "hi"}, "list of"),
        ([], "empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user"}], r"messages\[0\]\['content'\] must be a str, but it is missing"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": None}], r"messages\[1\]\['content"),
        ([{"role": 1, "content": "a"}], r"messages\[0\]\['role'\] must be a str, but it is a int"),
        ([{"role": "user", "content": ["a"]}], r"\['content'\] must be a str, but it is a list"),
    ],
)
def test_malformed_messages(tok: Tokenizer, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_template_raise_exception(tok_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tok_dir, tmp_path)
    (folder / "chat_template.jinja").write_text("{{ raise_exception('only user turns, please') }}")
    with pytest.raises(jinja2.TemplateError, match="only user turns"):
        Tokenizer.from_dir(folder).render_chat(CHAT)
