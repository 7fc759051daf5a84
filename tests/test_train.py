"""`compactrl train`: the quickstart learns, and a crashed run resumes to the same result."""

import json
from pathlib import Path

import pytest
import torch

from compactrl.config import ConfigError, load_config, read_toml
from compactrl.models.loading import load_model
from compactrl.models.tokenizer import Tokenizer
from compactrl.provenance import weights_hash
from compactrl.rl.checkpoint import latest_checkpoint
from compactrl.rl.evaluate import evaluate
from compactrl.rl.loop import TrainConfig, train
from compactrl.trace import load_traces

QUICK = ["steps=8", "prompts=2", "group_size=4", "checkpoint_every=2"]


def test_quickstart_reward_rises(tmp_path):
    cfg = load_config(TrainConfig, "configs/quickstart.toml", [f"out={tmp_path}", "steps=10"])
    last = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert last["reward"] > rows[0]["reward"] + 0.2  # it learns to answer with digits
    assert all(r["errors"] == 0 and r["compactions"] > 0 for r in rows)
    assert max(r["mismatch_kl"] for r in rows) < 1e-6  # engine and trainer agree (float32, stream)
    before = evaluate(cfg, None, episodes=8)  # held-out seeds, the untrained model
    after = evaluate(cfg, tmp_path, episodes=8)  # a run folder means its newest checkpoint
    assert after["checkpoint"] == str(latest_checkpoint(tmp_path))
    assert after["mean_reward"] > before["mean_reward"] + 0.2 and after["errors"] == 0
    # one result per checkpoint, kept side by side (an eval no longer overwrites the last one)
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["initial.json", "step_00000010.json"]
    saved = json.loads(Path(after["path"]).read_text())
    assert saved["mean_reward"] == after["mean_reward"] and len(saved["episode_metrics"]) == 8
    kept = evaluate(cfg, tmp_path, episodes=3, name="kept", traces=True)  # what the policy wrote, kept
    traces = load_traces(Path(kept["path"]).with_suffix(".traces.jsonl"))
    assert len(traces) == 3 and all(t.trainable.any() for t in traces)  # stream: one trace an episode
    # a checkpoint's model folder is whole: a later run can start from it (model.path)
    start = load_config(TrainConfig, None, [f"model.path={latest_checkpoint(tmp_path) / 'model'}"])
    ours, theirs = (Tokenizer.from_dir(d) for d in (tmp_path / "model", start.model.folder(tmp_path)))
    assert ours.encode("Count 1 2 3") == theirs.encode("Count 1 2 3") and theirs.chat_template


class Crash(Exception):
    pass


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_crashed_run_resumes_to_the_same_result(tmp_path, lora):
    extra = ["train.lora.r=4", "train.lr=3e-2"] if lora else []  # LoRA: adapters only, resumed from them
    straight = load_config(TrainConfig, "configs/quickstart.toml", [f"out={tmp_path / 'a'}", *QUICK, *extra])
    expected = train(straight)

    crashing = load_config(TrainConfig, "configs/quickstart.toml", [f"out={tmp_path / 'b'}", *QUICK, *extra])

    def crash(m):
        if m["step"] == 5:  # after the step-4 checkpoint, mid-way to the next
            raise Crash

    with pytest.raises(Crash):
        train(crashing, on_step=crash)
    resumed = train(crashing, resume=True)
    for k in ("reward", "tokens", "turns", "trained_tokens"):
        assert resumed[k] == expected[k], k  # the same samples, token for token
    # a restarted engine lays its KV rows out afresh, so float rounding (not sampling) may differ
    for k in ("loss", "grad_norm"):
        assert resumed[k] == pytest.approx(expected[k], rel=1e-3, abs=1e-6), k
    a, b = (load_model(tmp_path / x / "checkpoints" / "step_00000008" / "model") for x in "ab")
    assert all(torch.allclose(p, q, atol=1e-5) for p, q in zip(a.parameters(), b.parameters()))
    rows = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 9))  # the crashed step 5 was not logged twice
    starts = [json.loads(line) for line in (tmp_path / "b" / "provenance.jsonl").read_text().splitlines()]
    assert [s["from_step"] for s in starts] == [0, 4]  # each start and resume, with what it read
    assert starts[0]["weights"] == starts[1]["weights"] == {"model": weights_hash(tmp_path / "b" / "model")}
    first = load_model(tmp_path / "a" / "model")  # the initial model: the checkpoints moved away from it
    assert any((p - q).abs().max() > 1e-3 for p, q in zip(a.parameters(), first.parameters()))
    if lora:
        assert (tmp_path / "b" / "checkpoints" / "step_00000008" / "lora.safetensors").is_file()


