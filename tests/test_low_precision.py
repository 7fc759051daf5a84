"""The engine's GEMM paths: float32 GEMMs on converted bfloat16 weights (AVX2 CPUs), oneDNN GEMMs on
reordered weights (float32, and bfloat16 where native), float32 logits, the engine/trainer
mismatch within each dtype's tolerance, and the options that expose them."""

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from compactrl.cli import app
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.engine.fused import FusedProjection
from compactrl.engine.linear import Linears, has_native_low_precision_matmul
from compactrl.models.decoder import _logits
from compactrl.models.tiny import init_random, tiny_config
from compactrl.verify import ENGINE_KL_TOLERANCE_LOW_PRECISION, verify_engine

runner = CliRunner()
ONEDNN = torch.backends.mkldnn.is_available()
ONEDNN_BF16 = ONEDNN and has_native_low_precision_matmul("cpu")
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU has no native bfloat16 GEMMs")


def lm(family="qwen2", dtype=torch.bfloat16, seed=0):
    return init_random(tiny_config(family, vocab_size=300, eos_token_id=[1]), seed=seed).to(dtype).eval()


def test_float32_gemm_of_bfloat16_weights_is_the_bfloat16_linear():
    model = lm("qwen2")  # qkv biases
    lin = Linears(model, "float32")
    assert lin.upcast and lin.kind == "float32"
    lin.block = 64 * 7  # several blocks per weight, the last one partial
    m = model.model.layers[0].self_attn.q_proj
    x = torch.randn(5, 3, m.in_features).to(torch.bfloat16)
    exact = (x.double() @ m.weight.double().T + m.bias.double()).float()
    y32 = lin.mm32(x, m.weight, m.bias)
    assert y32.dtype == torch.float32 and y32.shape == (5, 3, m.out_features)
    torch.testing.assert_close(y32, exact, rtol=1e-6, atol=1e-6)
    y = lin.linear(m, x)
    assert y.dtype == torch.bfloat16
    # the native kernel accumulates in float32 too: at most a last-bit difference, in few elements
    native = m(x)
    assert ((y.float() - native.float()).abs() <= native.float().abs() * 2**-7).all()
    assert (y != native).float().mean() < 0.05


def test_in_place_weight_updates_are_seen_without_bookkeeping():
    model = lm()
    lin = Linears(model, "float32")
    m = model.model.layers[0].mlp.down_proj
    x = torch.randn(4, m.in_features).to(torch.bfloat16)
    before = lin.linear(m, x)
    with torch.no_grad():
        m.weight.mul_(2)  # an optimizer step / Engine.update_weights on the shared model
    after = lin.linear(m, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, F.linear(x.float(), m.weight.float()).to(torch.bfloat16))


