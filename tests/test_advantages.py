"""Advantages and losses: closed forms, invariants and negative controls."""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from compactrl.rl.advantages import (
    cross_segment_gae,
    discounts,
    gae,
    group_advantages,
    loo_advantages,
    token_gae,
)
from compactrl.rl.losses import kl_penalty, normalise, policy_loss, sft_loss, topk_kl, value_loss


def reference_gae(r, v, gamma, lam):
    """Straight from the definition: A_t = sum_l (gamma lam)^l delta_{t+l}."""
    r, v = np.asarray(r, float), np.asarray(v, float)
    nxt = np.append(v[1:], 0.0)
    delta = r + gamma * nxt - v
    return np.array(
        [sum((gamma * lam) ** k * delta[t + k] for k in range(len(r) - t)) for t in range(len(r))]
    )


@given(
    st.lists(st.tuples(st.floats(-2, 2), st.floats(-2, 2)), min_size=1, max_size=30),
    st.sampled_from([1.0, 0.99]),
    st.sampled_from([0.0, 0.9, 1.0]),
)
@settings(max_examples=50, deadline=None)
def test_gae_matches_its_definition(steps, gamma, lam):
    r, v = (torch.tensor([s[i] for s in steps]) for i in (0, 1))
    adv, ret = gae(r, v, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), reference_gae(r, v, gamma, lam), atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), (adv + v).numpy(), atol=1e-6)


