"""The browse env: a generated world, multi-hop questions, search/open tools with cursors, the solver."""

import re

import pytest
from pydantic import TypeAdapter, ValidationError

from compactrl.envs import BrowseConfig, EnvConfig, make_env
from compactrl.envs.base import HELD_OUT_SEED
from compactrl.envs.browse import BrowseEnv, normalise, parse_call
from compactrl.envs.browse.world import HELD_OUT_ONSETS, TRAIN_ONSETS, build_world

HELD = [HELD_OUT_SEED + i for i in range(5)]


def finish(env: BrowseEnv, max_calls: int = 40):
    """The solver's calls from here to its answer: [(action, step)]."""
    steps = []
    for _ in range(max_calls):
        action = env.demo_action()
        steps.append((action, env.step(action)))
        if steps[-1][1].done:
            return steps
    raise AssertionError(f"the solver did not answer in {max_calls} calls")


def play(env: BrowseEnv, seed: int):
    """The solver's episode: (task, [(action, step)])."""
    return env.reset(seed).task, finish(env)


def test_world_and_question_are_deterministic_by_seed():
    a, b = build_world(7, 120), build_world(7, 120)
    assert [p.text for p in a.pages] == [p.text for p in b.pages]
    assert [p.text for p in build_world(8, 120).pages] != [p.text for p in a.pages]
    first, again = play(BrowseEnv(max_hops=6), 7), play(BrowseEnv(max_hops=6), 7)
    assert first[0] == again[0]
    assert [(act, s.observation) for act, s in first[1]] == [(act, s.observation) for act, s in again[1]]
    assert BrowseEnv().reset(7).task != BrowseEnv().reset(8).task


def test_train_and_held_out_questions_are_disjoint():
    env = BrowseEnv(min_hops=2, max_hops=6)
    train = {env.reset(s).task for s in range(80)}
    held = {env.reset(s).task for s in range(HELD_OUT_SEED, HELD_OUT_SEED + 80)}
    assert len(train) == len(held) == 80 and not train & held
    for seed, onsets in ((3, TRAIN_ONSETS), (HELD_OUT_SEED + 3, HELD_OUT_ONSETS)):  # why: names never shared
        assert all(e.name[0].lower() in onsets for e in build_world(seed, 120).entities)


@pytest.mark.parametrize("hops", [2, 3, 4, 5, 6])
def test_the_solver_answers_every_question_citing_its_support(hops):
    env = BrowseEnv(min_hops=hops, max_hops=hops)
    for seed in list(range(20)) + HELD:
        task, steps = play(env, seed)
        info = steps[-1][1].info
        assert steps[-1][1].reward == 1.0 and info["correct"], (seed, task, info)
        assert info["hops"] == hops and info["malformed_calls"] == 0
        assert len(info["support_cursors"]) == hops == len(env.question.support)  # it read every page
        last = {chain[-1] for chain in env.question.chains}  # and cites the pages stating the facts
        assert {env.outputs[c].page for c in info["cite"]} == last and set(info["cite"]) <= set(
            info["support_cursors"]
        )


def test_the_answer_is_not_in_the_task():
    env = BrowseEnv(min_hops=2, max_hops=6)
    for seed in list(range(100)) + HELD:
        task = f" {normalise(env.reset(seed).task)} "
        assert all(f" {a} " not in task for a in env.question.accept), (seed, task)
        assert env.question.answer not in task


def test_distractors_make_search_ambiguous_yet_the_solver_succeeds():
    env, missed, namesakes = BrowseEnv(min_hops=2, max_hops=4), 0, 0
    for seed in range(60):
        _, steps = play(env, seed)
        firsts = {c[0] for c in env.question.chains}
        for action, step in steps:
            if action.startswith("search"):
                top = env.outputs[step.info["cursor"]].links[0]
                missed += top not in firsts  # the best-ranked result is another page of a similar name
        assert steps[-1][1].info["correct"]
        namesakes += any("(" in p.title for p in env.corpus.world.pages)
    assert missed >= 3 and namesakes >= 10
    hits = env.corpus.search(env.corpus.world.entities[env.question.chains[0][0]].title.split()[0], 5)
    assert len(hits) >= 2  # a name's first word alone finds several pages


