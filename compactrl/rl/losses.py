"""Per-token losses and how they are normalised.

Every loss takes per-token tensors over the batch's tokens (a packed row or a concatenation of
traces) and a ``mask`` of the tokens it applies to, and returns a scalar plus statistics. The
normalisation is a choice with consequences for long rollouts:

* ``token`` — sum over every masked token of the batch / their number (CompactionRL's
  token-level normalisation: a token weighs the same whether its rollout is long or short);
* ``sequence`` — mean over each sequence's tokens, then mean over sequences (GRPO's original:
  tokens of long rollouts weigh less);
* ``constant`` — sum / a fixed constant (Dr. GRPO-style: no length bias, batch-size stable).
"""

from __future__ import annotations

from typing import Literal

import torch

Norm = Literal["token", "sequence", "constant"]


def normalise(per_token: torch.Tensor, mask: torch.Tensor, norm: Norm = "token", seq_ids=None,
              constant: float | None = None) -> torch.Tensor:  # fmt: skip
    """Reduce a per-token loss over ``mask`` as ``norm`` says (``seq_ids`` for ``sequence``)."""
    m = mask.to(per_token.dtype)
    if norm == "token":
        return (per_token * m).sum() / m.sum().clamp_min(1)
    if norm == "constant":
        if not constant or constant <= 0:
            raise ValueError("norm='constant' needs constant > 0 (e.g. the max tokens per batch)")
        return (per_token * m).sum() / constant
    if norm == "sequence":
        if seq_ids is None:
            raise ValueError("norm='sequence' needs seq_ids (the sequence of each token)")
        ids, inv = torch.unique(seq_ids, return_inverse=True)
        tot = torch.zeros(len(ids), dtype=per_token.dtype, device=per_token.device).index_add(
            0, inv, per_token * m
        )
        cnt = torch.zeros(len(ids), dtype=per_token.dtype, device=per_token.device).index_add(0, inv, m)
        has = cnt > 0
        return (tot[has] / cnt[has]).mean() if has.any() else per_token.sum() * 0
    raise ValueError(f"norm must be one of token, sequence, constant; got {norm!r}")


def pg_per_token(logp, old_logp, adv, mask, clip_low: float = 0.2, clip_high: float = 0.2,
                 max_log_ratio: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """PPO's clipped surrogate per token, and the tokens it applies to: ``mask`` minus those whose
    importance ratio moved further than ``max_log_ratio`` from 1 in log space."""
    log_ratio = logp - old_logp
    keep = mask.bool()
    if max_log_ratio is not None:
        keep = keep & (log_ratio.detach().abs() <= max_log_ratio)
    ratio = torch.exp(log_ratio)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv), keep


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    max_log_ratio: float | None = None,
    norm: Norm = "token",
    seq_ids=None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """The clipped policy-gradient loss with the importance ratio to the sampling log-probs (which
    also corrects rollouts sampled by stale weights), reduced as ``norm`` says, with statistics."""
    per_token, keep = pg_per_token(logp, old_logp, adv, mask, clip_low, clip_high, max_log_ratio)
    loss = normalise(per_token, keep, norm, seq_ids, constant)
    with torch.no_grad():
        m = mask.bool()
        n = m.sum().clamp_min(1)
        log_ratio = logp - old_logp
        ratio = torch.exp(log_ratio)
        out = (ratio < 1 - clip_low) & (adv < 0) | (ratio > 1 + clip_high) & (adv > 0)
        stats = {
            "clip_fraction": float((out & m).sum() / n),
            "masked_fraction": float((m & ~keep).sum() / n),
            "approx_kl": float((((ratio - 1) - log_ratio) * m).sum() / n),  # k3 estimate of KL(old || new)
        }
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, norm: Norm = "token",
               seq_ids=None, constant: float | None = None) -> torch.Tensor:  # fmt: skip
    """k3 estimator of KL(policy || ref) on sampled tokens: exp(ref - logp) - (ref - logp) - 1,
    unbiased and never negative (Schulman); ``ref_logp`` is the sampling or a reference model's."""
    d = ref_logp - logp
    return normalise(torch.exp(d) - d - 1, mask, norm, seq_ids, constant)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2, norm: Norm = "token", seq_ids=None,
               constant: float | None = None) -> torch.Tensor:  # fmt: skip
    """Half squared error to the returns, PPO-clipped around the values at sampling time."""
    err = (values - returns) ** 2
    if clip is not None:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (v_clipped - returns) ** 2)
    return 0.5 * normalise(err, mask, norm, seq_ids, constant)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, norm: Norm = "token", seq_ids=None,
             constant: float | None = None) -> torch.Tensor:  # fmt: skip
    """Negative log-likelihood of the target tokens (SFT; RFT is SFT on the rewarded rollouts)."""
    return normalise(-logp, mask, norm, seq_ids, constant)


def topk_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, tiny: float = 1e-12) -> torch.Tensor:
    """KL(teacher || student) per position over the teacher's top-k tokens plus one bin for all
    the others (``[..., k]`` log-probs of the same tokens under each): zero when they agree,
    never above the full KL (a coarse-graining), equal to it when k covers the vocabulary, and,
    through the last bin, it sees mass the student moved outside the teacher's top-k."""
    p_rest = (1 - teacher_logp.exp().sum(-1)).clamp_min(0)
    q_rest = (1 - student_logp.exp().sum(-1)).clamp_min(tiny)
    top = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    return top + p_rest * (p_rest.clamp_min(tiny).log() - q_rest.log())
