"""Episodes through the engine: modes, strategies, exact re-prefill accounting, env failures."""

import asyncio
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from compactrl.agent.batch import RolloutConfig, rollout, run_episodes
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import RolloutSettings
from compactrl.compaction import EvictSteps, Markovian, PickTurns, SlidingWindow, Summary, build_strategy
from compactrl.config import ConfigError, load_config
from compactrl.engine import Engine, EngineConfig
from compactrl.envs import Reset, Step
from compactrl.envs.recall import VARIANTS, RecallEnv
from compactrl.envs.rooms import RoomsEnv
from compactrl.models.tiny import write_tiny_model
from compactrl.rl.forward import stream_logprobs
from compactrl.trace import load_traces, save_traces
from compactrl.verify import verify_run

SETTINGS = RolloutSettings(max_tokens=6)


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), chat_format=request.param)


def run(model_dir, make_env, strategy_cfg, mode, seeds=(1, 2, 3), settings=SETTINGS, pool=100_000, conc=8):
    engine = Engine.from_pretrained(model_dir, config=EngineConfig(kv_pool_tokens=pool))
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    strategy = build_strategy(strategy_cfg)
    results = asyncio.run(run_episodes(engine, fmt, make_env, strategy, mode, settings, list(seeds), conc))
    return engine, results


STRATEGIES = [
    SlidingWindow(max_turns=3, stride=1),
    Markovian(max_turns=4),
    Summary(budget=260, max_tokens=12),
    PickTurns(budget=260),
]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_stream_reprefills_nothing_and_reprefill_matches_the_cost_model(model_dir, strategy):
    rooms = lambda: RoomsEnv(n_rooms=7, filler=3)  # noqa: E731
    _, stream = run(model_dir, rooms, strategy, "stream")
    _, repre = run(model_dir, rooms, strategy, "reprefill")
    for s, r in zip(stream, repre):
        assert s.error is None and r.error is None
        assert s.compactions > 0 and r.compactions > 0
        assert s.reprefilled_tokens == 0 and s.segments == 1 and len(s.traces) == 1
        assert r.reprefilled_tokens > 0
        assert r.reprefilled_tokens == r.predicted_reprefilled_tokens  # exact, not an estimate
        assert r.segments == r.compactions + 1 == len(r.traces)
        assert r.prefilled_tokens > s.prefilled_tokens
        assert r.turns == s.turns == 8  # rooms has a fixed length


def test_full_mode_never_compacts_and_holds_everything(model_dir):
    _, full = run(model_dir, lambda: RoomsEnv(n_rooms=5, filler=2), SlidingWindow(max_turns=2), "full")
    _, stream = run(model_dir, lambda: RoomsEnv(n_rooms=5, filler=2), SlidingWindow(max_turns=2), "stream")
    for f, s in zip(full, stream):
        assert f.compactions == 0 and f.strategy == "none"
        assert f.peak_live_kv == len(f.traces[0]) > s.peak_live_kv
        assert (f.traces[0].evict_at == len(f.traces[0])).all()


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_stream_traces_match_the_trainer(model_dir, strategy):
    """Real rollouts (not synthetic streams): the trainer's one-pass forward under the eviction
    mask reproduces every sampled log-prob; ignoring the evictions does not."""
    engine, results = run(model_dir, lambda: RoomsEnv(n_rooms=7, filler=3), strategy, "stream", seeds=(4, 5))
    traces = [r.traces[0] for r in results]
    assert all(t.num_evicted > 0 for t in traces)
    with torch.no_grad():
        ours = stream_logprobs(engine.model, traces)
        causal = [t.__class__.from_tokens(t.tokens, trainable=t.trainable) for t in traces]
        blind = stream_logprobs(engine.model, causal)
    for t, lp, bl in zip(traces, ours, blind):
        m = t.trainable
        assert np.abs(lp.double().numpy()[m] - t.logprobs[m]).max() < 5e-5
        assert np.abs(bl.double().numpy()[m] - t.logprobs[m]).max() > 0.1  # negative control


def test_summary_is_trainable_and_stays_while_old_steps_go(model_dir):
    _, (r,) = run(
        model_dir, lambda: RoomsEnv(n_rooms=7, filler=3), Summary(budget=260, max_tokens=12), "stream", (7,)
    )
    t = r.traces[0]
    roles = np.array(t.role)
    summary = (roles == "summary") & t.trainable
    assert summary.any()
    T = len(t)
    assert (t.evict_at[summary] == T).all() or r.compactions > 1  # the last summary is live at the end
    assert t.num_evicted > 0


