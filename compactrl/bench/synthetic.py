"""Synthetic multi-turn rollouts with a compaction schedule, for trainer benchmarks.

The shape: a protected system prompt, then turns of ``turn_len`` tokens (a user part, then a
trainable assistant part). Whenever the next turn would overflow the budget ``B`` the
strategy compacts:

* ``sliding_window``: evict the oldest turn (keep all but one turn);
* ``markovian``: evict the oldest turns until the newest half of the budget is left;
* ``summary``: append a trainable summary, then evict every turn and earlier summary.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from compactrl.trace import Trace

Strategy = Literal["sliding_window", "markovian", "summary"]
STRATEGIES: tuple[Strategy, ...] = ("sliding_window", "markovian", "summary")


def check_shape(
    strategy: str, budget: int, turn_len: int, system_len: int = 128, summary_len: int = 64
) -> None:
    """Refuse shapes whose schedule would degenerate, before any work starts."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
    # after a compaction there must be room for a turn (and, for summary, the summary and the next one)
    if system_len + turn_len + (2 * summary_len if strategy == "summary" else 0) > budget:
        raise ValueError(
            f"budget {budget} is too small for {strategy}: it must hold the system prompt ({system_len}), "
            f"a turn ({turn_len})"
            + (f" and two summaries ({summary_len} each)" if strategy == "summary" else "")
        )


def synthetic_rollout(
    strategy: Strategy,
    n_tokens: int,
    *,
    budget: int = 1024,
    turn_len: int = 128,
    system_len: int = 128,
    summary_len: int = 64,
    vocab_size: int = 2048,
    seed: int = 0,
) -> Trace:
    """A stream of exactly ``n_tokens`` tokens whose live context never exceeds ``budget``."""
    check_shape(strategy, budget, turn_len, system_len, summary_len)
    rng = np.random.default_rng(seed)
    T = n_tokens
    evict_at = np.full(T, T, dtype=np.int64)
    trainable = np.zeros(T, dtype=bool)
    role = ["system"] * T
    turn = np.zeros(T, dtype=np.int32)
    segment = np.zeros(T, dtype=np.int32)
    live: list[tuple[int, int]] = []  # (start, end) of live turns and summaries, oldest first
    pos, k, seg = system_len, 1, 0  # turn 0 is the system prompt
    user_len = max(1, turn_len // 4)

    def live_size() -> int:
        return system_len + sum(b - a for a, b in live)

    def evict(spans: list[tuple[int, int]], at: int) -> None:
        nonlocal seg
        for a, b in spans:
            evict_at[a:b] = at
            live.remove((a, b))
        seg += 1

    room = turn_len + (summary_len if strategy == "summary" else 0)  # the summary must fit too
    while pos < T:
        if live_size() + room > budget:
            if strategy == "sliding_window":
                evict(live[:1], pos)
            elif strategy == "markovian":
                drop = []
                while live_size() - sum(b - a for a, b in drop) > budget // 2:
                    drop.append(live[len(drop)])
                evict(drop, pos)
            else:
                end = min(pos + summary_len, T)
                trainable[pos:end] = True
                role[pos:end] = ["summary"] * (end - pos)
                turn[pos:end], segment[pos:end] = k, seg
                old = list(live)
                live.append((pos, end))
                pos = end
                k += 1
                if pos >= T:
                    break
                evict(old, pos)
        end = min(pos + turn_len, T)
        role[pos : min(pos + user_len, end)] = ["user"] * (min(pos + user_len, end) - pos)
        role[pos + user_len : end] = ["assistant"] * max(0, end - pos - user_len)
        trainable[pos + user_len : end] = True
        turn[pos:end], segment[pos:end] = k, seg
        live.append((pos, end))
        pos, k = end, k + 1
    return Trace.from_tokens(
        rng.integers(0, vocab_size, T),
        evict_at=evict_at,
        trainable=trainable,
        turn=turn,
        role=role,
        segment=segment,
        rollout_id=f"synthetic-{strategy}-{seed}",
        meta={"strategy": strategy, "budget": budget, "turn_len": turn_len, "system_len": system_len},
    )


def kept_per_compaction(trace: Trace) -> list[int]:
    """``r_k``: tokens still live right after each eviction (what re-prefill feeds again)."""
    return [int((trace.evict_at[:e] > e).sum()) for e, _ in trace.eviction_events()]