def test_auto_keeps_single_rows_native_and_float32_models_untouched():
    bf = Linears(lm(), "auto")
    assert bf.min_rows == 2
    m = lm().model.layers[0].mlp.up_proj
    assert not bf._wants(m, torch.zeros(1, m.in_features, dtype=torch.bfloat16))
    fp = lm(dtype=torch.float32)
    h = torch.randn(3, fp.config.hidden_size)
    for mode in ("native", "float32"):
        lin = Linears(fp, mode)
        assert not lin.upcast and not lin.low_precision and not lin.onednn
        assert torch.equal(lin.logits(fp, h), fp.lm_head(h))
    auto = Linears(fp, "auto")  # oneDNN on a CPU that has it: the same logits up to summation order
    assert auto.onednn == ONEDNN and not auto.upcast
    torch.testing.assert_close(auto.logits(fp, h), fp.lm_head(h), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="matmul mode"):
        Linears(fp, "fast")
    with pytest.raises(ValueError, match="onednn needs float32"):
        Linears(lm(dtype=torch.float16), "onednn")


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
def test_onednn_layers_are_the_native_ones_and_follow_weight_updates():
    model = lm(dtype=torch.float32)
    lin = Linears(model, "onednn")
    assert lin.kind == "onednn (prepacked)"
    layer = model.model.layers[0]
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(lin.mlp(layer.mlp, x), layer.mlp(x), rtol=1e-5, atol=1e-6)  # gate+up fused
        before = lin.linear(layer.mlp.up_proj, x)
        layer.mlp.up_proj.weight.mul_(2)  # an optimizer step on the shared model: seen, no bookkeeping
        torch.testing.assert_close(lin.linear(layer.mlp.up_proj, x), 2 * before, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lin.mlp(layer.mlp, x), layer.mlp(x), rtol=1e-5, atol=1e-6)
        layer.self_attn.o_proj.weight = torch.nn.Parameter(torch.zeros_like(layer.self_attn.o_proj.weight))
        assert lin.linear(layer.self_attn.o_proj, x[:, : layer.self_attn.o_proj.in_features]).abs().max() == 0
        # the fused q/k/v: its parameters are views of the pack, whose own version does not move
        proj, attn = FusedProjection(layer.self_attn), layer.self_attn
        cos, sin = model.rope(torch.arange(5)[None], x.dtype)
        for _ in range(2):
            ours = proj(x, cos[0], sin[0], lin)
            ref = [t[0].transpose(0, 1) for t in attn.project(x[None], cos, sin)]
            for a, b in zip(ours, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            attn.q_proj.weight.mul_(2)
            attn.v_proj.weight.add_(1)


def test_onednn_leaves_one_float32_row_to_the_modules_own_matrix_vector_product():
    """One float32 row (batch-1 decode) runs the layer itself, bit for bit; two rows go to oneDNN.
    A bfloat16 row stays with oneDNN, which is faster there."""
    model = lm(dtype=torch.float32)
    lin = Linears(model, "onednn")
    up = model.model.layers[0].mlp.up_proj
    one, two = torch.randn(1, up.in_features), torch.randn(2, up.in_features)
    assert not lin.stacks(up, x=one) and lin.stacks(up, x=two) and lin.stacks(up, x=one.bfloat16())
    with torch.no_grad():
        assert torch.equal(lin.linear(up, one), up(one))
        torch.testing.assert_close(lin.linear(up, two), up(two), rtol=1e-5, atol=1e-6)


def test_low_precision_logits_are_float32_and_match_the_trainer_head():
    model = lm("qwen3")  # tied embeddings
    h = torch.randn(6, model.config.hidden_size).to(torch.bfloat16)
    for mode in ("native", "float32", *(["onednn"] if ONEDNN_BF16 else [])):
        logits = Linears(model, mode).logits(model, h)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, _logits(model, h), rtol=1e-6, atol=1e-5)
    rounded = model.lm_head(h).float()  # what a bfloat16 head would give: visibly coarser
    assert (rounded - _logits(model, h)).abs().max() > 1e-4


def test_the_head_of_a_float32_model_stays_float32_under_bfloat16_autocast():
    """Training a float32 model in bfloat16 (autocast) rounds the layers, not the logits."""
    model = lm("qwen3", dtype=torch.float32)
    h = torch.randn(6, model.config.hidden_size).bfloat16()  # a final norm's output under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = _logits(model, h)
        rounded = model.lm_head(h).float()  # what autocast does to the head by itself
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(h.float(), model.lm_head.weight))
    assert (rounded - logits).abs().max() > 1e-3  # negative control: a bfloat16 head is visibly off


@pytest.mark.parametrize(
    "matmul",
    ["native", "float32", *(pytest.param(m, marks=needs_onednn_bf16) for m in ("onednn", "auto"))],
)
def test_bfloat16_engine_vs_trainer_within_the_bfloat16_tolerance(matmul):
    """``auto`` on a CPU with bfloat16 dot products: panel_gemm_bf16.c and gemv.c where they build."""
    r = verify_engine(n_sessions=12, seed=1, dtype="bfloat16", matmul=matmul)
    kind = Linears(lm(), "auto").kind.split()[0] if matmul == "auto" else matmul
    assert r["matmul"].split()[0] == kind and r["preemptions"] > 0 and r["forks"] > 0 and r["evictions"] > 0
    assert r["kl_tolerance"] == ENGINE_KL_TOLERANCE_LOW_PRECISION and r["tolerance"] is None
    assert r["ok"] and r["mean_kl"] < 1e-3 and r["max_abs_logprob_diff"] < 0.15
    assert r["kl_positions"] == r["sampled_tokens"] and r["reprefill_diff"] > 0.1


