"""A verifiers environment as the env: verifiers' own episode (its env's loop, its harness, its task's
rewards) runs with this run's engine as the model, its rewards are what verifiers scores, and its
traces replay exactly. Needs verifiers (pip install 'compactrl[verifiers]'); skipped without it, but
for the check that its absence is named at config validation."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from compactrl.agent.batch import RolloutConfig, rollout
from compactrl.config import ConfigError, load_config
from compactrl.envs.registry import load_class
from compactrl.envs.verifiers_env import VerifiersConfig, VerifiersEnv
from compactrl.trace import load_traces

EXAMPLE = Path(__file__).parents[1] / "examples" / "verifiers_env.py"
BASE = ["model.path=", "threads=1", "rollout.temperature=1.0", "rollout.max_tokens=4"]
LOAD = ["env.name=verifiers", f"env.load={EXAMPLE}:load_environment", "env.args.rows=4"]

PLUGGED = '''
async def chars(trace) -> float:
    """The replies' mean length in tens of characters: never 0, whatever a random model says."""
    replies = [m.content or "" for m in trace.assistant_messages]
    return sum(len(r) for r in replies) / max(len(replies), 1) / 10


async def boom(task) -> float:
    if task.idx % 2:  # the odd rows
        raise RuntimeError("the grader crashed")
    return 0.0