def test_bad_calls_get_error_observations_and_are_counted():
    env = BrowseEnv(min_hops=2, max_hops=2)
    env.reset(1)
    bad = {
        "search(": "malformed",
        "search()": "malformed",
        "search(42)": "malformed",
        'search("a", "b")': "malformed",
        'search(query="a", query="b")': "malformed",
        "open(cursor=0, id=1, x=2)": "malformed",
        "open(0, 1)": "unknown_cursor",  # no cursor yet
        'browse("x")': "unknown_tool",
        '__import__("os").system("echo hacked")': "malformed",
        'search(open("/etc/passwd"))': "malformed",
        "x" * 3000: "malformed",
        'answer("x", cite=[9])': "unknown_cursor",
        'answer("x", cite="0")': "malformed",
    }
    for action, kind in bad.items():
        step = env.step(action)
        assert step.observation.startswith("[Error] ") and "Syntax: search(" in step.observation, action
        assert not step.done and step.info["cursor"] is None and step.info["error"] == kind, action
    assert "there are no cursors yet" in env.step("open(0, 1)").observation
    first = env.step(env.demo_action())
    assert first.info["cursor"] == 0  # errors take no cursor id
    links = len(env.outputs[0].links)
    for action, kind, says in [
        (f"open(0, {links + 1})", "unknown_link", f"has no link {links + 1} (its links are 1-{links})"),
        ("open(cursor=3, id=1)", "unknown_cursor", "there is no cursor 3; the cursors are 0-0"),
        ("open(0, True)", "malformed", "open needs two integers"),
    ]:
        step = env.step(action)
        assert step.info["error"] == kind and says in step.observation, step.observation
    info = finish(env)[-1][1].info
    assert info["correct"] and info["malformed_calls"] == len(bad) + 4
    assert info["errors"]["unknown_cursor"] == 4 and info["errors"]["unknown_link"] == 1


def test_cursor_ids_count_tool_outputs_and_prefix_them():
    env = BrowseEnv(min_hops=5, max_hops=6)
    for seed in range(5):
        _, steps = play(env, seed)
        outputs = [(a, s) for a, s in steps if not s.done]
        assert [s.info["cursor"] for _, s in outputs] == list(range(len(outputs)))
        for action, step in outputs:
            c = int(re.match(r"\[Cursor (\d+)\] ", step.observation).group(1))
            assert c == step.info["cursor"]
            tool, args = parse_call(action)
            assert step.info["refs"] == ([args["cursor"]] if tool == "open" else [])
        assert steps[-1][1].info["refs"] == steps[-1][1].info["cite"]
    env.reset(0)
    env.step(env.demo_action())
    keyword = env.demo_action()
    assert re.fullmatch(r"open\(cursor=0, id=\d+\)", keyword)
    positional = keyword.replace("cursor=", "").replace("id=", "")
    assert (
        env.step(positional).observation.split("\n", 1)[1] == env.step(keyword).observation.split("\n", 1)[1]
    )


def test_answers_are_normalised_before_matching():
    assert normalise("  The Kugan  Lamp! ") == "kugan lamp"
    assert normalise("725,205") == "725205" and normalise("An apple, a day") == "apple day"
    env = BrowseEnv(min_hops=2, max_hops=2)
    env.reset(3)
    gold = env.question.answer
    assert env.step(f'answer("  the {gold.upper()}. ")').reward == 1.0
    env.reset(3)
    wrong = env.step(f'answer("{gold} x", cite=[])')
    assert (
        wrong.done and wrong.reward == 0.0 and not wrong.info["correct"] and wrong.info["said"] == f"{gold} x"
    )


def test_browse_config_builds_the_env():
    cfg = TypeAdapter(EnvConfig).validate_python(
        {"name": "browse", "min_hops": 3, "max_hops": 3, "system": ""}
    )
    env = make_env(cfg)
    assert isinstance(cfg, BrowseConfig) and isinstance(env, BrowseEnv)
    first = env.reset(5)
    assert first.system is None and first.max_tokens == cfg.action_tokens and env.question.hops == 3
    assert 'search("query")' in first.task and first.observation == ""
    assert make_env(BrowseConfig()).reset(5).system.startswith("You answer questions")
    with pytest.raises(ValidationError, match="min_hops"):
        BrowseConfig(min_hops=4, max_hops=3)


def test_calls_parse_from_many_threads_at_once():
    """Episodes run their env calls on a thread pool, and CPython 3.11's AST constructor can fail
    when parses race ("AST constructor recursion depth mismatch"; it ended demonstration episodes of
    tests/test_sidequest.py at random): calls parse alike from many threads."""
    from concurrent.futures import ThreadPoolExecutor

    calls = ['search("river castle")', "open(cursor=0, id=3)", 'answer("Lantern", cite=[1, 2])'] * 600
    with ThreadPoolExecutor(8) as pool:
        parsed = list(pool.map(parse_call, calls))
    assert parsed == [parse_call(c) for c in calls]
