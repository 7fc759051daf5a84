"""Environments and compaction plans on their own, and TextWorld end to end (offline)."""

import asyncio
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from compactrl.agent.batch import RolloutConfig, run_episodes
from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import RolloutSettings
from compactrl.compaction import Context, StepView, build_strategy
from compactrl.compaction import SlidingWindow as SlidingWindowConfig
from compactrl.compaction.pick import Pick
from compactrl.config import load_config
from compactrl.engine import Engine, EngineConfig
from compactrl.envs import (
    CountConfig,
    EnvError,
    RecallConfig,
    RoomsConfig,
    Step,
    TextWorldConfig,
    guarded,
    make_env,
)
from compactrl.envs import textworld_env as tw_env
from compactrl.envs.textworld_env import TextWorldEnv, game_command, game_path, match_command
from compactrl.models.tiny import write_tiny_model
from compactrl.models.tokenizer import Tokenizer
from compactrl.rl.demos import demo_trace
from compactrl.rl.loop import TrainConfig, train

pytest.importorskip("textworld")


def ctx(sizes):
    steps = [StepView(i, n, f"step {i} text") for i, n in enumerate(sizes)]
    return Context(steps, head_tokens=50, incoming_tokens=10, step=len(sizes), steps_since_compaction=1,
                   last_action="")  # fmt: skip


def test_pick_parses_a_valid_answer_and_falls_back_on_bad_ones():
    pick, c = Pick(budget=100), ctx([40, 30, 30, 30])
    d = pick.decide(c, "KEEP: 0, 3")
    assert d.delete == [1, 2] and not d.fallback
    for bad in ["I keep everything", "KEEP: 0, 1, 2, 3", "KEEP: 7", "KEEP: two", None]:
        d = pick.decide(c, bad)
        assert d.fallback, bad
        assert d.delete == [0]  # default: the most recent steps that fit (3, 2, 1 = 90 tokens)
    assert "[3] (30 tokens) step 3 text" in pick.request(c).prompt


def test_textworld_game_is_generated_once_and_played(tmp_path):
    env = TextWorldEnv("coin_collector", {"level": 1}, cache_dir=tmp_path)
    first = env.reset(seed=3)
    assert "coin" in first.task and "Admissible commands:" in first.observation
    path = game_path(tmp_path, "coin_collector", env.settings, 3)
    stamp = path.stat().st_mtime_ns
    env.reset(seed=3)
    assert path.stat().st_mtime_ns == stamp  # cached, not regenerated
    listed, question = first.observation.split("Admissible commands: ")[1].split("\n")
    commands = listed.split(", ")
    assert question == "Which command do you choose?"
    assert "take coin" in commands
    for garbage in ("\\x\\n\\q look", "\\", "\x01\t\u00e9"):  # interpreter escapes once crashed the process
        assert not env.step(garbage).done
    step = env.step("  take coin \nand more")
    assert step.reward == 1.0 and step.done and step.info["won"]
    env.close()
    assert [game_command(a) for a in ("\\", " go\\x north\n x", "")] == ["look", "gox north", "look"]


def test_textworld_matches_a_reply_that_names_an_admissible_command(tmp_path):
    cmds = ["go west", "go east", "take coin", "look"]
    assert match_command("I'll go west, I think.", cmds) == "go west"
    assert match_command("Go West", cmds) == "go west"
    assert match_command("take coins", cmds) is None  # whole words only
    assert match_command("look around and go east", cmds) == "go east"  # the longest named command
    assert match_command("You are in a cellar.", cmds) is None
    for matching in (False, True):  # negative control: without matching the reply is played verbatim
        env = TextWorldEnv("coin_collector", {"level": 1}, cache_dir=tmp_path, match_commands=matching)
        env.reset(seed=3)
        step = env.step("I will take coin now.")
        assert step.info["command"] == ("take coin" if matching else "I will take coin now.")
        assert step.done == matching and step.reward == float(matching)
        env.close()


def test_textworld_rejects_unknown_settings(tmp_path):
    with pytest.raises(ValueError, match="level"):
        TextWorldEnv("coin_collector", {"levle": 2}, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="coin_collector"):
        TextWorldEnv("zork", cache_dir=tmp_path)