'''


@pytest.fixture
def plugged(tmp_path):
    """verifiers' package, and a file of reward functions to plug into the example by config."""
    pytest.importorskip("verifiers.v1")
    (tmp_path / "plugged.py").write_text(PLUGGED)
    return tmp_path / "plugged.py"


def run(tmp_path, name, *sets):
    cfg = load_config(RolloutConfig, None, [*BASE, f"out={tmp_path / name}", *sets])
    summary = rollout(cfg)
    rows = [json.loads(x) for x in (tmp_path / name / "episodes.jsonl").read_text().splitlines()]
    return summary, rows, load_traces(tmp_path / name / "traces.jsonl")


def replies(tok, t) -> list[str]:
    """The answers the engine generated in a trace: its trainable spans, as text."""
    at = np.flatnonzero(t.trainable)
    spans = np.split(at, np.flatnonzero(np.diff(at) > 1) + 1)
    return [tok.decode(t.tokens[s], skip_special_tokens=True) for s in spans]


def test_verifiers_runs_its_own_episode_scored_by_its_rewards_and_the_traces_replay(plugged, tmp_path):
    """The example's count env (a taskset, a user that answers each reply, an in-process harness) with
    a second reward plugged in by verifiers' config, under a server-side sliding window: no errors,
    3 turns each, the rewards are the task's, computed on the replies the engine generated, the
    reward their weighted sum, and every trace replays (engine == trainer) with its evictions."""
    from compactrl.engine import Engine
    from compactrl.rl.forward import stream_logprobs

    chars = [f"env.args.task.rewards.chars.fn={plugged}:chars", "env.args.task.rewards.chars.weight=0.5"]
    n = ["episodes=3", "concurrency=3", "mode=stream", "strategy.name=sliding_window", "strategy.max_turns=1"]
    summary, rows, traces = run(tmp_path, "vf", *n, *LOAD, *chars)
    assert summary["errors"] == 0 and [r["turns"] for r in rows] == [3, 3, 3]
    assert [r["info"]["task"]["row"] for r in rows] == [0, 1, 2] and {r["env"] for r in rows} == {"verifiers"}
    engine = Engine.from_pretrained(tmp_path / "vf" / "model")
    score = load_class(f"{EXAMPLE}:score")
    tasks = list(VerifiersEnv(load=f"{EXAMPLE}:load_environment", args={"rows": 4}).envs["train"].taskset)
    for r, t in zip(rows, traces, strict=True):
        said, start = replies(engine.tokenizer, t), tasks[r["info"]["task"]["row"]].data.start
        assert len(said) == 3 and t.num_evicted > 0
        counted = sum(score(x, start + 1 + k) for k, x in enumerate(said)) / 3
        length = 0.5 * sum(map(len, said)) / 3 / 10
        assert r["info"]["verifiers"][0]["rewards"] == pytest.approx({"counted": counted, "chars": length})
        assert r["reward"] == pytest.approx(counted + length) and length > 0
        with torch.no_grad():
            replayed = stream_logprobs(engine.model, [t])[0].double()
        m = torch.as_tensor(t.trainable)
        assert (replayed[m] - torch.as_tensor(t.logprobs)[m]).abs().max() < 5e-5


@pytest.mark.skipif(shutil.which("uv") is None, reason="verifiers installs its harnesses' programs with uv")
def test_verifiers_own_harness_a_program_it_installs_gives_the_same_data(plugged, tmp_path):
    """The example played by verifiers' built-in `null` harness instead of its in-process one: a chat
    program verifiers installs (with uv, from PyPI) and runs in a subprocess, its requests streamed,
    each segment a relaunch on the whole conversation. The same seeds: the same tokens and log-probs."""
    n = ["episodes=2", "concurrency=2", "mode=full", *LOAD]
    _, mine, a = run(tmp_path, "in_process", *n)
    summary, rows, b = run(tmp_path, "null", *n, "env.args.agent.harness.id=null")
    assert summary["errors"] == 0 and [r["turns"] for r in rows] == [3, 3]
    assert [r["reward"] for r in rows] == [r["reward"] for r in mine]
    for x, y in zip(a, b, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist()
        assert np.abs(x.logprobs[x.trainable] - y.logprobs[y.trainable]).max() < 1e-5


def test_a_verifiers_env_trains(plugged, tmp_path, monkeypatch):
    """One step of the example's config; and of the quickstart's with the env named by id, as an
    installed verifiers environment is (here: this folder on the path)."""
    from compactrl.rl.loop import TrainConfig, train

    short = [*BASE, "steps=1", "prompts=2", "group_size=2"]
    last = train(load_config(TrainConfig, EXAMPLE.with_suffix(".toml"), [*short, f"out={tmp_path / 'toml'}"]))
    assert last["step"] == 1 and last["errors"] == 0
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    by_id = ["env=", "env.name=verifiers", "env.id=verifiers_env", "env.args.taskset.rows=4", *short]
    last = train(load_config(TrainConfig, "configs/quickstart.toml", [*by_id, f"out={tmp_path / 'id'}"]))
    assert last["step"] == 1 and last["errors"] == 0


def test_a_failing_verifiers_episode_costs_only_its_own_episode(plugged, tmp_path):
    """A reward that raises on odd rows: those episodes fail with verifiers' cause, the others score."""
    boom = [f"env.args.task.rewards.boom.fn={plugged}:boom"]
    summary, rows, _ = run(tmp_path, "boom", "episodes=4", "concurrency=4", "mode=full", *LOAD, *boom)
    odd = [r["info"]["task"]["row"] % 2 == 1 for r in rows]
    assert odd == [False, True, False, True] and summary["errors"] == 2
    for r, bad in zip(rows, odd):
        assert ("the grader crashed" in (r["error"] or "")) == bad and (r["error"] is None) == (not bad)


def test_seeds_play_rows_mod_n_and_held_out_seeds_the_eval_envs(plugged):
    env = VerifiersEnv(
        load=f"{EXAMPLE}:load_environment", args={"rows": 3}, eval_args={"rows": 2, "turns": 5}
    )
    assert [(t["split"], t["row"]) for t in map(env.task, (0, 4, 10**9, 10**9 + 3))] == [
        ("train", 0), ("train", 1), ("eval", 0), ("eval", 1)]  # fmt: skip
    assert [len(env.rows[s]) for s in ("train", "eval")] == [3, 2]
    assert env.rows["eval"][1].data.turns == 5 and env.rows["train"][1].data.turns == 3
    same = VerifiersEnv(load=f"{EXAMPLE}:load_environment", args={"rows": 3})
    assert same.task(10**9 + 4) == same.task(1)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "give one of id"),
        ({"id": "verifiers_env", "load": "{example}:load_environment"}, "give one of id"),
        ({"id": "no-such-env"}, "no-such-env"),
        ({"load": "{example}:nope"}, "cannot import"),
        ({"load": "{example}:__doc__"}, "is not callable"),
    ],
)
def test_bad_verifiers_settings_are_named_before_anything_runs(plugged, env, says):
    sets = ["env.name=verifiers"] + [f"env.{k}={v.format(example=EXAMPLE)}" for k, v in env.items()]
    with pytest.raises(ConfigError, match=says):
        load_config(RolloutConfig, None, sets)


def test_without_verifiers_the_config_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if not installed
    with pytest.raises(ValidationError, match=r"pip install 'compactrl\[verifiers\]'"):
        VerifiersConfig(load=f"{EXAMPLE}:load_environment")
