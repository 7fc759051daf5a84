"""Our decoder against transformers on the same folders, loading paths, and refused configs."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from compactrl.models import UnsupportedModelError, decoder, load_model, save_model
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


# ---- negative controls: `verify model` must catch a decoder with one deliberate error ------------
_project = decoder.Attention.project


def _keys_one_position_late(self, x, cos, sin):
    """Keys rotated with the previous position's angle (key 0 keeps its own), queries right: the
    off-by-one of a KV cache that stores keys at ``len - 1``. (Shifting *every* position by one
    is no error at all: RoPE scores depend on q - k only, and `verify model` rightly passes it.)"""
    q, _, v = _project(self, x, cos, sin)
    late = [torch.cat([c[:, :1], c[:, :-1]], dim=1) for c in (cos, sin)]
    _, k, _ = _project(self, x, *late)
    return q, k, v


def _without_qk_norm(self, x, cos, sin):
    """Qwen3's per-head RMSNorm on q and k skipped (a no-op for Llama and Qwen2, which have none)."""
    saved, self.qk_norm = self.qk_norm, False
    try:
        return _project(self, x, cos, sin)
    finally:
        self.qk_norm = saved


@pytest.mark.parametrize(
    "fault, broken",
    [(_keys_one_position_late, {"llama", "qwen2", "qwen3"}), (_without_qk_norm, {"qwen3"})],
    ids=["rope_off_by_one", "qk_norm_skipped"],
)
def test_verify_model_fails_a_decoder_with_one_deliberate_error(tmp_path, monkeypatch, fault, broken):
    """The positive test above could pass on a comparison that cannot see errors; here the same
    check, on the same tiny families, must fail exactly the families the fault touches (by logits
    of the order of 1, against a 1e-4 tolerance), and pass again once the patch is undone. This
    test breaks if `verify model` stops comparing logits (e.g. compares ours with ours), drops
    the position ids it hands transformers, or its tolerance grows to the size of the error."""
    pytest.importorskip("transformers")
    folders = {}
    for family in ("llama", "qwen2", "qwen3"):
        write(folders.setdefault(family, tmp_path / family), family)
    with monkeypatch.context() as m:
        m.setattr(decoder.Attention, "project", fault)
        results = {f: verify_model(d) for f, d in folders.items()}
    for family, r in results.items():
        diff = r["max_abs_logit_diff"]  # the worse of the causal and the eviction-mask comparison
        if family in broken:
            assert not r["ok"] and diff > 0.5, (family, diff)
        else:
            assert r["ok"] and diff < 1e-4, (family, diff)
    for family, d in folders.items():  # unpatched: the same folders pass
        assert verify_model(d)["ok"], family


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_weights_start_on_a_cache_line(tmp_path, dtype):
    """The kernels stream weights in 64-byte vectors; safetensors hands out tensors at the file's
    byte offsets (the control below), so loading must copy them onto aligned storage."""
    write(tmp_path, "qwen3")
    with safe_open(tmp_path / "model.safetensors", framework="pt") as sf:
        raw = {sf.get_tensor(n).data_ptr() % 64 for n in sf.keys()}
    assert raw != {0}  # the control: as read, some tensor starts mid cache line
    lm = load_model(tmp_path, dtype=dtype)
    assert {p.data_ptr() % 64 for p in lm.parameters()} == {0}


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
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope type 'dynamic' is not supported"),
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