@pytest.mark.parametrize(
    "matmul", ["native", pytest.param("onednn", marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN"))]
)
def test_float32_verify_reports_a_kl_at_float_rounding(matmul):
    r = verify_engine(n_sessions=6, seed=2, matmul=matmul)
    assert r["ok"] and r["tolerance"] == 5e-5 and r["kl_tolerance"] is None
    assert abs(r["mean_kl"]) < 1e-9 and r["matmul"].split()[0] == matmul


def test_both_gemm_paths_sample_the_same_tokens_from_nearly_the_same_distribution():
    out = {}
    modes = ("native", "float32", *(["onednn"] if ONEDNN_BF16 else []))
    for matmul in modes:
        eng = Engine(lm(seed=3), None, EngineConfig(matmul=matmul))
        sessions = [eng.session() for _ in range(4)]
        for k, s in enumerate(sessions):
            s.append(list(range(5 + k, 40 + 3 * k)))
            s.generate(SamplingParams(max_tokens=12, temperature=0, seed=k, model_logprobs=True))
        eng.run()
        out[matmul] = [(s.tokens, s.model_logprobs) for s in sessions]
    for mode in modes[1:]:
        for (ta, la), (tb, lb) in zip(out["native"], out[mode], strict=True):
            assert ta == tb
            assert max(abs(a - b) for a, b in zip(la, lb) if a == a) < 0.05  # nan = not sampled


def test_verify_engine_and_bench_engine_cli_options(tmp_path):
    pytest.importorskip("transformers")
    r = runner.invoke(app, ["verify", "engine", "--sessions", "4", "--dtype", "bfloat16", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["dtype"] == "bfloat16" and out["ok"] and out["mean_kl"] < ENGINE_KL_TOLERANCE_LOW_PRECISION
    r = runner.invoke(app, ["verify", "engine", "--dtype", "float8"])
    assert r.exit_code == 2 and "--dtype" in r.output
    r = runner.invoke(app, ["verify", "engine", "--model", str(tmp_path)])
    assert r.exit_code == 2 and "config.json" in r.output
    args = ["bench", "engine", "--size", "tiny", "--batch", "2", "--context", "8", "--new-tokens", "3"]
    args += ["--repeats", "1", "--dtype", "bfloat16", "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["dtype"], out["device"], out["threads"]) == ("bfloat16", "cpu", 1)
    assert out["machine"]["threads"] == 1 and out["matmul"].removesuffix(", gemv (1 row)") in (
        "native",
        "float32 (2+ rows)",
        "onednn (prepacked)",
        "panel_gemm_bf16 (2+ rows)",
    )
    assert out["model"]["weight_bytes"] == 2 * out["model"]["parameters"]
    assert out["settings"][0]["decode_tokens_per_s"] > 0 and out["settings"][0]["batch"] == 2
    assert out["settings"][0]["gemms_alone_s"] > 0 and out["read_bytes_per_s"] > 0
    # the printed table has the docs' columns; no floor table without vLLM
    r = runner.invoke(app, args[:-1], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "decode: ours tok/s" in r.output and "/ transformers" in r.output and "GEMMs alone" not in r.output
    r = runner.invoke(app, ["bench", "engine", "--dtype", "float16"])
    assert r.exit_code == 2 and "--dtype" in r.output
    if not torch.cuda.is_available():
        r = runner.invoke(app, ["bench", "engine", "--device", "cuda"])
        assert r.exit_code == 2 and "CUDA" in r.output
