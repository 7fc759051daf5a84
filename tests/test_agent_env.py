"""An agent function as the environment: your OpenAI-client loop, served by a session of the run's
engine in process. Its edits are evictions in place, its traces replay exactly, and an agent that
fails costs only its own episode."""

import json
from pathlib import Path

import numpy as np
import pytest

from compactrl.agent.batch import RolloutConfig, rollout
from compactrl.config import ConfigError, load_config
from compactrl.trace import load_traces
from compactrl.verify import verify_run

EXAMPLE = Path(__file__).parents[1] / "examples" / "count_agent.py"
BASE = ["model.path=", "threads=1", "rollout.temperature=1.0"]

AGENTS = '''
import asyncio

PAGE = "page {t}: city {a} lies north of city {b}, and the road between them is long."


def task(seed):
    return {"seed": seed}


async def play(client, task, edit, turns=5):
    """A browsing-style harness: an answer, then a tool output, ``turns`` times; ``edit`` changes the
    message list before each request. Returns what the server said it fed and evicted."""
    messages = [{"role": "system", "content": "You browse."}, {"role": "user", "content": "Find it."}]
    usage = []
    for t in range(turns):
        edit(messages, t)
        r = await client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4,
                                                 extra_body={"ignore_eos": True})
        usage.append([r.usage.prefilled_tokens, r.usage.evicted_tokens, r.usage.prompt_tokens])
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "tool", "content": PAGE.format(t=t, a=7 * t, b=3 * t)})
    return usage


def keep_all(messages, t):
    pass


def drop_old_outputs(messages, t):  # a window: only the newest tool output stays, its call too
    while sum(m["role"] == "tool" for m in messages) > 1:
        del messages[2:4]


def summarise(messages, t):  # at turn 3, the first two steps become one summary message
    if t == 3:
        messages[2:6] = [{"role": "user", "content": "Summary: pages 0 and 1 named cities 0, 3 and 7."}]


def agent(edit):
    async def solve(client, task):
        from compactrl.envs.agent import AgentResult

        usage = await play(client, task, edit)
        return AgentResult(1.0, {"usage": usage})
    return solve


keeps, drops, summaries = agent(keep_all), agent(drop_old_outputs), agent(summarise)


async def flaky(client, task):
    """Seed 0 raises, 1 hangs after a request, 2 returns no reward, 3 makes no request, 4 runs out of
    time in the middle of a request, the rest play."""
    s = task["seed"]
    hi = [{"role": "user", "content": "hi"}]
    if s == 0:
        raise RuntimeError("the tool crashed")
    if s == 1:
        await client.chat.completions.create(model="m", messages=hi, max_tokens=2)
        await asyncio.sleep(60)
    if s == 2:
        return "done!"
    if s == 3:
        return 1.0
    if s == 4:
        long = {"ignore_eos": True}
        await client.chat.completions.create(model="m", messages=hi, max_tokens=20000, extra_body=long)
    await play(client, task, keep_all, turns=2)
    return 0.5


def not_async(client, task):
    return 1.0


class PagesEnv:
    """A user's tool env: each call opens the next page (a cursor); the fifth page ends it."""

    name = "pages"

    def reset(self, seed):
        from compactrl.envs import Reset

        self.k, self.seed = 0, seed
        return Reset(task="Read every page.", max_tokens=4)

    def step(self, action):
        from compactrl.envs import Step

        self.k += 1
        text = f"[Cursor {self.k - 1}] Page {self.k - 1} of book {self.seed}: the river bends north."
        return Step(text, float(self.k == 5), self.k == 5, {"cursor": self.k - 1, "tool": "open"}, 4)

    def close(self):
        pass


async def paged(client, task):
    from compactrl.envs.registry import load_class

    harness = load_class("{examples}/browse_agent.py:harness")
    return await harness(client, PagesEnv(), task["seed"], window=2, max_turns=16)
'''


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS.replace("{examples}", str(EXAMPLE.parent)))
    return path


