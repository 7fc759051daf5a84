"""Provenance: the weights a result read are named by a hash that any changed weight changes."""

import json

import torch
from safetensors.torch import save_file

from compactrl.agent.batch import RolloutConfig, rollout
from compactrl.config import load_config
from compactrl.provenance import provenance, weights_hash


def test_the_hash_changes_with_one_weight_and_not_with_other_files(tmp_path):
    w = {"a": torch.zeros(4, 4), "b": torch.ones(3)}
    save_file(w, tmp_path / "model.safetensors")
    first = weights_hash(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # not weights
    assert weights_hash(tmp_path) == first and len(first) == 16
    w["a"][2, 3] = 1e-7
    save_file(w, tmp_path / "model.safetensors")
    assert weights_hash(tmp_path) != first
    assert weights_hash(tmp_path / "missing") is None
    p = provenance({"model": tmp_path, "adapter": None})
    assert set(p["weights"]) == {"model"} and p["versions"]["torch"] == torch.__version__
    assert p["threads"] == torch.get_num_threads()


def test_a_rollout_summary_names_the_model_it_played(tmp_path):
    cfg = load_config(RolloutConfig, "configs/rollout/recall.toml", [f"out={tmp_path}", "episodes=1"])
    rollout(cfg)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["provenance"]["weights"] == {"model": weights_hash(tmp_path / "model")}
