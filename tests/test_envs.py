"""Environments and compaction plans on their own, and TextWorld end to end (offline)."""

import asyncio

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
    TextWorldConfig,
    guarded,
    make_env,
)
from compactrl.envs import textworld_env as tw_env
from compactrl.envs.textworld_env import TextWorldEnv, game_command, game_path, match_command
from compactrl.models.tiny import write_tiny_model

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


class Broken:
    name = "broken"

    def reset(self, seed):
        return {"task": "not a Reset"}


def test_malformed_env_output_is_an_env_error():
    with pytest.raises(EnvError, match="expected Reset"):
        asyncio.run(guarded(Broken(), "reset", 0, 1.0))
