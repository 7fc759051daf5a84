"""bfloat16 in the engine: float32 GEMMs on converted weights (AVX2 CPUs), float32 logits, the
engine/trainer mismatch within the bfloat16 tolerance, and the options that expose them."""

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from compactrl.cli import app
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.engine.linear import Linears
from compactrl.models.decoder import _logits
from compactrl.models.tiny import init_random, tiny_config
from compactrl.verify import ENGINE_KL_TOLERANCE_LOW_PRECISION, verify_engine

runner = CliRunner()


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
    for mode in ("auto", "native", "float32"):
        lin = Linears(fp, mode)
        assert not lin.upcast and not lin.low_precision
        h = torch.randn(3, fp.config.hidden_size)
        assert torch.equal(lin.logits(fp, h), fp.lm_head(h))
    with pytest.raises(ValueError, match="matmul mode"):
        Linears(fp, "fast")


def test_low_precision_logits_are_float32_and_match_the_trainer_head():
    model = lm("qwen3")  # tied embeddings
    h = torch.randn(6, model.config.hidden_size).to(torch.bfloat16)
    for mode in ("native", "float32"):
        logits = Linears(model, mode).logits(model, h)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, _logits(model, h), rtol=1e-6, atol=1e-5)
    rounded = model.lm_head(h).float()  # what a bfloat16 head would give: visibly coarser
    assert (rounded - _logits(model, h)).abs().max() > 1e-4


@pytest.mark.parametrize("matmul", ["native", "float32"])
def test_bfloat16_engine_vs_trainer_within_the_bfloat16_tolerance(matmul):
    r = verify_engine(n_sessions=12, seed=1, dtype="bfloat16", matmul=matmul)
    assert r["matmul"] == matmul and r["preemptions"] > 0 and r["forks"] > 0 and r["evictions"] > 0
    assert r["kl_tolerance"] == ENGINE_KL_TOLERANCE_LOW_PRECISION and r["tolerance"] is None
    assert r["ok"] and r["mean_kl"] < 1e-3 and r["max_abs_logprob_diff"] < 0.15
    assert r["kl_positions"] == r["sampled_tokens"] and r["reprefill_diff"] > 0.1


def test_float32_verify_reports_a_kl_at_float_rounding():
    r = verify_engine(n_sessions=6, seed=2)
    assert r["ok"] and r["tolerance"] == 5e-5 and r["kl_tolerance"] is None
    assert abs(r["mean_kl"]) < 1e-9 and r["matmul"] == "native"


def test_both_gemm_paths_sample_the_same_tokens_from_nearly_the_same_distribution():
    out = {}
    for matmul in ("native", "float32"):
        eng = Engine(lm(seed=3), None, EngineConfig(matmul=matmul))
        sessions = [eng.session() for _ in range(4)]
        for k, s in enumerate(sessions):
            s.append(list(range(5 + k, 40 + 3 * k)))
            s.generate(SamplingParams(max_tokens=12, temperature=0, seed=k, model_logprobs=True))
        eng.run()
        out[matmul] = [(s.tokens, s.model_logprobs) for s in sessions]
    for (ta, la), (tb, lb) in zip(out["native"], out["float32"], strict=True):
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
    assert out["machine"]["threads"] == 1 and out["matmul"] in ("native", "float32 (2+ rows)")
    assert out["model"]["weight_bytes"] == 2 * out["model"]["parameters"]
    assert out["settings"][0]["decode_tokens_per_s"] > 0 and out["settings"][0]["batch"] == 2
    r = runner.invoke(app, ["bench", "engine", "--dtype", "float16"])
    assert r.exit_code == 2 and "--dtype" in r.output
    if not torch.cuda.is_available():
        r = runner.invoke(app, ["bench", "engine", "--device", "cuda"])
        assert r.exit_code == 2 and "CUDA" in r.output