def test_recall_evicts_the_assignment_before_the_question(model_dir):
    engine, (r,) = run(model_dir, lambda: RecallEnv(k=16), EvictSteps(), "stream", (3,), RolloutSettings())
    t, tok = r.traces[0], engine.tokenizer
    assert r.error is None and r.compactions == 1 and r.turns == 2
    assign = np.flatnonzero(t.evict_at < len(t))
    assert f"Your fruit is {r.info['answer']}." in tok.decode(t.tokens[assign].tolist())
    e = int(t.evict_at[assign[0]])
    assert (t.evict_at[assign] == e).all()
    chat = ChatFormat.from_tokenizer(tok).conversation()
    chat.message("user", "the task")
    question = chat.message("user", "Which fruit were you assigned")[:-3]
    assert t.tokens[e : e + len(question)].tolist() == question  # evicted right before the question
    assert np.isin(assign, t.visible(e - 1)).all()  # the counting saw the assignment
    assert not np.isin(assign, t.visible(e)).any()  # the question and the answer never do


def test_recall_rewards_an_exact_unleaked_answer():
    env = RecallEnv(k=16)
    env.reset(seed=5)
    env.step("1 2 3 4")
    good = env.step(f"Recall: {env.answer}")
    assert good.reward == 1.0 and good.done
    env.reset(seed=5)
    env.step(f"1 2 {env.answer} 3")  # leaked into the counting
    assert env.step(f"Recall: {env.answer}").reward == 0.0
    env.reset(seed=5)
    env.step("1 2 3")
    wrong = next(c for c in env.candidates if c != env.answer)
    assert env.step(f"Recall: {wrong}").reward == 0.0


def test_recall_lists_candidates_in_a_drawn_order_and_prior_demos_hide_the_assignment():
    env = RecallEnv(k=16)
    orders = set()
    for seed in range(20):
        env.reset(seed)
        question = env.step("1 2 3").observation
        listed = question.split(": ", 1)[1].rstrip("?").split(", ")
        assert sorted(listed) == sorted(env.candidates)
        orders.add(tuple(listed))
    assert len(orders) > 10  # no fixed position to guess
    prior = RecallEnv(k=16, prior_demos=0.5)
    shown = [prior.demo_reset(seed).observation for seed in range(400)]
    hidden = [o for o in shown if "Your fruit" not in o]
    assert 150 < len(hidden) < 250 and all(o.startswith("Count upward") for o in hidden)
    assert all(RecallEnv(k=16).demo_reset(seed).observation.startswith("Your fruit") for seed in range(50))
    prior.demo_reset(next(s for s in range(400) if "Your fruit" not in shown[s]))
    assert prior.answer in prior.candidates  # the demonstrated answer: a uniformly drawn candidate


def test_recall_variants_follow_the_papers_definitions():
    seen = {}
    for variant in VARIANTS:
        env = RecallEnv(k=16, variant=variant)
        answers, listed = set(), set()
        for seed in range(60):
            env.reset(seed)
            question = env.step("1 2 3").observation
            answers.add(env.answer)
            listed |= {c for c in env.candidates if c in question}
        seen[variant] = (answers, listed, question)
    assert seen["fruit"][0] == {"apple", "banana", "mango", "orange", "pineapple"} == seen["fruit"][1]
    # zero support: six objects are assigned, the question lists only the five fruits
    assert seen["zero-support"][0] == seen["fruit"][0] | {"television"}
    assert seen["zero-support"][1] == seen["fruit"][0]
    assert seen["prompt-generalisation"][2].startswith(
        "What is your favourite object? Choose from these five"
    )
    assert seen["actor"][1] == seen["actor"][0] and "Kevin Bacon" in seen["actor"][0]
    assert seen["actor-unlisted"][1] == set() == seen["tv-shows-unlisted"][1]  # nothing listed
    assert RecallEnv(variant="actor").reset(0).task.startswith("You will be assigned an actor.")


def test_rooms_asks_for_an_early_code():
    env = RoomsEnv(n_rooms=4, query_room=2)
    env.reset(seed=0)
    for _ in range(3):
        assert not env.step("next").done
    q = env.step("next")
    assert "room 2" in q.observation and not q.done
    assert env.step(f"Code: {env.codes[1]}").reward == 1.0


