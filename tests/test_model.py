"""Our decoder against transformers on the same folders, loading paths, and refused configs."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from compactrl.models import UnsupportedModelError, load_model, save_model
from compactrl.models.decoder import token_logprobs
from compactrl.models.tiny import init_random, tiny_config
from compactrl.verify import compare_with_transformers, verify_model


def write(tmp_path, family="llama", **overrides):
    cfg = tiny_config(family, vocab_size=300, eos_token_id=[1], **overrides)
    model = init_random(cfg, seed=1)
    save_model(model, tmp_path)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(tmp_path, family):
    pytest.importorskip("transformers")
    r = compare_with_transformers(tmp_path if write(tmp_path, family) else None)
    assert r["family"] == family
    assert r["max_abs_logit_diff"] < 1e-4
    assert r["max_abs_logit_diff_evict_mask"] < 1e-4


def test_tied_biased_llama_with_linear_rope_matches_transformers(tmp_path):
    pytest.importorskip("transformers")
    from compactrl.models.config import RopeConfig

    rope = RopeConfig(rope_type="linear", factor=2.0)
    write(tmp_path, "llama", tie_word_embeddings=True, rope=rope, attention_bias=True, mlp_bias=True)
    r = compare_with_transformers(tmp_path)
    assert max(r["max_abs_logit_diff"], r["max_abs_logit_diff_evict_mask"]) < 1e-4


def test_verify_command_builds_all_three_families():
    pytest.importorskip("transformers")
    out = verify_model()
    assert set(out["families"]) == {"llama", "qwen2", "qwen3"} and out["ok"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("bias", [False, True])
def test_parameter_count_is_exact(family, bias):
    extra = {"attention_bias": bias, "mlp_bias": bias} if family == "llama" else {}
    cfg = tiny_config(family, vocab_size=300, **extra)
    assert cfg.num_parameters() == sum(p.numel() for p in init_random(cfg).parameters())


def test_bfloat16_is_close_to_float32(tmp_path):
    write(tmp_path, "qwen3")
    ids = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(64)[None]
    with torch.no_grad():
        f32 = torch.log_softmax(load_model(tmp_path)(ids, pos), -1)
        bf16 = load_model(tmp_path, dtype="bfloat16")
        assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
        lp = torch.log_softmax(bf16(ids, pos).float(), -1)
    assert (lp - f32).abs().max() < 0.25
    assert (lp - f32).abs().max() > 0  # it really ran in bfloat16


def test_sharded_checkpoint_loads_identically(tmp_path):
    model = write(tmp_path / "single", "qwen2")
    state = load_file(tmp_path / "single" / "model.safetensors")
    names = sorted(state)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, shard_dir / fname)
        weight_map |= {n: fname for n in part}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(shard_dir)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_token_logprobs_chunked_equals_full_log_softmax(tiny_lm):
    h = torch.randn(37, tiny_lm.config.hidden_size)
    t = torch.randint(0, 300, (37,))
    full = torch.log_softmax(tiny_lm.lm_head(h), -1).gather(-1, t[:, None])[:, 0]
    assert (token_logprobs(tiny_lm, h, t, chunk=8) - full).abs().max() < 1e-5


def edit_config(tmp_path, **changes):
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(model_type="gemma2"), "model_type 'gemma2' is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(architectures=["LlamaForSequenceClassification"]), "architectures"),
        (dict(num_key_value_heads=3), "multiple of"),
        (dict(vocab_size=None), "vocab_size"),
        (dict(hidden_size=96, head_dim=None), "shape"),
    ],
)
def test_unsupported_or_inconsistent_configs_are_refused(tmp_path, changes, match):
    write(tmp_path, "llama")
    edit_config(tmp_path, **changes)
    with pytest.raises((UnsupportedModelError, ValueError), match=match):
        load_model(tmp_path)


def test_missing_files_and_weights_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="init-model"):
        load_model(tmp_path)
    write(tmp_path, "qwen3")
    state = load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_norm.weight'\]"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
