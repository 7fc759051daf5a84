"""Advantages: group and leave-one-out baselines for outcome rewards, GAE with a critic, and
cross-segment GAE for compacted rollouts.

Token-level GAE runs over the policy's own (trainable) tokens only: environment and prompt tokens
are not actions, so the recursion skips them, and the value that bootstraps the last token of a
turn is the value at the first action token of the next turn.

A compacted rollout in ``reprefill`` mode is several segments, each its own forward (and its own
critic values). *Cross-segment* GAE (CompactionRL) runs the recursion over the whole rollout,
across compaction boundaries, rather than restarting it in each segment:

* ``exact``: concatenate the segments' action steps in rollout order and run one recursion; by
  construction it equals GAE on the uncompacted trajectory with the same values and rewards.
* ``parallel``: each segment runs its own recursion (independently, so in parallel), bootstrapping
  its last step from the next segment's first value; the lambda-tail beyond the boundary is cut,
  which is exact for lambda = 0 and an approximation otherwise.

A stream-mode rollout is one trace and one forward, so plain GAE over it is already exact.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
):
    """GRPO: reward minus its group's mean (rollouts of one prompt share a group id), optionally
    divided by the group's standard deviation."""
    rewards = rewards.double()
    ids, inv = torch.unique(groups, return_inverse=True)
    n = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inv, torch.ones_like(rewards))
    mean = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inv, rewards) / n
    adv = rewards - mean[inv]
    if normalize_std:
        var = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inv, adv**2) / (n - 1).clamp_min(1)
        adv = adv / (var.sqrt()[inv] + eps)
    return adv.float()


def loo_advantages(rewards: torch.Tensor, chance: float | None = None) -> torch.Tensor:
    """Batch-wide leave-one-out: reward minus the mean of every *other* reward in the batch.

    When every reward is equal the leave-one-out advantages are all zero and the batch teaches
    nothing; with ``chance`` (the success rate of guessing, e.g. 1/5 for the five-way recall task),
    such a batch is scored against chance instead (our reading of KV-streams appendix D.3): all
    right is better than chance, all wrong worse.
    """
    rewards = rewards.double()
    n = len(rewards)
    if n < 2:
        raise ValueError("leave-one-out needs at least two rollouts in the batch")
    if chance is not None and bool((rewards == rewards[0]).all()):
        return (rewards - chance).float()
    return (rewards - (rewards.sum() - rewards) / (n - 1)).float()


def discounts(trainable: list[np.ndarray], gamma: float) -> list[np.ndarray]:
    """Per trace of one rollout (in order), ``gamma ** n`` at each action token, ``n`` being the
    rollout's action tokens after it: an outcome advantage broadcast with these weights is
    REINFORCE with a discounted return and baseline (credit fades with distance from the end)."""
    after = 0
    out = []
    for m in reversed(trainable):
        later = np.cumsum(m[::-1])[::-1] - m + after  # action tokens after each position
        out.append(np.where(m, gamma ** later.astype(np.float64), 0.0).astype(np.float32))
        after += int(m.sum())
    return out[::-1]


def fork_discounts(trainable: list[np.ndarray], forks: list[tuple[int, int]], gamma: float) -> list[float]:
    """Per auxiliary thread forked at ``(trace, index)`` of a rollout whose main traces have these
    ``trainable`` masks, ``gamma ** n``, ``n`` being the main thread's action tokens from the fork on:
    a thread's answer acts from its fork, so its tokens get the credit an action there would."""
    after = [int(m.sum()) for m in trainable]
    return [float(gamma ** (int(trainable[k][b:].sum()) + sum(after[k + 1 :]))) for k, b in forks]


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95,
        bootstrap: float | torch.Tensor = 0.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Advantages and returns over a sequence of steps (``[S]``), as cleanrl's ppo.py does;
    ``bootstrap`` is the value after the last step (0 at the end of an episode)."""
    S = len(rewards)
    adv = torch.zeros(S, dtype=torch.float64)
    next_value = torch.as_tensor(bootstrap, dtype=torch.float64)
    last = torch.zeros((), dtype=torch.float64)
    r, v = rewards.double(), values.double()
    for t in range(S - 1, -1, -1):
        delta = r[t] + gamma * next_value - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_value = v[t]
    return adv.float(), (adv + v).float()


def token_gae(rewards, values, steps, gamma: float = 1.0, lam: float = 0.95):
    """GAE over the tokens where ``steps`` (bool ``[T]``) is set; zeros elsewhere."""
    idx = torch.nonzero(steps, as_tuple=True)[0]
    adv = torch.zeros(len(steps))
    ret = torch.zeros(len(steps))
    if len(idx):
        a, r = gae(rewards[idx], values[idx], gamma, lam)
        adv[idx], ret[idx] = a, r
    return adv, ret


def cross_segment_gae(
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    gamma: float = 1.0,
    lam: float = 0.95,
    form: Literal["exact", "parallel"] = "exact",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per segment ``(rewards, values, steps)`` over its tokens, in rollout order -> per segment
    ``(advantages, returns)`` over its tokens. See the module docstring for the two forms."""
    if form not in ("exact", "parallel"):
        raise ValueError(f"form must be 'exact' or 'parallel', got {form!r}")
    idx = [torch.nonzero(s, as_tuple=True)[0] for _, _, s in segments]
    out = [(torch.zeros(len(s)), torch.zeros(len(s))) for _, _, s in segments]
    if form == "exact":
        r = torch.cat([seg[0][i] for seg, i in zip(segments, idx, strict=True)])
        v = torch.cat([seg[1][i] for seg, i in zip(segments, idx, strict=True)])
        a, ret = gae(r, v, gamma, lam)
        at = 0
        for (adv_k, ret_k), i in zip(out, idx, strict=True):
            adv_k[i], ret_k[i] = a[at : at + len(i)], ret[at : at + len(i)]
            at += len(i)
        return out
    firsts = [seg[1][i[0]] if len(i) else None for seg, i in zip(segments, idx, strict=True)]
    for k, ((rk, vk, _), i) in enumerate(zip(segments, idx, strict=True)):
        if not len(i):
            continue
        nxt = next((f for f in firsts[k + 1 :] if f is not None), 0.0)  # the next segment's first value
        a, ret = gae(rk[i], vk[i], gamma, lam, bootstrap=nxt)
        out[k][0][i], out[k][1][i] = a, ret
    return out