class Flaky:
    """An env that raises or hangs on a given step (seed 0: raises, seed 1: hangs, else fine)."""

    name = "flaky"

    def reset(self, seed):
        self.seed, self.n = seed, 0
        return Reset(task="Say anything.", observation="Go.")

    def step(self, action):
        self.n += 1
        if self.n == 2 and self.seed == 0:
            raise ValueError("boom")
        if self.n == 2 and self.seed == 1:
            time.sleep(3)
        return Step("ok", reward=1.0, done=self.n == 4)

    def close(self):
        pass


def test_a_failing_or_hanging_env_ends_only_its_episode(model_dir):
    settings = RolloutSettings(max_tokens=4, env_timeout_s=0.5)
    _, results = run(model_dir, Flaky, SlidingWindow(max_turns=2), "stream", (0, 1, 2, 3), settings)
    assert "boom" in results[0].error and "did not return" in results[1].error
    assert results[2].error is None and results[3].error is None
    assert results[2].reward == results[3].reward == 4.0
    assert results[0].turns == results[1].turns == 2 and results[0].traces  # what happened is kept


class LongDemo(RoomsEnv):
    """Rooms whose demonstration for seed 1 is too long for the action's token limit: the runner
    raises a ValueError (not an env failure) inside that episode only."""

    def reset(self, seed):
        self.seed = seed
        return super().reset(seed)

    def demo_action(self):
        return "word " * 40 if self.seed == 1 else super().demo_action()


def test_one_failing_episode_is_recorded_and_the_batch_is_kept(model_dir):
    engine = Engine.from_pretrained(model_dir)
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    make = lambda: LongDemo(n_rooms=4, filler=2)  # noqa: E731
    settings = RolloutSettings(max_tokens=16)
    results = asyncio.run(run_episodes(engine, fmt, make, None, "full", settings, [0, 1, 2], 3, demo=True))
    bad, good = results[1], [results[0], results[2]]
    assert bad.non_completion == "error" and "ValueError" in bad.error and "demonstration" in bad.error
    assert bad.traces and len(bad.traces[0]) > 0  # what it did before failing is kept
    assert all(r.error is None and r.reward > 0 for r in good)
    assert not engine.sessions  # nothing of the failed episode is left in the engine


def test_a_compaction_never_deletes_a_call_before_its_output_lands(model_dir):
    """A summary that keeps no step verbatim would delete the newest action too, and its output,
    arriving after, would belong to no step and stay forever. The action stays until its output is
    in and both go at the next compaction: nothing but the head outlives two summaries."""
    strategy = Summary(trigger="every", every=2, tail=0, max_tokens=8)
    _, results = run(model_dir, lambda: RoomsEnv(n_rooms=7, filler=3), strategy, "stream")
    for r in results:
        assert r.error is None and r.compactions >= 3
        (t,) = r.traces
        role, live = np.array(t.role), t.evict_at == len(t)
        summaries = np.flatnonzero(role == "summary")
        second_last = t.turn[summaries][t.turn[summaries] < t.turn[summaries[-1]]].max()
        old = live & (t.turn > 1) & (t.turn < second_last)  # turns 0 and 1: the system/task head
        assert not old.any(), sorted(set(t.turn[old].tolist()))


def test_oversubscribed_pool_preempts_and_completes_identically(model_dir):
    greedy = RolloutSettings(max_tokens=6, temperature=0.0)
    rooms = lambda: RoomsEnv(n_rooms=5, filler=3)  # noqa: E731
    _, alone = run(model_dir, rooms, SlidingWindow(max_turns=3), "stream", range(6), greedy, conc=1)
    _, crowded = run(model_dir, rooms, SlidingWindow(max_turns=3), "stream", range(6), greedy, pool=700)
    assert sum(r.preemptions for r in crowded) > 0
    for a, c in zip(alone, crowded):
        assert c.error is None
        assert np.array_equal(a.traces[0].tokens, c.traces[0].tokens)


def test_rollout_command_writes_a_run_dir(tmp_path):
    cfg = load_config(
        RolloutConfig,
        None,
        [f"out={tmp_path / 'run'}", "episodes=3", "env.n_rooms=4", "strategy.max_turns=2", "mode=reprefill"],
    )
    summary = rollout(cfg)
    assert summary["episodes"] == 3 and summary["errors"] == 0
    assert summary["reprefilled_tokens"] == summary["predicted_reprefilled_tokens"] > 0
    traces = load_traces(tmp_path / "run" / "traces.jsonl")
    assert len(traces) == summary["compactions"] + 3
    assert len((tmp_path / "run" / "episodes.jsonl").read_text().splitlines()) == 3
    check = verify_run(tmp_path / "run")
    assert check["ok"] and check["traces"] == len(traces) and check["max_abs_logprob_diff"] < 5e-5
    i = int(np.flatnonzero(traces[0].trainable)[0])
    traces[0].logprobs[i] += 1e-3  # a log-prob the engine did not produce must be caught
    save_traces(tmp_path / "run" / "traces.jsonl", traces)
    assert not verify_run(tmp_path / "run")["ok"]


