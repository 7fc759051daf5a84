"""`bench trainer-hf` on a tiny Llama: our stream trainer and transformers + peft compute the same
log-probs and LoRA gradients on streams with evictions, and a causal mask does not."""

import json

import pytest
import torch
from conftest import random_stream
from typer.testing import CliRunner

from compactrl.trace import Trace, save_traces

pytest.importorskip("transformers")
pytest.importorskip("peft")

from compactrl.bench.trainer_hf import eviction_mask, hf_logprobs, lora_pair, markdown, run_trainer_hf_bench  # noqa: E402
from compactrl.cli import app  # noqa: E402
from compactrl.models.tiny import write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def bench_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = write_tiny_model(d / "tiny", family="llama", size="tiny", vocab_size=300)
    streams = [random_stream(s, T=96, vocab=256) for s in range(3)]
    fork = {"aux": True, "fork_at": 50}
    aux = Trace.from_tokens(streams[0].tokens, evict_at=streams[0].evict_at, meta=fork)  # skipped: a fork
    plain = Trace.from_tokens(streams[1].tokens, trainable=streams[1].trainable)  # nothing evicted
    save_traces(d / "traces.jsonl", [plain, streams[0], aux, *streams[1:]])
    return model, d / "traces.jsonl"


def test_ours_and_hf_agree_and_a_causal_mask_does_not(bench_inputs):
    model, traces = bench_inputs
    r = run_trainer_hf_bench(model, traces, lora_r=4, n_traces=2, repeats=1, chunk=32)
    assert r["n_traces"] == 2 and r["tokens"] == 2 * 96 and r["evicted_tokens"] > 0  # main, evicting only
    assert r["max_abs_logprob_diff"] <= 5e-5 and r["same_values"]
    assert r["max_rel_lora_grad_diff"] < 1e-3
    assert r["causal_mask_diff"] > 1e-3  # negative control: the evictions change the log-probs
    assert r["ours_s"] > 0 and r["hf_s"] > 0 and r["ours_vs_hf"] > 0 and r["hf_tokens_per_s"] > 0
    assert r["every_row"]["ours_s"] > 0 and r["every_row"]["hf_s"] > 0 and "every row" in markdown(r)
    assert r["lora"]["r"] == 4 and r["lora"]["alpha"] == 8 and len(r["lora"]["targets"]) == 7
    json.dumps(r)


def test_the_4d_mask_is_used_as_given(bench_inputs):
    """transformers takes our 4-D float mask as is: with nothing evicted it is its own causal mask."""
    model, _ = bench_inputs
    _, hf = lora_pair(model, 4, "cpu")
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = hf_logprobs(hf, ids, eviction_mask(torch.full((40,), 40)))
        own = hf(input_ids=ids[None], use_cache=False).logits[0].log_softmax(-1)[:-1].gather(1, ids[1:, None])
        evicted = hf_logprobs(hf, ids, eviction_mask(torch.tensor([40] + [10] * 9 + [40] * 30)))
    assert (full[1:] - own[:, 0]).abs().max() < 1e-5
    assert (full[11:] - evicted[11:]).abs().max() > 1e-3
    trained = torch.arange(40) % 3 == 1  # the head on the rows predicting these alone
    with torch.no_grad():
        some = hf_logprobs(hf, ids, eviction_mask(torch.full((40,), 40)), trained)
    assert (some[trained] - full[trained]).abs().max() < 1e-5 and not some[~trained].any()


def test_cli_bad_input_names_the_problem(bench_inputs, tmp_path):
    model, traces = bench_inputs

    def bench(model_dir, traces_file):
        return CliRunner().invoke(
            app, ["bench", "trainer-hf", "--model", str(model_dir), "--traces", str(traces_file)]
        )

    r = bench(model, tmp_path / "no.jsonl")
    assert r.exit_code == 2 and "no.jsonl" in r.output
    r = bench(tmp_path / "nomodel", traces)
    assert r.exit_code == 2 and "nomodel" in r.output
    save_traces(tmp_path / "flat.jsonl", [Trace.from_tokens([1, 2, 3])])  # nothing evicted
    r = bench(model, tmp_path / "flat.jsonl")
    assert r.exit_code == 2 and "no main trace with evictions" in r.output


def test_bfloat16_arms_against_their_float32(bench_inputs):
    """In bfloat16 both arms move away from float32 (rounding shows) but not far and keep the
    gradient's direction; the float32 checks still gate and our float32 arm is timed beside them."""
    model, traces = bench_inputs
    r = run_trainer_hf_bench(model, traces, lora_r=4, n_traces=2, repeats=1, chunk=32, precision="bfloat16")
    assert r["dtype"] == "bfloat16" and r["same_values"]  # the float32 checks still run and gate
    d = r["bfloat16_vs_float32"]
    for arm in ("ours", "hf"):
        assert 1e-4 < d[arm]["mean_abs_logprob_diff"] <= d[arm]["max_abs_logprob_diff"] < 0.5
        assert d[arm]["min_lora_grad_cosine"] > 0.9
    assert r["no_less_exact"] == (d["ours"]["mean_abs_logprob_diff"] <= d["hf"]["mean_abs_logprob_diff"])
    assert set(r["runs_s"]) == {"ours", "hf", "ours_every_row", "hf_every_row", "ours_float32"}
    assert r["ours_float32_s"] > 0
    assert r["bfloat16_speedup"] == pytest.approx(r["ours_float32_s"] / r["ours_s"])
    assert "time, bfloat16 / float32" in markdown(r) and "causal" not in markdown(r)
    with pytest.raises(ValueError, match="float16"):
        run_trainer_hf_bench(model, traces, precision="float16")