def run(tmp_path, name, *sets):
    cfg = load_config(RolloutConfig, None, [*BASE, f"out={tmp_path / name}", *sets])
    summary = rollout(cfg)
    rows = [json.loads(x) for x in (tmp_path / name / "episodes.jsonl").read_text().splitlines()]
    return summary, rows, load_traces(tmp_path / name / "traces.jsonl")


def agent_env(agents, fn):
    return ["env.name=agent", f"env.agent={agents}:{fn}", f"env.tasks={agents}:task"]


def test_an_agent_port_of_count_is_the_built_in_env_token_for_token(tmp_path):
    """The same episodes (seeds, sampling at temperature 1) played by the built-in env and by a plain
    OpenAI-client loop around it: the same tokens, the same log-probs, the same rewards."""
    n = ["episodes=4", "concurrency=4", "mode=full"]
    _, built_in, a = run(tmp_path, "env", *n, "env.name=count")
    port = ["env.name=agent", f"env.agent={EXAMPLE}:solve", f"env.tasks={EXAMPLE}:task"]
    _, agent, b = run(tmp_path, "agent", *n, *port)
    assert [r["reward"] for r in built_in] == [r["reward"] for r in agent]
    assert [r["turns"] for r in built_in] == [r["turns"] for r in agent] == [6] * 4
    for x, y in zip(a, b, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist() and x.trainable.tolist() == y.trainable.tolist()
        m = x.trainable
        assert np.abs(x.logprobs[m] - y.logprobs[m]).max() < 1e-5


def test_an_agents_own_edits_are_evictions_in_place_that_the_trainer_replays(agents, tmp_path):
    """An agent that keeps everything, one that drops old tool outputs (and their calls), and one that
    replaces two steps with a summary: every trace replays (engine == trainer), the dropping agent's
    requests feed exactly what the keeping agent's feed (removed messages cost nothing), the summary
    re-feeds what follows it (a prefix cache's cost), and the dropping agent's context stays bounded."""
    n = ["episodes=2", "concurrency=2", "mode=full"]
    runs = {fn: run(tmp_path, fn, *n, *agent_env(agents, fn)) for fn in ("keeps", "drops", "summaries")}
    for fn, (summary, rows, _) in runs.items():
        assert summary["errors"] == 0 and [r["reward"] for r in rows] == [1.0, 1.0], fn
        check = verify_run(tmp_path / fn)  # `compactrl verify run`: engine == trainer, evictions included
        assert check["ok"] and check["sampled_tokens"] > 0
        assert (check["evicted_tokens"] > 0) == (fn != "keeps")  # dropped, or changed and fed again
    usage = {fn: [r["info"]["usage"] for r in rows] for fn, (_, rows, _) in runs.items()}
    fed = {fn: [[u[0] for u in ep] for ep in eps] for fn, eps in usage.items()}
    assert fed["drops"] == fed["keeps"]
    assert all(sum(u[1] for u in ep) > 0 for ep in usage["drops"])  # evicted in place
    assert all(ep[-1][2] < keep[-1][2] for ep, keep in zip(usage["drops"], usage["keeps"]))  # bounded
    assert [ep[3] > keep[3] for ep, keep in zip(fed["summaries"], fed["keeps"])] == [True, True]
    drops = runs["drops"][2]
    assert all(t.num_evicted > 0 for t in drops)


def test_a_harness_that_drops_old_tool_outputs_is_the_built_in_cursor_rule_token_for_token(agents, tmp_path):
    """The browse example's harness (keep the newest 2 tool outputs, each with its call) around a tool env,
    against the same env run by compactrl's rollout under keep_last_cursors: at temperature 1 with the
    same seeds, the same tokens, the same evictions at the same places, the same log-probs. This is the
    server's diffing, checked against KV-streams."""
    n = ["episodes=3", "concurrency=3"]
    rule = ["mode=stream", "strategy.name=keep_last_cursors", "strategy.n=2", f"env.import={agents}:PagesEnv"]
    _, _, built_in = run(tmp_path, "rule", *n, *rule)
    _, rows, served = run(tmp_path, "harness", *n, "mode=full", *agent_env(agents, "paged"))
    assert [r["reward"] for r in rows] == [1.0] * 3 and all(r["evicted_tokens"] > 0 for r in rows)
    for x, y in zip(built_in, served, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist() and x.evict_at.tolist() == y.evict_at.tolist()
        assert x.num_evicted > 0 and np.abs(x.logprobs[x.trainable] - y.logprobs[y.trainable]).max() < 1e-5


def test_a_server_side_strategy_applies_on_top_of_the_agents_own_list(agents, tmp_path):
    """keep_last_cursors in the run's [strategy], for an agent that keeps everything: its tool outputs
    are cursors, so the session drops the older ones itself, as the dropping agent did."""
    n = ["episodes=2", "concurrency=2", "mode=stream", "strategy.name=keep_last_cursors", "strategy.n=1"]
    summary, rows, traces = run(tmp_path, "ruled", *n, *agent_env(agents, "keeps"))
    run(tmp_path, "dropped", "episodes=2", "concurrency=2", "mode=full", *agent_env(agents, "drops"))
    assert summary["errors"] == 0 and all(r["compactions"] > 0 for r in rows)
    prompt = [[u[2] for u in r["info"]["usage"]] for r in rows]
    assert prompt == [[u[2] for u in r["info"]["usage"]] for r in [json.loads(x) for x in
                      (tmp_path / "dropped" / "episodes.jsonl").read_text().splitlines()]]  # fmt: skip
    assert all(t.num_evicted > 0 for t in traces)


def test_an_agent_that_fails_costs_only_its_own_episode(agents, tmp_path):
    sets = ["episodes=7", "concurrency=7", "mode=full", "env.timeout_s=2", *agent_env(agents, "flaky")]
    summary, rows, traces = run(tmp_path, "flaky", *sets)
    errors = [r["error"] for r in rows]
    assert "RuntimeError: the tool crashed" in errors[0]
    assert "did not return within timeout_s = 2 s" in errors[1] and "within timeout_s" in errors[4]
    assert "return a finite number" in errors[2] and "made no request" in errors[3]
    assert errors[5:] == [None, None] and [r["reward"] for r in rows[5:]] == [0.5, 0.5]
    assert [r["non_completion"] for r in rows] == ["error"] * 5 + [None, None]
    assert summary["errors"] == 5 and len(traces) == 2 + 2  # the timed-out episodes' streams are kept too


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"agent": "{agents}:not_async", "tasks": "{agents}:task"}, "is not an async function"),
        ({"agent": "{agents}:keeps", "tasks": "{tmp}/none.jsonl"}, "does not exist"),
        ({"agent": "{agents}:keeps", "tasks": "{tmp}/bad.jsonl"}, "bad.jsonl:2 is not JSON"),
        ({"agent": "{agents}:nope", "tasks": "{agents}:task"}, "cannot import"),
    ],
)
def test_bad_agent_settings_are_named_before_anything_runs(agents, tmp_path, env, says):
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{"q": \n')
    sets = ["env.name=agent"] + [f"env.{k}={v.format(agents=agents, tmp=tmp_path)}" for k, v in env.items()]
    with pytest.raises(ConfigError, match=says):
        load_config(RolloutConfig, None, sets)


def test_a_tasks_file_plays_line_seed_mod_n(agents, tmp_path):
    from compactrl.envs.agent import AgentEnv

    (tmp_path / "t.jsonl").write_text('{"q": "a"}\n\n{"q": "b"}\n')
    (tmp_path / "e.jsonl").write_text('"held out"\n')
    env = AgentEnv(f"{agents}:keeps", str(tmp_path / "t.jsonl"), str(tmp_path / "e.jsonl"))
    assert [env.task(s) for s in (0, 1, 2)] == [{"q": "a"}, {"q": "b"}, {"q": "a"}]
    assert env.task(10**9 + 5) == "held out"


@pytest.mark.parametrize("name", ["count_agent", "browse_agent", "agents_sdk_agent"])
def test_each_examples_config_trains(name, tmp_path):
    from compactrl.rl.loop import TrainConfig, train

    sets = [f"out={tmp_path}", "steps=1", "prompts=2", "group_size=2", "model.path=", "threads=1"]
    cfg = load_config(TrainConfig, EXAMPLE.parent / f"{name}.toml", sets)
    last = train(cfg)
    assert last["step"] == 1 and last["errors"] == 0


def test_the_quickstart_learns_the_same_with_the_count_task_as_an_agent(tmp_path):
    """The quickstart (sliding window in stream mode, server-side for the agent) trained on the built-in
    count env and on its agent port, same seeds: the first step's data is the same to the token (so its
    reward is), and after training the held-out greedy reward rises by as much: the paired difference's
    interval holds 0."""
    from compactrl.rl.evaluate import evaluate
    from compactrl.rl.loop import TrainConfig, train
    from compactrl.stats import paired_diff

    runs = {}
    for name, config in (("env", "configs/quickstart.toml"), ("agent", EXAMPLE.with_suffix(".toml"))):
        cfg = load_config(TrainConfig, config, [f"out={tmp_path / name}", "steps=10"])
        train(cfg)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        before, after = (evaluate(cfg, c, episodes=16, greedy=True) for c in (None, tmp_path / name))
        runs[name] = rows, before, after
    (env_rows, env_before, env_after), (agent_rows, agent_before, agent_after) = runs["env"], runs["agent"]
    assert env_rows[0]["reward"] == agent_rows[0]["reward"] and agent_rows[0]["compactions"] > 0
    assert env_before["mean_reward"] == agent_before["mean_reward"]
    assert agent_after["mean_reward"] > agent_before["mean_reward"] + 0.2
    per_episode = [[m["reward"] for m in json.loads(Path(r["path"]).read_text())["episode_metrics"]]
                   for r in (agent_after, env_after)]  # fmt: skip
    diff = paired_diff(*per_episode)
    assert diff.ci[0] <= 0 <= diff.ci[1], diff


def test_an_openai_agents_sdk_agent_runs_its_tool_through_a_served_session(tmp_path, monkeypatch):
    """examples/agents_sdk_agent.py, the SDK's own Agent and Runner with compactrl's client: the model's
    answers are teacher-forced (a random tiny model writes no calls) to a hermes tool call, then to the
    product the tool returned. The SDK parses the call from the server's response, runs the tool, sends
    the call and its result back; the session matches the call to its sampled tokens, and the episode's
    stream replays."""
    pytest.importorskip("agents")
    import re

    from compactrl.serve.server import Server

    sample = Server.params

    def params(self, req, *args, **kw):
        results = [m.text() for m in req.messages if m.role == "tool"]
        if results:  # the tool has run: the answer is its result
            text = f"It is {results[-1]}."
        else:
            a, b = re.search(r"What is (\d+) times (\d+)", req.messages[-1].text()).groups()
            text = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        toks = self.engine.tokenizer.encode(text) + [self.fmt.stop_ids[0]]
        return sample(self, req, *args, **kw).model_copy(update={"forced": toks})

    monkeypatch.setattr(Server, "params", params)
    sdk = ["env.name=agent", f"env.agent={EXAMPLE.parent}/agents_sdk_agent.py:solve",
           f"env.tasks={EXAMPLE.parent}/agents_sdk_agent.py:task", "rollout.max_tokens=64"]  # fmt: skip
    summary, rows, traces = run(tmp_path, "sdk", "episodes=2", "concurrency=2", "mode=full", *sdk)
    assert summary["errors"] == 0 and [r["reward"] for r in rows] == [1.0, 1.0]
    assert [r["turns"] for r in rows] == [2, 2]  # the call, then the answer after the tool's result
    check = verify_run(tmp_path / "sdk")
    assert check["ok"] and check["evicted_tokens"] == 0  # the call sent back was matched, not re-rendered
