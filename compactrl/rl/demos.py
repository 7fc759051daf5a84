"""Demonstration traces for supervised warm-ups: episodes whose actions are the right answers.

An environment that can say what a correct action is (``demo_action``) is played with those
actions and rendered exactly as the rollout runner renders episodes (:mod:`compactrl.agent.chat`),
so SFT trains on the token layout RL will sample. The actions are trainable; with ``evict``,
the steps the strategy would delete are evicted in the trace at the same boundary as in a
stream rollout, so SFT runs under the eviction mask (the KV-streams recall study's "SFT under
eviction" arm); without, the model learns the format with full context.
"""

from __future__ import annotations

import numpy as np

from compactrl.agent.chat import ChatFormat
from compactrl.trace import Trace


def demo_trace(
    fmt: ChatFormat,
    env,
    seed: int,
    evict_steps: dict[int, list[int]] | None = None,
    system: str | None = None,
) -> Trace:
    """One demonstration episode. ``evict_steps`` maps an action number to the step indices
    deleted right after that action (before the reply is fed), as the ``evict_steps`` strategy does;
    ``system`` overrides the env's system prompt, as the run's ``rollout.system`` does in rollouts."""
    reset = env.demo_reset(seed) if hasattr(env, "demo_reset") else env.reset(seed)
    chat = fmt.conversation()
    tokens: list[int] = []
    trainable: list[bool] = []
    roles: list[str] = []
    turns: list[int] = []
    spans: dict[int, list[tuple[int, int]]] = {}  # step index -> its spans
    evict_at = {}

    def add(toks, role, train=False, step=None, turn=None):
        if step is not None:
            spans.setdefault(step, []).append((len(tokens), len(tokens) + len(toks)))
        turns.extend([len(chat.messages) - 1 if turn is None else turn] * len(toks))
        tokens.extend(toks)
        trainable.extend([train] * len(toks))
        roles.extend([role] * len(toks))

    system = system if system is not None else reset.system
    if system:
        add(chat.message("system", system), "system")
    add(chat.message("user", reset.task), "user")
    step = 0
    if reset.observation:
        obs = reset.observation
        if reset.observation_variants:  # padded as the rollout runner pads it
            obs = chat.padded("user", obs, reset.observation_variants)
        add(chat.message("user", obs), "user", step=0)
    while True:
        step += 1
        action = env.demo_action()
        turn = len(chat.messages)
        add(chat.prompt(), "assistant", step=step, turn=turn)
        content = fmt.tokenizer.encode(action) + [fmt.stop_ids[0]]
        add(content, "assistant", train=True, step=step, turn=turn)
        add(chat.close(content), "assistant", step=step, turn=turn)
        out = env.step(action)
        if out.done:
            break
        for s in (evict_steps or {}).get(step, []):
            for a, b in spans.get(s, []):
                for j in range(a, b):
                    evict_at[j] = len(tokens)
        add(chat.message("user", out.observation), "user", step=step)
    T = len(tokens)
    ev = np.full(T, T, dtype=np.int64)
    for j, e in evict_at.items():
        ev[j] = e
    return Trace.from_tokens(tokens, evict_at=ev, trainable=np.array(trainable), role=roles, turn=turns,
                             logprobs=np.where(trainable, 0.0, np.nan),
                             rollout_id=f"demo-{env.name}-{seed}", meta={"demo": True})  # fmt: skip