def split_rollout(T, cuts, seed):
    """A rollout of T tokens with random action steps and rewards, cut into segments."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.rand(T, generator=g) < 0.6
    rewards = torch.where(steps & (torch.rand(T, generator=g) < 0.2), torch.randn(T, generator=g), 0.0)
    values = torch.randn(T, generator=g)
    bounds = [0, *cuts, T]
    segs = [(rewards[a:b], values[a:b], steps[a:b]) for a, b in zip(bounds, bounds[1:])]
    return rewards, values, steps, segs


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
def test_exact_cross_segment_gae_equals_gae_on_the_uncompacted_trajectory(lam):
    rewards, values, steps, segs = split_rollout(200, [37, 90, 151], seed=1)
    whole, whole_ret = token_gae(rewards, values, steps, 0.99, lam)
    parts = cross_segment_gae(segs, 0.99, lam, "exact")
    torch.testing.assert_close(torch.cat([a for a, _ in parts]), whole)
    torch.testing.assert_close(torch.cat([r for _, r in parts]), whole_ret)


def loop_cross_segment_gae(segments, gamma, lam, form):
    """Cross-segment GAE as its docstring states it, in plain Python floats (no torch, no `gae`).
    The steps are the action tokens (``steps`` set), in rollout order: segment by segment, token by
    token; rewards and values elsewhere are not read. exact: one recursion over all of them, 0 after
    the last. parallel: one recursion per segment, its last step bootstrapped from the first action
    value of the next segment that has one (0 if none). Advantages and returns (A + V) at action
    tokens, 0 elsewhere."""
    rows = [([float(x) for x in r], [float(x) for x in v], [bool(x) for x in s]) for r, v, s in segments]
    actions = [(k, i) for k, (_, _, s) in enumerate(rows) for i in range(len(s)) if s[i]]
    adv = [[0.0] * len(s) for _, _, s in rows]
    ret = [[0.0] * len(s) for _, _, s in rows]
    chains = [actions] if form == "exact" else [[a for a in actions if a[0] == k] for k in range(len(rows))]
    for chain in chains:
        if not chain:
            continue
        later = [(k, i) for k, i in actions if k > chain[-1][0]]
        next_value = rows[later[0][0]][1][later[0][1]] if later else 0.0  # exact: nothing is later
        a = 0.0
        for k, i in reversed(chain):
            r, v = rows[k][0][i], rows[k][1][i]
            a = r + gamma * next_value - v + gamma * lam * a  # delta_t + gamma lam A_{t+1}
            adv[k][i], ret[k][i] = a, a + v
            next_value = v
    return adv, ret


@given(
    st.integers(1, 60),
    st.lists(st.integers(0, 60), max_size=4),
    st.integers(0, 2**16),
    st.sampled_from([1.0, 0.9]),
    st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    st.sampled_from(["exact", "parallel"]),
)
# segment 1 empty, segment 2 without an action token, between segments with actions
@example(T=30, cuts=[10, 10, 12, 20], seed=1, gamma=1.0, lam=0.95, form="parallel")
@example(T=30, cuts=[10, 10, 12, 20], seed=1, gamma=0.9, lam=0.5, form="exact")
@settings(max_examples=60, deadline=None)
def test_cross_segment_gae_equals_an_independent_recursion(T, cuts, seed, gamma, lam, form):
    """Random splits, including empty segments and segments without an action token (the chain
    and the bootstrap run past them), and rewards/values on non-action tokens that must be ignored.
    Breaks if segments are joined out of order, a non-action value bootstraps a step, results land
    at the wrong tokens, returns are not A + V, or a form bootstraps from the wrong segment."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.rand(T, generator=g) < 0.5
    rewards, values = torch.randn(T, generator=g), torch.randn(T, generator=g)
    bounds = [0, *sorted(min(c, T) for c in cuts), T]
    segs = [(rewards[a:b], values[a:b], steps[a:b]) for a, b in zip(bounds, bounds[1:])]
    got = cross_segment_gae(segs, gamma, lam, form)
    adv, ret = loop_cross_segment_gae(segs, gamma, lam, form)
    for (a, r), a_ref, r_ref in zip(got, adv, ret, strict=True):
        np.testing.assert_allclose(a.numpy(), a_ref, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(r.numpy(), r_ref, atol=1e-4, rtol=1e-5)


def test_exact_cross_segment_gae_is_not_per_segment_gae():
    """Negative control for the recursion above: the same loop restarted in each segment (no
    bootstrap, no lambda-tail across a compaction) is a different answer, at every lambda."""
    _, _, _, segs = split_rollout(200, [37, 90, 151], seed=4)
    for lam in (0.0, 0.95):
        exact = np.concatenate(loop_cross_segment_gae(segs, 0.99, lam, "exact")[0])
        alone = np.concatenate([loop_cross_segment_gae([s], 0.99, lam, "exact")[0][0] for s in segs])
        got = torch.cat([a for a, _ in cross_segment_gae(segs, 0.99, lam, "exact")]).numpy()
        np.testing.assert_allclose(got, exact, atol=1e-4)
        assert np.abs(alone - got).max() > 0.1, lam


def test_parallel_form_is_exact_at_lambda_zero_and_approximate_beyond():
    rewards, values, steps, segs = split_rollout(200, [37, 90, 151], seed=2)
    exact = torch.cat([a for a, _ in cross_segment_gae(segs, 1.0, 0.0, "exact")])
    par = torch.cat([a for a, _ in cross_segment_gae(segs, 1.0, 0.0, "parallel")])
    torch.testing.assert_close(par, exact)
    exact = torch.cat([a for a, _ in cross_segment_gae(segs, 1.0, 0.95, "exact")])
    par = torch.cat([a for a, _ in cross_segment_gae(segs, 1.0, 0.95, "parallel")])
    assert (par - exact).abs().max() > 1e-3  # the cut lambda-tail matters
    # ... but the last segment has no tail to cut, and per-segment GAE (no bootstrap) is worse still
    torch.testing.assert_close(par[-(200 - 151) :], exact[-(200 - 151) :])
    naive = torch.cat([token_gae(r, v, s, 1.0, 0.95)[0] for r, v, s in segs])
    assert (naive - exact).abs().sum() > (par - exact).abs().sum()


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_discounted_outcome_credit_is_gae_of_a_final_reward_without_a_critic(gamma):
    """An outcome advantage times ``discounts`` = GAE (lambda 1, zero values) of that advantage
    paid at the rollout's last action token, across segments as over the whole trajectory."""
    _, _, steps, segs = split_rollout(200, [37, 90, 151], seed=3)
    final = torch.zeros(200)
    final[torch.nonzero(steps)[-1]] = 1.0
    expected, _ = token_gae(final, torch.zeros(200), steps, gamma, 1.0)
    got = discounts([s.numpy() for _, _, s in segs], gamma)
    np.testing.assert_allclose(np.concatenate(got), expected.numpy(), rtol=1e-5, atol=1e-7)
    assert np.all(np.concatenate(got)[~steps.numpy()] == 0)  # only actions get credit
    if gamma < 1:  # the first action gets less than the last (negative control for a no-op)
        first = np.concatenate(got)[steps.numpy()]
        assert first[0] < first[-1] == 1.0


def test_group_and_leave_one_out_baselines():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(r, g, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0]))
    z = group_advantages(r, g)
    assert abs(float(z[:3].std()) - 1) < 1e-3 and torch.all(z[3:] == 0)
    loo = loo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(loo, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    assert torch.all(loo_advantages(torch.zeros(4)) == 0)  # no signal without the fallback
    torch.testing.assert_close(loo_advantages(torch.zeros(4), chance=0.2), torch.full((4,), -0.2))
    torch.testing.assert_close(loo_advantages(torch.ones(4), chance=0.2), torch.full((4,), 0.8))


def test_policy_loss_clips_and_masks():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.5, 0.9, 0.1, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    mask = torch.tensor([True, True, True, False])
    loss, stats = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # ratios 1, 1.8 (clipped to 1.2 with A>0), 0.2 (clipped to 0.8 with A<0)
    assert math.isclose(loss.item(), -(1.0 + 1.2 - 0.8) / 3, rel_tol=1e-6)
    assert math.isclose(stats["clip_fraction"], 2 / 3, rel_tol=1e-6)
    loss.backward()
    assert new.grad[1] == 0 and new.grad[2] == 0 and new.grad[0] != 0 and new.grad[3] == 0
    loss2, stats2 = policy_loss(new, old, adv, mask, max_log_ratio=0.5)
    assert math.isclose(stats2["masked_fraction"], 2 / 3, rel_tol=1e-6)  # |log 1.8|, |log 0.2| > 0.5
    assert math.isclose(loss2.item(), -1.0, rel_tol=1e-6)


def test_normalisations_weigh_long_sequences_differently():
    per_token = torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0])
    mask = torch.ones(5, dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 0, 1])  # a long and a short sequence
    assert math.isclose(float(normalise(per_token, mask, "token")), 7 / 5, rel_tol=1e-6)
    assert math.isclose(float(normalise(per_token, mask, "sequence", seq)), (1 + 3) / 2, rel_tol=1e-6)
    assert math.isclose(float(normalise(per_token, mask, "constant", constant=10)), 0.7, rel_tol=1e-6)
    with pytest.raises(ValueError, match="seq_ids"):
        normalise(per_token, mask, "sequence")