def test_training_refuses_truncated_sampling():
    for bad in ("rollout.temperature=0", "rollout.top_p=0.9", "rollout.top_k=5"):
        with pytest.raises(ConfigError, match="top_p = 1, top_k = 0"):
            load_config(TrainConfig, None, [bad])


@pytest.mark.parametrize("mode", ["stream", "reprefill"])
def test_ppo_with_the_critic_learns_in_both_modes(tmp_path, mode):
    """GAE over each whole rollout (cross-segment in re-prefill mode) with the value head."""
    cfg = load_config(
        TrainConfig,
        "configs/quickstart.toml",
        [f"out={tmp_path}", "steps=8", "objective.advantage=gae", f"mode={mode}"],
    )
    rows = []
    train(cfg, on_step=rows.append)
    assert rows[-1]["reward"] > rows[0]["reward"] + 0.2
    assert any(r["value_loss"] > 0 for r in rows) and all(r["errors"] == 0 for r in rows)
    if mode == "reprefill":
        assert all(r["reprefilled_tokens"] > 0 for r in rows)
    ckpt = latest_checkpoint(tmp_path)
    assert (ckpt / "value_head.safetensors").is_file()  # the critic is checkpointed with the policy


def test_ppo_epochs_and_minibatches_reuse_each_batch(tmp_path):
    """Several clipped optimizer steps per sampled batch: the first is on-policy, the later ones
    are off-policy against the sampling log-probs, so PPO's clip engages."""
    args = [f"out={tmp_path}", "steps=4", "objective.epochs=2", "objective.minibatches=2"]
    rows = []
    train(load_config(TrainConfig, "configs/quickstart.toml", args), on_step=rows.append)
    assert all(r["updates"] == 4 for r in rows)
    assert max(r["mismatch_kl"] for r in rows) < 1e-6  # reported for the first, on-policy update
    assert any(r["clip_fraction"] > 0 for r in rows)  # later updates moved the ratio past the clip
    assert all(r["errors"] == 0 and r["trained_tokens"] > 0 for r in rows)
    with pytest.raises(ConfigError, match="minibatches"):
        load_config(TrainConfig, "configs/quickstart.toml", ["objective.minibatches=100"])


def test_eval_every_gives_a_learning_curve_against_training_time(tmp_path):
    """Held-out evaluations every N RL steps land in that step's row; wall_s, the x axis of the
    curve, leaves every evaluation out (they are counted in eval_s instead)."""
    args = [f"out={tmp_path}", "steps=5", "eval_episodes=2", "eval_every=2", "checkpoint_every=10"]
    rows = []
    train(load_config(TrainConfig, "configs/quickstart.toml", args), on_step=rows.append)
    assert [r["step"] for r in rows if "eval_success" in r] == [2, 4, 5]  # and the final evaluation
    assert all(0 <= r["eval_success"] <= 1 for r in rows if "eval_success" in r)
    walls = [r["wall_s"] for r in rows]
    assert walls == sorted(walls) and walls[0] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_s"] > 0 and summary["wall_s"] >= walls[-1]
    assert rows[-1]["eval_success"] == summary["eval_after"]["success_rate"]
    # before + 2 during + after are excluded: the part's time is training plus evaluations
    assert summary["wall_s"] + summary["eval_s"] == pytest.approx(summary["wall_s_this_part"], abs=0.05)
    with pytest.raises(ConfigError, match="eval_episodes"):
        load_config(TrainConfig, "configs/quickstart.toml", ["eval_every=2"])


RECALL = ["env.name=recall", "env.k=16", "strategy.name=evict_steps", "prompts=2", "group_size=2",
          "checkpoint_every=1", "rollout.max_tokens=16", "train.lr=1e-3"]  # fmt: skip