def test_textworld_episodes_through_the_engine(tmp_path):
    folder = write_tiny_model(tmp_path / "model")
    engine = Engine.from_pretrained(folder, config=EngineConfig(kv_pool_tokens=50_000))
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    make = lambda: TextWorldEnv("treasure_hunter", {"level": 1}, cache_dir=tmp_path / "games")  # noqa: E731
    strategy = build_strategy(SlidingWindowConfig(max_turns=2))
    settings = RolloutSettings(max_tokens=6, max_turns=4)
    results = asyncio.run(run_episodes(engine, fmt, make, strategy, "stream", settings, [0, 1], 2))
    for r in results:
        assert r.error is None and r.turns >= 1
        assert r.truncated or r.info.get("won") or r.info.get("lost")
        assert r.compactions > 0 or r.turns < 3
        t = r.traces[0]
        assert "Admissible commands" in engine.tokenizer.decode(t.tokens.tolist())


def test_system_prompt_per_env_config(tmp_path):
    # tiny-model studies train on the exact streams of count, recall and rooms: no system message there
    for cfg in (CountConfig(), RecallConfig(), RoomsConfig()):
        assert cfg.system is None and make_env(cfg).reset(seed=1).system is None, cfg.name
        assert "rollout.system" in type(cfg).model_fields["system"].description
        mine = make_env(cfg.model_copy(update={"system": "Be brief."})).reset(seed=1)
        assert mine.system == "Be brief."
    # TextWorld tells an instruct model to answer with one listed command, and lists them
    cfg = TextWorldConfig(cache_dir=str(tmp_path))
    assert cfg.system == tw_env.SYSTEM and tw_env.SYSTEM in TextWorldConfig.model_fields["system"].description
    first = make_env(cfg).reset(seed=3)
    assert first.system == tw_env.SYSTEM and "admissible commands" in first.system
    assert "Admissible commands:" in first.observation
    # without the list, the default wording does not promise one; a set wording is kept as given
    assert TextWorldEnv(list_commands=False, cache_dir=tmp_path).system == tw_env.SYSTEM_UNLISTED
    assert TextWorldEnv(list_commands=False, system="Go.", cache_dir=tmp_path).system == "Go."
    # from a TOML file, where there is no null: "" means no system message
    toml = tmp_path / "run.toml"
    toml.write_text(f'[env]\nname = "textworld"\ncache_dir = "{tmp_path}"\nsystem = ""\n')
    env = make_env(load_config(RolloutConfig, toml).env)
    assert env.reset(seed=3).system is None
    over = load_config(RolloutConfig, None, ["env.name=count", "env.system=Reply with digits."])
    assert make_env(over.env).reset(seed=0).system == "Reply with digits."


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """One game cache for the demonstration tests: each game is compiled once (about a second)."""
    return tmp_path_factory.mktemp("games")


def play_demo(env, seed):
    """Follows demo_action from demo_reset to the end; the commands played and the final step."""
    env.demo_reset(seed)
    played, out = [], None
    while out is None or not out.done:
        action = env.demo_action()
        assert action in env.admissible and game_command(action) == action  # played as written
        assert match_command(action, env.admissible) == action  # and as the reply parser reads it
        out = env.step(action)
        played.append(action)
        assert len(played) <= 50
    return played, out


@pytest.mark.parametrize(
    "challenge,settings",
    [("treasure_hunter", {"level": 2}), ("treasure_hunter", {"level": 12}), ("coin_collector", {"level": 5})],
)
def test_textworld_demo_actions_win_the_game(games, challenge, settings):
    for matching in (False, True):
        env = TextWorldEnv(challenge, settings, cache_dir=games, match_commands=matching)
        for seed in range(2):
            played, out = play_demo(env, seed)
            assert out.info["won"] and out.info["score"] == out.info["max_score"] > 0, (seed, played)
            with pytest.raises(RuntimeError, match="game is over"):
                env.demo_action()
        env.close()


def test_textworld_demo_action_replans_after_a_deviation_and_needs_demo_reset(games):
    env = TextWorldEnv("coin_collector", {"level": 5}, cache_dir=games)
    env.reset(seed=1)
    with pytest.raises(RuntimeError, match="demo_reset"):
        env.demo_action()  # a plain reset does not track the solution (it slows every step)
    solution, _ = play_demo(env, 1)
    env.demo_reset(seed=1)
    env.step(env.demo_action())  # the first room of a coin-collector chain has one exit
    wrong = next(c for c in env.admissible if c.startswith("go ") and c != env.demo_action())
    env.step(wrong)
    played, out = [], None
    while out is None or not out.done:
        played.append(env.demo_action())
        out = env.step(played[-1])
    assert out.info["won"] and out.info["score"] == 1
    assert len(played) == len(solution)  # one step back, then the rest of the solution
    assert played[1:] == solution[1:]
    env.close()


