"""Evictor scores against kvpress 0.5.5 (compactrl/bench/kvpress_parity.py, kvpress_scores.py).

Always: the kvpress script parses without kvpress, our extraction of per-head scores equals what
the engine's EvictorState computes after a prefill, the comparison's gate, and the errors for a
bad interpreter. Against kvpress only where KVPRESS_PYTHON names a python with kvpress installed
(its own virtualenv: kvpress pins transformers<5.3), e.g.

  KVPRESS_PYTHON=/work/kvpress-venv/bin/python pytest -q tests/test_kvpress_parity.py
"""

import importlib.util
import json
import os
import sys

import pytest
import torch
from typer.testing import CliRunner

from compactrl.bench import kvpress_parity, kvpress_scores
from compactrl.bench.kvpress_parity import KvpressError, check_kvpress_python, compare, evictors, our_scores
from compactrl.cli import app
from compactrl.engine import Engine, EngineConfig
from compactrl.models.tiny import init_random, tiny_config

KVPRESS_PYTHON = os.environ.get("KVPRESS_PYTHON")
needs_kvpress = pytest.mark.skipif(
    not (KVPRESS_PYTHON and os.access(KVPRESS_PYTHON, os.X_OK)),
    reason="set KVPRESS_PYTHON to a python with kvpress 0.5.5 installed",
)
runner = CliRunner()


def test_script_parses_without_kvpress():
    a = kvpress_scores.parse_args(["--model", "m", "--tokens", "t.json", "--out", "o.pt", "--window", "4"])
    assert (a.window, a.kernel, a.sinks, a.compression_ratio, a.threads) == (4, 5, 4, 0.5, 1)
    assert a.methods.split(",") == list(kvpress_scores.METHODS)
    assert kvpress_scores.parse_args(["--probe"]).probe
    for bad in (["--model", "m"], ["--probe", "--methods", "h2o"], ["--probe", "--compression-ratio", "0"]):
        with pytest.raises(SystemExit):
            kvpress_scores.parse_args(bad)
    assert "kvpress" not in sys.modules  # importable (and parseable) where kvpress is absent
    # every kvpress method the parity check reads is one the script runs
    assert {p[0] for p in kvpress_parity.PAIRS.values()} == set(kvpress_scores.METHODS)


@pytest.fixture(scope="module")
def lm():
    return init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=1).eval()


def test_our_scores_are_the_engines_after_a_prefill(lm):
    """The per-head scores compared with kvpress are the ones the engine's EvictorState computes
    after a chunked prefill (H2O's sums accumulated over three feeds, the window's kept queries)."""
    torch.set_num_threads(1)
    tokens = [(7 * i) % 290 + 3 for i in range(40)]
    evs = evictors(1000, window=6, kernel=5, sinks=3)  # budget 1000: the prefill evicts nothing
    ours = our_scores(lm, tokens, evs)
    eng = Engine(lm, None, EngineConfig(max_step_tokens=16))
    for name, ev in evs.items():
        s = eng.session()
        s.append(tokens, role="system")
        s.use_evictor(ev)
        eng.run()
        assert s.fed == s.live == len(tokens)
        engine = s.evictor.scores(*eng.book.live_keys(s))  # [layers, Hkv, N]
        assert engine.shape == ours[name].shape == (2, 2, len(tokens))
        fin = torch.isfinite(ours[name])
        assert torch.equal(fin, torch.isfinite(engine)), name
        torch.testing.assert_close(engine[fin], ours[name][fin], rtol=0, atol=1e-6, msg=name)
        s.close()