def test_sft_warm_up_then_each_objective_on_recall_under_eviction(tmp_path):
    """The recall study's shape: full-context SFT steps on demonstrations, then steps of the
    chosen objective under eviction, one optimizer; held-out accuracy before and after."""
    args = [f"out={tmp_path / 'sft'}", *RECALL, "steps=5", "sft_steps=3", "objective.name=sft",
            "eval_episodes=4", "eval_controls=['reprefill']"]  # fmt: skip
    cfg = load_config(TrainConfig, None, args)
    rows = []
    train(cfg, on_step=rows.append)
    assert [r["phase"] for r in rows] == ["sft", "sft", "sft", "sft_evicted", "sft_evicted"]
    assert rows[2]["loss"] < rows[0]["loss"]  # the demonstrations are being learned
    summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
    for when in ("before", "after"):
        assert summary[f"eval_{when}"]["episodes"] == 4 and summary[f"eval_{when}"]["greedy"]
        assert summary[f"recall_accuracy_{when}"] == summary[f"eval_{when}"]["success_rate"]
    assert summary["last_step"]["step"] == 5 and summary["cpu_s"] > 0
    control = summary["eval_after_reprefill"]  # the same checkpoint and episodes, re-prefilled
    assert control["mode"] == "reprefill" and summary["eval_after"]["mode"] == "stream"
    assert control["episodes"] == 4 and "eval_before_reprefill" not in summary
    with pytest.raises(ConfigError, match="evict_steps"):
        load_config(TrainConfig, None, [*args, "strategy.name=sliding_window"])  # demos can't replay it

    for objective in ("rl", "rft", "distill"):
        rows = []
        extra = {"rl": ["objective.advantage=loo", "objective.chance=0.2"], "rft": ["objective.min_reward=0"]}
        more = ["steps=3", "sft_steps=2", f"objective.name={objective}", *extra.get(objective, [])]
        cfg = load_config(TrainConfig, None, [f"out={tmp_path / objective}", *RECALL, *more])
        train(cfg, on_step=rows.append)
        assert rows[2]["phase"] == "rl" and rows[2]["errors"] == 0 and rows[2]["compactions"] == 1.0
        assert rows[2]["trained_tokens"] > 0 and rows[2]["grad_norm"] > 0  # rft: all clear 0; loo: chance
    with pytest.raises(ConfigError, match="kl_ref_estimator"):
        load_config(
            TrainConfig,
            None,
            [*RECALL, "objective.name=distill", "train.kl_ref=0.1", "train.kl_ref_estimator=topk"],
        )
    with pytest.raises(ConfigError, match="mode = 'stream'"):
        load_config(TrainConfig, None, [*RECALL, "objective.name=distill", "mode=reprefill"])


TRAIN_CONFIGS = sorted(
    p
    for d in ("train", "recall", "textworld", "summary", "evictors", "browse", "sidequest")
    for p in (Path(__file__).parent.parent / "configs" / d).glob("*.toml")
)


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_train_configs_are_valid(path):
    """Each shipped config validates; one that starts from an earlier run's checkpoint (the TextWorld
    study's RL runs start from its SFT run's) is checked with that path unset."""
    declared = read_toml(path).get("model", {}).get("path", "")
    unset = ["model.path="] if declared.startswith("runs/") else []
    cfg = load_config(TrainConfig, path, unset)
    assert cfg.steps >= 1 and (cfg.model.path is None) == bool(unset or not declared)


@pytest.mark.parametrize("mode", ["stream", "reprefill"])
def test_textworld_trains_with_compaction(tmp_path, mode):
    small = ["steps=1", "prompts=1", "group_size=2", "eval_episodes=0", "eval_every=0", "rollout.max_turns=4",
             "strategy.max_turns=2", f"env.cache_dir={tmp_path}/tw", f"out={tmp_path}/run"]  # fmt: skip
    cfg = load_config(TrainConfig, "configs/textworld/rl.toml", [*small, f"mode={mode}", "model.path=",
                      "env.games=2", "env.settings={level = 2}"])  # fmt: skip
    last = train(cfg)
    assert last["errors"] == 0 and last["compactions"] > 0 and last["trained_tokens"] > 0
    assert (last["reprefilled_tokens"] > 0) == (mode == "reprefill")


@pytest.mark.parametrize(
    "config, sets",
    [
        ("configs/quickstart.toml", ["steps=1", "sft_steps=1", "prompts=1", "group_size=2"]),
        ("configs/sidequest/train.toml", ["steps=1", "prompts=1", "model.path=", "model.size=tiny",
                                          "env.world_size=40", "env.max_hops=3", "objective.kl=0"]),
    ],
    ids=["sft", "sidequest"],
)  # fmt: skip
def test_every_env_the_loop_makes_is_closed(tmp_path, monkeypatch, config, sets):
    """The envs a step makes to play episodes, to write demonstrations, or only to ask whether the
    env has demonstrations, are all closed (a browser or a game server each holds a process)."""
    from compactrl.rl.objectives import base, sft, sidequest

    made, closed = [], []

    def counted(cfg):
        env = make(cfg)
        made.append(env)
        close = env.close
        env.close = lambda: closed.append(env) or close()
        return env

    make = base.make_env
    for module in (base, sft, sidequest):  # where the objectives make envs
        monkeypatch.setattr(module, "make_env", counted)
    train(load_config(TrainConfig, config, [f"out={tmp_path}", "threads=1", *sets]))
    assert made and len({id(e) for e in closed}) == len(made), f"{len(made) - len(closed)} envs left open"


def test_checkpoint_keep_is_how_many_complete_checkpoints_stay(tmp_path):
    cfg = load_config(TrainConfig, "configs/quickstart.toml",
                      [f"out={tmp_path}", "steps=4", "prompts=1", "group_size=2", "checkpoint_every=1",
                       "checkpoint_keep=3"])  # fmt: skip
    train(cfg)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000003", "step_00000004"]