def test_kl_value_and_sft_losses():
    lp = torch.log(torch.tensor([0.5, 0.25]))
    mask = torch.ones(2, dtype=torch.bool)
    assert float(kl_penalty(lp, lp, mask)) == 0.0
    assert float(kl_penalty(lp, lp - 0.3, mask)) > 0
    v = torch.tensor([0.0, 1.0])
    assert math.isclose(
        float(value_loss(v, v, torch.tensor([1.0, 1.0]), mask, clip=None)), 0.25, rel_tol=1e-6
    )
    # clipped: the value may not move more than 0.2 from the old one to earn the lower error
    assert math.isclose(
        float(value_loss(torch.tensor([1.0, 1.0]), v, torch.tensor([1.0, 1.0]), mask)), 0.16, rel_tol=1e-6
    )
    assert math.isclose(float(sft_loss(lp, mask)), -float(lp.mean()), rel_tol=1e-6)


def test_topk_kl_is_a_coarse_grained_kl():
    """Top-k plus a rest bin: 0 when the distributions agree (renormalising the teacher alone
    would not be), <= the full KL, equal to it at k = vocabulary, and it sees mass moved outside."""
    g = torch.Generator().manual_seed(0)
    p, q = (torch.log_softmax(2 * torch.randn(6, 50, generator=g, dtype=torch.float64), -1) for _ in range(2))
    full = (p.exp() * (p - q)).sum(-1)
    ids = p.topk(8, -1).indices
    assert torch.allclose(topk_kl(p.gather(-1, ids), p.gather(-1, ids)), torch.zeros(6, dtype=torch.float64))
    renormalised = torch.log_softmax(p.gather(-1, ids), -1)
    assert (renormalised.exp() * (renormalised - p.gather(-1, ids))).sum(-1).min() > 1e-3  # the old bias
    part = topk_kl(p.gather(-1, ids), q.gather(-1, ids))
    assert torch.all(part <= full + 1e-12) and torch.all(part > 0)
    every = p.topk(50, -1).indices
    torch.testing.assert_close(topk_kl(p.gather(-1, every), q.gather(-1, every)), full)
    outside = q.clone()  # the student moves mass onto a token outside the teacher's top-8
    outside[:, p.argmin(-1)[0]] += 3
    outside = torch.log_softmax(outside, -1)
    assert torch.all(topk_kl(p.gather(-1, ids), outside.gather(-1, ids)) > part)


def test_a_forks_discount_counts_the_main_threads_action_tokens_from_it_on_across_segments():
    from compactrl.rl.advantages import fork_discounts

    seg0, seg1 = np.array([0, 1, 1, 0, 1], bool), np.array([0, 0, 1, 1], bool)
    got = fork_discounts([seg0, seg1], [(0, 0), (0, 3), (1, 3), (1, 4)], 0.5)
    assert got == [0.5**5, 0.5**3, 0.5**1, 1.0]
    assert fork_discounts([seg0, seg1], [(0, 2)], 1.0) == [1.0]