def test_compare_gates_scores_and_kept_sets():
    g = torch.Generator().manual_seed(0)
    theirs = torch.rand(2, 2, 20, generator=g)
    kept = torch.zeros(theirs.shape, dtype=torch.bool).scatter_(-1, theirs.topk(10).indices, True)
    r = compare(theirs + 1e-6, theirs, kept, 10, None, slice(0, 20))
    assert r["ok"] and r["kept_equal"] and r["max_abs_diff"] == pytest.approx(1e-6, rel=0.1)
    moved = theirs.clone()
    moved[0, 1, 3] += 0.5  # one score off by far more than the tolerance
    r = compare(moved, theirs, kept, 10, None, slice(0, 20))
    assert not r["ok"] and r["max_abs_diff"] == pytest.approx(0.5)
    r = compare(moved, theirs, kept, 10, None, None)  # scores not compared: the kept set still is
    assert r["max_abs_diff"] is None and (r["ok"] is r["kept_equal"] is (not r["kept_heads_differ"]))
    # a swap at the budget's boundary between two scores within the tolerance is a tie, not a failure
    tied = theirs.clone()
    order = tied[1, 0].argsort(descending=True)
    tied[1, 0, order[10]] = tied[1, 0, order[9]] - 1e-7
    kept_t = torch.zeros(tied.shape, dtype=torch.bool).scatter_(-1, tied.topk(10).indices, True)
    swapped = tied.clone()
    swapped[1, 0, order[10]] = tied[1, 0, order[9]] + 1e-7
    r = compare(swapped, tied, kept_t, 10, None, slice(0, 20))
    assert r["ok"] and r["kept_heads_differ"] == 1 and r["kept_ties"] == 1
    # forced tokens (kvpress's max + 1 window) are kept on our side whatever we score them
    forced = theirs.clone()
    forced[..., -3:] = 10.0
    kept_f = torch.zeros(forced.shape, dtype=torch.bool).scatter_(-1, forced.topk(10).indices, True)
    mine = theirs.clone()
    mine[..., -3:] = -5.0
    assert compare(mine, forced, kept_f, 10, slice(17, 20), slice(0, 17))["ok"]


def test_bad_interpreter_names_the_fix(tmp_path):
    with pytest.raises(KvpressError, match="does not exist.*pip install torch==2.13.0 kvpress==0.5.5"):
        check_kvpress_python(tmp_path / "nope" / "python")
    with pytest.raises(KvpressError, match="not an executable file"):
        check_kvpress_python(tmp_path)
    r = runner.invoke(app, ["verify", "kvpress", "--kvpress-python", str(tmp_path / "python")])
    assert r.exit_code == 2 and "kvpress==0.5.5" in r.output
    r = runner.invoke(app, ["verify", "kvpress", "--kvpress-python", sys.executable, "--tokens", "10"])
    assert r.exit_code == 2 and "raise --tokens" in r.output  # parameters are checked first
    if importlib.util.find_spec("kvpress") is None:  # this venv has none: the probe says so
        with pytest.raises(KvpressError, match="cannot import kvpress.*kvpress==0.5.5"):
            check_kvpress_python(sys.executable)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from compactrl.models.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("kvpress_models")
    return {fam: write_tiny_model(root / fam, family=fam) for fam in ("llama", "qwen3")}


@needs_kvpress
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scores_match_kvpress(tiny_models, family):
    torch.set_num_threads(1)
    r = kvpress_parity.parity(tiny_models[family], KVPRESS_PYTHON, n_tokens=48, window=6, kernel=5, sinks=3)
    assert r["versions"]["kvpress"] == "0.5.5" and r["n_kept"] == 24
    for name in ("snapkv", "tova", "knorm", "h2o"):
        m = r["methods"][name]
        assert m["max_abs_diff"] <= 1e-4 and m["kept_equal"], (name, m)
        assert m["score_scale"] > 100 * 1e-4  # the scores are not all ~0
    assert r["methods"]["streamingllm"]["kept_equal"]  # kvpress's score is a mask: kept set only
    assert all(d > 1e-3 for d in r["negative_controls"].values()), r["negative_controls"]
    assert r["ok"]


@needs_kvpress
def test_cli_json_and_mismatch_exit(tiny_models):
    args = ["verify", "kvpress", "--kvpress-python", KVPRESS_PYTHON, "--model", str(tiny_models["llama"])]
    r = runner.invoke(app, [*args, "--tokens", "32", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["ok"] and res["max_abs_diff"] <= 1e-4 and res["versions"]["kvpress"] == "0.5.5"
    r = runner.invoke(app, [*args, "--tokens", "32", "--json", "--tolerance", "-1"])
    assert r.exit_code == 1 and json.loads(r.stdout)["ok"] is False