def test_bad_configs_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="strategy.sliding_window: stride 5 > max_turns 2"):
        load_config(RolloutConfig, None, ["strategy.max_turns=2", "strategy.stride=5"])
    with pytest.raises(ConfigError, match="episodes"):
        load_config(RolloutConfig, None, ["episodes=0"])
    with pytest.raises(ConfigError, match="evict_steps"):
        load_config(RolloutConfig, None, ["env.name=recall"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[env]\nname = 'rooms'\nn_room = 3\n")
    with pytest.raises(ConfigError, match="n_room"):
        load_config(RolloutConfig, bad)
    with pytest.raises(ConfigError, match="model.path.*no config.json"):
        load_config(RolloutConfig, None, [f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(RolloutConfig, None, ["episodes"])


CONFIGS = sorted((Path(__file__).parent.parent / "configs" / "rollout").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_rollout_configs_are_valid(path, tmp_path):
    overrides = []
    if "path" in tomllib.loads(path.read_text()).get("model", {}):
        with pytest.raises(ConfigError, match="import-gguf"):  # a real model not imported yet: how to
            load_config(RolloutConfig, path, [f"model.path={tmp_path / 'none'}"])
        overrides = [f"model.path={write_tiny_model(tmp_path / 'm')}"]
    cfg = load_config(RolloutConfig, path, overrides)
    assert cfg.env.name in path.name or cfg.strategy.name in path.name  # named for what it runs


def test_a_stream_that_reaches_the_position_limit_ends_truncated_with_its_trace(tmp_path):
    """Positions are never renumbered: a stream episode stops at max_position_embeddings however
    much it evicted, truncated and flagged, with no error and its trace kept; re-prefill restarts
    positions in every segment, so the same episodes run to their turn limit."""
    folder = write_tiny_model(tmp_path / "m", max_position_embeddings=400)
    rooms = lambda: RoomsEnv(n_rooms=30, filler=3)  # noqa: E731
    settings = RolloutSettings(max_tokens=6, max_turns=12)
    engine, stream = run(folder, rooms, SlidingWindow(max_turns=2), "stream", seeds=(1, 2), settings=settings)
    _, repre = run(folder, rooms, SlidingWindow(max_turns=2), "reprefill", seeds=(1, 2), settings=settings)
    for s, r in zip(stream, repre):
        assert s.error is None and s.truncated and s.at_position_limit
        assert s.compactions > 0 and len(s.traces[0]) <= 400 == s.traces[0].meta["position_limit"]
        assert s.turns < r.turns == 12 and not r.at_position_limit and r.error is None
    t = stream[0].traces[0]
    with torch.no_grad():  # the trace is whole and valid
        logp = stream_logprobs(engine.model, [t])[0].numpy()
    assert np.allclose(logp[t.trainable], t.logprobs[t.trainable], atol=5e-5)


def test_set_name_switches_a_variant_and_drops_the_old_variants_fields(tmp_path, capsys):
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('[strategy]\nname = "sliding_window"\nmax_turns = 3\nstride = 2\n')
    cfg = load_config(RolloutConfig, cfg_file, ["strategy.name=summary", "strategy.tail=1"])
    assert cfg.strategy.name == "summary" and cfg.strategy.tail == 1
    assert "dropped strategy field(s) ['max_turns', 'stride']" in capsys.readouterr().err
    # max_turns is a markovian field too: kept; stride is not, and an explicit one is still refused
    assert load_config(RolloutConfig, cfg_file, ["strategy.name=markovian"]).strategy.max_turns == 3
    with pytest.raises(ConfigError, match="stride"):
        load_config(RolloutConfig, cfg_file, ["strategy.name=markovian", "strategy.stride=2"])
    with pytest.raises(ConfigError, match="sliding_window.tail"):  # negative control: no switch,
        load_config(RolloutConfig, cfg_file, ["strategy.tail=1"])  # nothing dropped or allowed
