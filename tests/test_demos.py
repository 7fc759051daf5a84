"""Demonstration traces: the runner's exact token layout, and SFT that learns from them."""

import copy
import re

import numpy as np
import pytest
import torch
from conftest import recall_gap_lengths

from compactrl.agent.chat import ChatFormat
from compactrl.envs.count import CountEnv
from compactrl.envs.recall import VARIANTS, RecallEnv
from compactrl.envs.rooms import RoomsEnv
from compactrl.models.loading import load_model
from compactrl.models.tiny import write_tiny_model
from compactrl.models.tokenizer import Tokenizer
from compactrl.rl.demos import demo_trace
from compactrl.rl.forward import stream_logprobs
from compactrl.rl.trainer import Sample, Trainer, TrainSettings


def test_demos_are_correct_episodes():
    for env in (RecallEnv(k=16), RoomsEnv(n_rooms=3), CountEnv(turns=3)):
        env.reset(seed=4)
        total, done = 0.0, False
        while not done:
            out = env.step(env.demo_action())
            total, done = total + out.reward, out.done
        assert total == 1.0, env.name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_evicted_assignment_has_one_length_for_every_answer(tmp_path, variant):
    """Closes a side channel: unpadded, one fruit is one token and another two (and the start
    number 1-3), so the gap the eviction leaves in the positions would carry the answer."""
    fmt = ChatFormat.from_tokenizer(Tokenizer.from_dir(write_tiny_model(tmp_path / "m")))
    assert len(recall_gap_lengths(fmt, variant, padded=False)) > 1  # the channel exists
    assert len(recall_gap_lengths(fmt, variant)) == 1
    env = RecallEnv(k=16, variant=variant, prior_demos=0.5)
    lengths = set()
    for seed in range(12):  # demonstrations (some without the assignment) pad it the same way
        t = demo_trace(fmt, env, seed, evict_steps={1: [0]})
        lengths.add(int((t.evict_at < len(t)).sum()))
    assert lengths == recall_gap_lengths(fmt, variant)


def test_recall_demo_under_eviction_hides_the_assignment(tmp_path):
    fmt = ChatFormat.from_tokenizer(Tokenizer.from_dir(write_tiny_model(tmp_path / "m")))
    env = RecallEnv(k=16)
    full = demo_trace(fmt, env, seed=2)
    evicted = demo_trace(fmt, env, seed=2, evict_steps={1: [0]})
    assert np.array_equal(full.tokens, evicted.tokens) and full.num_evicted == 0
    gone = np.flatnonzero(evicted.evict_at < len(evicted))
    assert f"is {env.answer}." in fmt.tokenizer.decode(evicted.tokens[gone].tolist())
    answer = np.flatnonzero(evicted.trainable)[-3]  # inside "Recall: <fruit>"
    assert not np.isin(gone, evicted.visible(answer)).any() and np.isin(gone, full.visible(answer)).all()
    assert fmt.tokenizer.decode(full.tokens[full.trainable].tolist()).endswith(
        f"Recall: {env.answer}<|im_end|>"
    )


def test_sft_on_demos_raises_their_likelihood(tmp_path):
    folder = write_tiny_model(tmp_path / "m")
    model = load_model(folder)
    fmt = ChatFormat.from_tokenizer(Tokenizer.from_dir(folder))
    traces = [demo_trace(fmt, CountEnv(turns=3), seed=s) for s in range(4)]
    before = copy.deepcopy(model)
    trainer = Trainer(model, TrainSettings(loss="sft", lr=3e-3))
    for _ in range(5):
        trainer.step([Sample(t, np.zeros(len(t), np.float32), i) for i, t in enumerate(traces)])

    def nll(m):
        with torch.no_grad():
            return -sum(
                float(lp[torch.as_tensor(t.trainable)].sum())
                for t, lp in zip(traces, stream_logprobs(m, traces))
            )

    assert nll(model) < 0.7 * nll(before)


def play_demos(tmp_path, mode, strategy, seeds=(0, 1)):
    """Demonstration episodes played by the rollout runner (the env writes every answer)."""
    import asyncio

    from compactrl.agent.batch import run_episodes
    from compactrl.agent.rollout import RolloutSettings
    from compactrl.engine import Engine

    folder = tmp_path / "m"
    if not (folder / "config.json").exists():
        write_tiny_model(folder)
    tok = Tokenizer.from_dir(folder)
    engine, fmt = Engine(load_model(folder), tok), ChatFormat.from_tokenizer(tok)
    make = lambda: RoomsEnv(n_rooms=6, filler=2)  # noqa: E731
    settings = RolloutSettings(max_tokens=8)
    return fmt, asyncio.run(
        run_episodes(engine, fmt, make, strategy, mode, settings, list(seeds), 2, demo=True)
    )


def test_runner_demos_equal_the_full_context_demo_traces(tmp_path):
    """With full context the runner renders a demonstration token for token as demo_trace does,
    and the engine scores the teacher-forced tokens: the trainer's log-probs, not a placeholder."""
    fmt, results = play_demos(tmp_path, "full", None)
    model = load_model(tmp_path / "m")
    for r in results:
        (t,) = r.traces
        ref = demo_trace(fmt, RoomsEnv(n_rooms=6, filler=2), r.seed)
        assert np.array_equal(t.tokens, ref.tokens) and np.array_equal(t.trainable, ref.trainable)
        (lp,) = stream_logprobs(model, [t])
        assert (
            r.reward == 1.0
            and np.abs(lp.detach().double().numpy()[t.trainable] - t.logprobs[t.trainable]).max() < 5e-5
        )
        assert (t.logprobs[t.trainable] < -1).mean() > 0.5  # a random model finds the answers unlikely


def test_runner_demos_under_summary_compaction_stream_and_reprefill(tmp_path):
    """Under summary compaction the env writes each summary (one visible room's code word); the
    stream evicts the summarised rooms, re-prefill re-renders them away, and both train the same
    demonstrated tokens in the same order."""
    from compactrl.compaction import Summary, build_strategy

    strategy = build_strategy(Summary(trigger="every", every=3, tail=1, max_tokens=12))
    fmt, stream = play_demos(tmp_path, "stream", strategy)
    _, reprefill = play_demos(tmp_path, "reprefill", strategy)
    for s, r in zip(stream, reprefill, strict=True):
        assert s.reward == r.reward == 1.0 and s.compactions == r.compactions == 2
        (t,) = s.traces
        assert len(r.traces) == 3 and t.num_evicted > 0  # a segment per compaction
        taught = [fmt.tokenizer.decode(x.tokens[x.trainable].tolist()) for x in r.traces]
        assert fmt.tokenizer.decode(t.tokens[t.trainable].tolist()) == "".join(taught)
        role = np.array(t.role)
        summaries = fmt.tokenizer.decode(t.tokens[(role == "summary") & t.trainable].tolist())
        env = RoomsEnv(n_rooms=6, filler=2)
        env.reset(s.seed)
        said = re.findall(r"Room (\d): ([a-z]+)", summaries)
        assert len(said) == 2 and all(env.codes[int(k) - 1] == word for k, word in said)
        first = int(said[0][0])
        assert 1 <= first <= 4  # a room the context showed: rooms 1-3 and room 4, the newest
    from compactrl.compaction import PickTurns

    _, results = play_demos(tmp_path, "stream", build_strategy(PickTurns(trigger="every", every=3)))
    for r in results:  # fails its episode, recorded with its cause; the SFT step refuses such a batch
        assert r.non_completion == "error" and "no demonstration for the pick" in r.error