# ---- loader fidelity against transformers 5.24 (the oracle loads the same folder) ----------------
def oracle_diff(folder, positions=None, T=48, seed=0):
    """max |our logits - transformers' logits| on one random sequence, with an explicit causal mask
    (transformers treats gapped or offset position_ids without a mask as packed documents)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ours = load_model(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    pos = (torch.arange(T) if positions is None else torch.as_tensor(positions))[None]
    T = pos.shape[1]
    ids = torch.randint(0, ours.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        a = ours(ids, pos)
        b = theirs(input_ids=ids, position_ids=pos, attention_mask=causal[None, None]).logits
    return float((a - b).abs().max()), ours


def test_tied_config_with_a_distinct_lm_head_loads_untied_as_transformers(tmp_path):
    write(tmp_path, "llama", tie_word_embeddings=True)
    state = load_file(tmp_path / "model.safetensors")
    head = torch.randn(state["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(3))
    save_file(state | {"lm_head.weight": head}, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match=r"model.safetensors.*tie_word_embeddings"):
        diff, ours = oracle_diff(tmp_path)
    assert diff <= 1e-4
    assert not ours.config.tie_word_embeddings and torch.equal(ours.lm_head.weight, head)
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()


def test_tied_config_with_an_equal_lm_head_or_only_the_head_loads_tied(tmp_path):
    write(tmp_path, "llama", tie_word_embeddings=True)
    state = load_file(tmp_path / "model.safetensors")
    emb = state["model.embed_tokens.weight"]
    save_file(state | {"lm_head.weight": emb.clone()}, tmp_path / "model.safetensors")
    lm = load_model(tmp_path)
    assert lm.config.tie_word_embeddings and lm.lm_head.weight is lm.model.embed_tokens.weight
    state.pop("model.embed_tokens.weight")  # only the head: transformers ties the embeddings to it
    save_file(state | {"lm_head.weight": emb}, tmp_path / "model.safetensors")
    diff, ours = oracle_diff(tmp_path)
    assert diff <= 1e-4 and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert torch.equal(ours.model.embed_tokens.weight, emb)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    "changes, omax",
    [
        (dict(rope_scaling=LLAMA3, max_position_embeddings=2048), 2048),  # missing: max_position_embeddings
        (dict(rope_scaling=LLAMA3 | {"original_max_position_embeddings": 4096},
              original_max_position_embeddings=512), 512),  # the top-level value wins
        (dict(rope_scaling=None, rope_theta=None, rope_parameters=LLAMA3 | {"rope_theta": 5e5}), 32768),
        (dict(rope_scaling=None, rope_parameters=LLAMA3 | {"original_max_position_embeddings": 700}), 700),
    ],
)  # fmt: skip
def test_llama3_rope_parameters_resolve_as_transformers(tmp_path, changes, omax):
    write(tmp_path, "llama")
    edit_config(tmp_path, **changes)
    diff, ours = oracle_diff(tmp_path, positions=torch.arange(3000, 3048))
    assert ours.config.rope.original_max_position_embeddings == omax
    assert diff <= 1e-4


@pytest.mark.parametrize(
    "rope, field",
    [
        ({"rope_type": "linear"}, "factor"),
        ({"type": "linear"}, "factor"),
        ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}, "low_freq_factor"),
        ({k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}, "high_freq_factor"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "factor"),
    ],
)
def test_rope_configs_transformers_refuses_are_refused(tmp_path, rope, field):
    transformers = pytest.importorskip("transformers")
    write(tmp_path, "llama")
    edit_config(tmp_path, rope_scaling=rope)
    with pytest.raises(KeyError, match=field):  # the oracle refuses it too
        transformers.AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=f"needs \\['{field}'\\]"):
        load_model(tmp_path)
    edit_config(tmp_path, rope_scaling=None, rope_parameters=rope)  # the transformers 5 layout
    with pytest.raises(UnsupportedModelError, match=field):
        load_model(tmp_path)


@pytest.mark.parametrize("family, head_dim", [("llama", 16), ("qwen2", 16), ("qwen3", 128)])
def test_config_without_head_dim_gets_transformers_default(tmp_path, family, head_dim):
    write(tmp_path, family, head_dim=head_dim)  # hidden 64, 4 heads: 16 derived; qwen3 defaults to 128
    edit_config(tmp_path, head_dim=None)
    diff, ours = oracle_diff(tmp_path)
    assert ours.config.head_dim == head_dim and diff <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_missing_config_fields_default_as_in_transformers(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from compactrl.models.config import load_config

    write(tmp_path, family)
    fields = ("head_dim", "num_key_value_heads", "max_position_embeddings", "rope_theta", "rope_scaling")
    edit_config(tmp_path, num_attention_heads=32, **dict.fromkeys(fields))  # qwen's kv default is 32
    theirs, ours = transformers.AutoConfig.from_pretrained(tmp_path), load_config(tmp_path)
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.head_dim == getattr(theirs, "head_dim", 64 // 32)
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]


# ---- YaRN ------------------------------------------------------------------------------------
def yarn(**extra):
    from compactrl.models.config import RopeConfig

    return RopeConfig(
        rope_type="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=32, **extra
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "extra",
    [{}, {"beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}, {"mscale": 1.0, "mscale_all_dim": 0.5},
     {"attention_factor": 1.3}],
)  # fmt: skip
def test_yarn_logits_match_transformers_beyond_the_original_context(tmp_path, family, extra):
    from compactrl.models.config import ModelConfig

    model = write(tmp_path, family, rope=yarn(**extra), max_position_embeddings=128)
    assert ModelConfig.from_hf(model.config.to_hf()) == model.config
    diff, ours = oracle_diff(tmp_path, positions=torch.arange(0, 120))  # the original context is 32
    assert ours.config.rope == model.config.rope and diff <= 1e-4
    r = compare_with_transformers(tmp_path, T=120)  # and under an eviction mask
    assert r["max_abs_logit_diff_evict_mask"] <= 1e-4


def test_yarn_attention_scale_reaches_cos_and_sin():
    from compactrl.models.decoder import CausalLM

    cfg = tiny_config("qwen3", vocab_size=300, rope=yarn())
    cos, sin = CausalLM(cfg).rope(torch.tensor([[0, 5]]), torch.float32)
    scale = 0.1 * math.log(4.0) + 1.0
    assert torch.allclose(cos[0, 0], torch.full_like(cos[0, 0], scale))
    assert torch.allclose(cos[0, 1] ** 2 + sin[0, 1] ** 2, torch.full_like(cos[0, 1], scale**2))


def test_yarn_from_hf_layouts_and_null_factor():
    from compactrl.models.config import ModelConfig

    hf = tiny_config("qwen2", vocab_size=300).to_hf()
    hf["max_position_embeddings"] = 1024
    hf["rope_scaling"] = {"type": "yarn", "factor": None, "original_max_position_embeddings": 256}
    assert ModelConfig.from_hf(hf).rope.factor == 4.0  # transformers: max / original
    hf["original_max_position_embeddings"] = 128  # top level wins
    assert ModelConfig.from_hf(hf).rope.original_max_position_embeddings == 128
    del hf["rope_scaling"], hf["original_max_position_embeddings"]
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 5e5, "truncate": False}
    rope = ModelConfig.from_hf(hf).rope
    assert (rope.theta, rope.factor, rope.original_max_position_embeddings, rope.truncate) == (
        5e5,
        2.0,
        1024,
        False,
    )