def test_textworld_demo_trace_trains_on_the_walkthrough(games, tmp_path):
    fmt = ChatFormat.from_tokenizer(Tokenizer.from_dir(write_tiny_model(tmp_path / "m")))
    env = TextWorldEnv("coin_collector", {"level": 5}, cache_dir=games)
    for seed in range(2):
        solution, _ = play_demo(env, seed)
        assert len(solution) >= 3
        t = demo_trace(fmt, env, seed)
        assert t.num_evicted == 0 and t.meta["demo"]
        assert fmt.tokenizer.decode(t.tokens[t.trainable].tolist()) == "".join(
            f"{c}<|im_end|>" for c in solution
        )
        text = fmt.tokenizer.decode(t.tokens.tolist())
        assert tw_env.SYSTEM in text and "Admissible commands:" in text
        for turn in set(t.turn[t.trainable].tolist()):  # each command is one assistant turn
            assert fmt.tokenizer.decode(t.tokens[t.trainable & (t.turn == turn)].tolist()) in {
                f"{c}<|im_end|>" for c in solution
            }
    env.close()


def test_textworld_sft_warm_up_runs(games, tmp_path):
    overrides = [f"out={tmp_path / 'run'}", "steps=2", "sft_steps=2", "prompts=1", "group_size=1",
                 "eval_episodes=0", "rollout.max_turns=6", f"env.cache_dir={games}"]  # fmt: skip
    cfg = load_config(
        TrainConfig, "configs/textworld/sft.toml", [*overrides, "model.size=tiny", "env.games=2"]
    )
    last = train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sft = [x for x in lines if x.get("phase") == "sft"]
    assert [x["step"] for x in sft] == [1, 2] and last["phase"] == "sft"
    assert all(math.isfinite(x["loss"]) and x["trained_tokens"] > 0 for x in sft)


class Broken:
    name = "broken"

    def reset(self, seed):
        return {"task": "not a Reset"}


class Slow:
    name = "slow"

    def step(self, action):
        time.sleep(0.4)
        return Step("ok")


def test_an_env_call_is_timed_from_when_it_starts_not_while_it_waits_for_a_worker():
    """Two calls of 0.4 s, one worker, a 0.6 s limit: the second waits 0.4 s for the worker, then runs
    0.4 s; timed from the call's start both finish (timed from the queue, the second timed out)."""

    async def two():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        return await asyncio.gather(*(guarded(Slow(), "step", "a", 0.6) for _ in range(2)))

    assert [s.observation for s in asyncio.run(two())] == ["ok", "ok"]

    async def hung():  # negative control: a call that itself runs past the limit still times out
        return await guarded(Slow(), "step", "a", 0.2)

    with pytest.raises(EnvError, match="did not return within 0.2 s"):
        asyncio.run(hung())


def test_malformed_env_output_is_an_env_error():
    with pytest.raises(EnvError, match="expected Reset"):
        asyncio.run(guarded(Broken(), "reset", 0, 1.0))


def test_textworld_trains_on_a_fixed_pool_of_games_and_evaluates_outside_it(games):
    from compactrl.envs.base import HELD_OUT_SEED

    pool = TextWorldEnv("coin_collector", {"level": 5}, cache_dir=games, games=2)
    played = {}
    for seed in (0, 1, 2, 5, HELD_OUT_SEED, HELD_OUT_SEED + 2):
        pool.reset(seed)
        played[seed] = pool.game
    assert played[0] == played[2] and played[1] == played[5] and played[0] != played[1]  # seed % 2
    assert played[HELD_OUT_SEED] not in (played[0], played[1])  # held-out games are unseen
    assert played[HELD_OUT_SEED] != played[HELD_OUT_SEED + 2]  # and never folded together
    pool.close()
    every = TextWorldEnv("coin_collector", {"level": 5}, cache_dir=games)
    every.reset(2)
    assert every.game != played[0]  # without a pool every seed is its own game
    every.close()
