"""One optimizer step on a batch of traces: log-probs, loss, gradient accumulation, AdamW.

A batch is a list of :class:`Sample` (a trace plus per-token advantages). Stream traces are one
forward each under their eviction masks; re-prefill segments are ordinary traces (one sample per
segment). Samples are packed into micro-batches of at most ``micro_batch_tokens`` tokens, each
one forward and one backward; the per-token weights of the chosen normalisation are computed
over the whole batch first, so accumulating micro-batches gives exactly the full-batch gradient.

Before the update, the trainer's log-probs of the sampled tokens are compared with the engine's
sampling log-probs: ``mismatch_kl`` (k3 estimate of KL(sampler || trainer)) and
``mismatch_max_abs`` are ~0 in float32 stream mode, and grow with weight staleness.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from compactrl.engine.linear import has_native_low_precision_matmul
from compactrl.masks import pack_greedy, streams
from compactrl.models.decoder import CausalLM
from compactrl.models.lora import LoraSettings, add_lora, has_lora
from compactrl.rl.forward import Backend, full_context, stream_logprobs, stream_topk
from compactrl.rl.losses import Norm, pg_per_token, topk_kl
from compactrl.trace import Trace


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: Literal["pg", "sft", "distill"] = Field(
        "pg",
        description="a Trainer's default loss; `compactrl train` picks each step's from `objective` "
        "(rl: pg, rft and sft: sft, distill: distill)",
    )
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(
        1e-8,
        gt=0,
        description="AdamW's epsilon; raising it towards the gradients' scale damps the lr-sized "
        "steps Adam takes on parameters whose gradients are small and noisy",
    )
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm (None: no clipping)")
    micro_batch_tokens: int = Field(8192, ge=1, description="tokens per forward/backward")
    splice_forks: bool = Field(
        True,
        description="SideQuest: feed each auxiliary thread's own tokens inside its main trace's stream "
        "(one forward, the prefix once); false: each fork is a forward over its whole prefix (the "
        "baseline `bench train-step` measures the splice against; the same log-probs)",
    )
    norm: Norm = Field(
        "token",
        description="how per-token losses are reduced — token: over every trained token of the batch "
        "(CompactionRL); sequence: per rollout, then over rollouts (GRPO); constant: sum / norm_constant",
    )
    norm_constant: float | None = Field(None, gt=0, description="the constant of norm = 'constant'")
    clip_low: float = Field(0.2, ge=0, description="PPO clips the probability ratio below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="PPO clips the probability ratio above at 1 + clip_high")
    max_log_ratio: float | None = Field(None, gt=0, description="drop tokens whose |log ratio| exceeds it")
    kl_sampling: float = Field(0.0, ge=0, description="coefficient of the KL to the sampling policy")
    entropy_coef: float = Field(0.0, ge=0, description="pg: bonus on the policy's entropy at its tokens")
    kl_ref: float = Field(0.0, ge=0, description="weight of the KL to the frozen reference (pg, distill)")
    kl_ref_estimator: Literal["k3", "topk"] = Field(
        "k3",
        description="pg: k3 — KL(policy || reference) estimated on the sampled tokens (GRPO's); topk — "
        "KL(reference || policy) over the reference's top distill_top_k tokens (and one bin for the rest) "
        "at every policy token, which also pulls back tokens the policy has collapsed onto",
    )
    distill_top_k: int = Field(
        16,
        ge=1,
        description="the top-k tokens of the distill teacher or the topk reference that the KL covers",
    )
    value_coef: float = Field(0.5, ge=0, description="weight of the critic's loss (when there is one)")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value clipping around the old values")
    backend: Backend = Field(
        "chunked",
        description="attention of the training forward — chunked (CPU), flex (CUDA: a flex-attention "
        "block mask from evict_at) or dense (the T^2 reference)",
    )
    precision: Literal["float32", "bfloat16"] = Field(
        "float32", description="bfloat16: autocast forward/backward (engine/trainer mismatch grows)"
    )
    lora: LoraSettings | None = Field(None, description="train LoRA adapters (peft) on a frozen base")


@dataclass
class Sample:
    trace: Trace
    advantages: np.ndarray  # float [T]; used where the trace is trainable
    sequence: int = 0  # the rollout it belongs to (segments of one rollout share it)
    returns: np.ndarray | None = None  # critic targets [T] (PPO), with the values at sampling time
    old_values: np.ndarray | None = None


def token_weights(samples: list[Sample], norm: Norm, constant: float | None = None) -> list[np.ndarray]:
    """Per-token weights of the batch loss ``sum(w * loss_token)`` for each normalisation."""
    masks = [s.trace.trainable.astype(np.float64) for s in samples]
    if norm == "token":
        total = max(sum(m.sum() for m in masks), 1.0)
        return [m / total for m in masks]
    if norm == "constant":
        if not constant:
            raise ValueError("norm = 'constant' needs norm_constant > 0")
        return [m / constant for m in masks]
    if norm == "sequence":
        per_seq: dict[int, float] = {}
        for s, m in zip(samples, masks, strict=True):
            per_seq[s.sequence] = per_seq.get(s.sequence, 0.0) + m.sum()
        live = [k for k, n in per_seq.items() if n > 0]
        return [m / (per_seq[s.sequence] * len(live)) if per_seq[s.sequence] else m
                for s, m in zip(samples, masks, strict=True)]  # fmt: skip
    raise ValueError(f"norm must be one of token, sequence, constant; got {norm!r}")


class Trainer:
    """Trains the policy and, when given a ``value_head``, the critic on the same backbone."""

    def __init__(self, model: CausalLM, settings: TrainSettings, value_head: torch.nn.Module | None = None,
                 reference: CausalLM | None = None, temperature: float = 1.0):  # fmt: skip
        """``temperature``: the rollouts' sampling temperature; the policy trained is the tempered one."""
        if not temperature > 0:
            raise ValueError(f"training needs a temperature > 0 (greedy has no gradient); got {temperature}")
        self.temperature = temperature
        device = next(model.parameters()).device
        if settings.precision == "bfloat16" and not has_native_low_precision_matmul(device):
            warnings.warn(
                "train.precision = 'bfloat16' on a CPU without bfloat16 dot products (AVX512-BF16 or "
                "AMX): its bfloat16 GEMMs are 1.6 to 7 times slower than float32 there, and round; "
                "train.precision = 'float32' is faster on this machine and exact",
                stacklevel=2,
            )
        if settings.lora is not None and not has_lora(model):
            add_lora(model, settings.lora)
        self.model, self.settings, self.value_head, self.reference = model, settings, value_head, reference
        self.group = None  # a torch.distributed group when this is one of several data-parallel ranks
        heads = list(value_head.parameters()) if value_head is not None else []
        self.params = [p for p in model.parameters() if p.requires_grad] + heads
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.lr,
            betas=(settings.beta1, settings.beta2),
            eps=settings.eps,
            weight_decay=settings.weight_decay,
        )

    def _autocast(self, s: TrainSettings):
        """bfloat16 compute for the policy forward and backward; weights and AdamW stay float32."""
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=torch.bfloat16, enabled=s.precision == "bfloat16")

    def micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        """Sample indices per micro-batch; an auxiliary thread's trace goes with its main trace's
        (one stream in the forward, :func:`compactrl.masks.streams`)."""
        ss = streams([s.trace for s in samples], self.settings.splice_forks)
        rows = pack_greedy(ss, self.settings.micro_batch_tokens)
        return [[k for j in row for k in ss[j].members] for row in rows]

    def step(self, samples: list[Sample], loss: Literal["pg", "sft", "distill"] | None = None) -> dict:
        """One optimizer step (``loss`` overrides the settings' for this step, e.g. an SFT warm-up
        sharing the optimizer); returns loss, gradient norm and diagnostics."""
        (stats,), extra = self.step_parts([(samples, loss, 1.0)])
        return stats | extra

    def step_parts(self, parts: list[tuple[list[Sample], str | None, float]]) -> tuple[list[dict], dict]:
        """One optimizer step on a sum of losses, ``scale * loss(samples)`` per part, each normalised
        over its own samples (SideQuest: CE on auxiliary samples + lambda * KL on the main traces);
        returns each part's stats, and the gradient norm and time."""
        if not all(samples for samples, _, _ in parts):
            raise ValueError("a training step needs at least one sample")
        t0 = time.perf_counter()
        sums, norm = self.step_share(parts)
        return [finish(x) for x in sums], {"grad_norm": norm, "train_s": time.perf_counter() - t0}

    def step_share(self, parts: list[tuple[list[Sample], str | None, float]],
                   weights: list[list[np.ndarray]] | None = None) -> tuple[list[dict], float]:  # fmt: skip
        """Accumulate each part's gradient, sum it over the data-parallel ranks (``self.group``, a
        torch.distributed group; None: this process alone), clip, step. ``weights``: each part's
        per-token loss weights, computed over the whole batch when this is one rank's share of it
        (parts may then be empty here). Returns each part's raw sums (:func:`finish` makes stats).

        On a data-parallel rank a failure is raised only after every rank has said whether its share
        failed (:func:`_agree`): no rank then waits in a gradient all-reduce that another never
        reaches, and no rank steps; the ranks whose share did not fail raise :class:`PeerFailed`."""
        sums, error = [], None
        try:
            for k, (samples, loss, scale) in enumerate(parts):
                w = None if weights is None else weights[k]
                sums.append(self._accumulate(samples, loss, scale, k == 0, w))
        except Exception as e:
            if self.group is None:
                raise
            error = e
        if self.group is not None:
            try:
                _agree(error, self.params[0].device, self.group)
            except Exception:
                self.optimizer.zero_grad(set_to_none=True)  # the failed step's partial gradient
                raise
            _all_reduce_grads(self.params, self.group)
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.settings.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        self.optimizer.step()
        return sums, float(norm)

    def backward(self, samples: list[Sample], loss: Literal["pg", "sft", "distill"] | None = None,
                 scale: float = 1.0, zero: bool = True) -> dict:  # fmt: skip
        """Accumulate ``scale`` times the batch's gradient (micro-batch by micro-batch) into ``.grad``,
        after zeroing it unless ``zero`` is False."""
        if not samples:
            raise ValueError("a training step needs at least one sample")
        return finish(self._accumulate(samples, loss, scale, zero))

    def _accumulate(self, samples: list[Sample], loss: str | None, scale: float, zero: bool,
                    weights: list[np.ndarray] | None = None) -> dict:  # fmt: skip
        """:meth:`backward`'s work; ``weights`` (default: this batch's normalisation) may come from a
        larger batch this is a share of. Returns sums, which add up over shares."""
        s = self.settings if loss is None else self.settings.model_copy(update={"loss": loss})
        use_ref = s.kl_ref > 0 and s.loss != "sft"  # it anchors policy updates, not SFT on demos
        anchor = use_ref and s.loss == "pg" and s.kl_ref_estimator == "topk"
        if use_ref and self.reference is None:
            raise ValueError("kl_ref > 0 needs a reference model: Trainer(..., reference=frozen copy)")
        self.model.train()
        if weights is None:
            weights = token_weights(samples, s.norm, s.norm_constant)
        if zero:
            self.optimizer.zero_grad(set_to_none=True)
        total_loss, n_tok, clipped, masked, kl_sum, max_abs, value_sum, ref_kl = 0, 0, 0, 0, 0, 0, 0, 0.0
        entropy_sum = 0.0
        for mb in self.micro_batches(samples):
            traces = [samples[k].trace for k in mb]
            critic = self.value_head if samples[mb[0]].returns is not None else None
            fwd = dict(backend=s.backend, max_row_tokens=s.micro_batch_tokens, splice_forks=s.splice_forks)
            candidates = teacher = None
            if s.loss == "distill":  # the model with full context teaches the evicted view: the frozen
                # reference when there is one (a teacher sharing the student's weights drifts with it)
                teach = self.reference if self.reference is not None else self.model
                views = [full_context(t) for t in traces]
                teacher = stream_topk(teach, views, s.distill_top_k, temperature=self.temperature, **fwd)
            elif anchor:  # the reference reads the same (evicted) view as the policy
                teacher = stream_topk(
                    self.reference, traces, s.distill_top_k, temperature=self.temperature, **fwd
                )
            if teacher is not None:
                candidates = [torch.cat([torch.as_tensor(t.tokens)[:, None], ids.cpu()], 1)
                              for t, (ids, _) in zip(traces, teacher, strict=True)]  # fmt: skip
            bonus = s.entropy_coef > 0 and s.loss == "pg"
            if candidates is None:  # the loss reads trained tokens only: the head runs on those alone
                fwd["wanted"] = [t.trainable for t in traces]
            with self._autocast(s):
                out = stream_logprobs(self.model, traces, value_head=critic, candidates=candidates,
                                      temperature=self.temperature, entropy=bonus, **fwd)  # fmt: skip
            cols, values = out if critic is not None else (out, [None] * len(mb))
            if bonus:  # the last column: the entropy of the distribution each token was drawn from
                entropies, cols = [c[:, -1] for c in cols], [c[:, :-1] for c in cols]
            if candidates is not None:  # column 0 is the trace's own token, the rest the teacher's
                student = [c[:, 1:] for c in cols]
            logps = [c[:, 0] if c.dim() == 2 else c for c in cols]
            if use_ref and not anchor:
                with torch.no_grad():
                    ref_logps = stream_logprobs(self.reference, traces, temperature=self.temperature, **fwd)
            loss = logps[0].new_zeros(())
            for j, (k, lp, v) in enumerate(zip(mb, logps, values, strict=True)):
                t = samples[k].trace
                m = torch.as_tensor(t.trainable)
                if not m.any():
                    continue
                w = torch.as_tensor(weights[k], dtype=lp.dtype)
                old = torch.as_tensor(np.nan_to_num(t.logprobs), dtype=lp.dtype)
                if teacher is not None:  # both at the rollouts' temperature
                    kl_top = topk_kl(teacher[j][1].to(lp.device), student[j])
                if s.loss == "sft":
                    per_token, keep, adv = -lp, m, torch.zeros_like(lp)
                elif s.loss == "distill":
                    per_token, keep, adv = kl_top, m, torch.zeros_like(lp)
                else:
                    adv = torch.as_tensor(samples[k].advantages, dtype=lp.dtype)
                    per_token, keep = pg_per_token(lp, old, adv, m, s.clip_low, s.clip_high, s.max_log_ratio)
                loss = loss + (per_token * w * keep).sum()
                if v is not None:
                    ret = torch.as_tensor(samples[k].returns, dtype=v.dtype)
                    old_v = torch.as_tensor(samples[k].old_values, dtype=v.dtype)
                    err = (v - ret) ** 2
                    if s.value_clip is not None:
                        clipped_v = old_v + (v - old_v).clamp(-s.value_clip, s.value_clip)
                        err = torch.maximum(err, (clipped_v - ret) ** 2)
                    value_sum = value_sum + float((0.5 * err * w * m).sum().detach())
                    loss = loss + s.value_coef * (0.5 * err * w * m).sum()
                d = (old - lp)[m]
                k3 = torch.exp(-d) + d - 1  # KL(sampler || trainer), k3 estimate, per token
                if s.kl_sampling:
                    loss = loss + s.kl_sampling * (k3 * w[m]).sum()
                if bonus:
                    h = entropies[j]
                    loss = loss - s.entropy_coef * (h * w * m).sum()
                    entropy_sum += float(h.detach()[m].sum())
                if anchor:
                    loss = loss + s.kl_ref * (kl_top * w * m).sum()
                    ref_kl += float(kl_top.detach()[m].sum())
                elif use_ref:
                    r = (ref_logps[j] - lp)[m]
                    ref_k3 = torch.exp(r) - r - 1  # KL(policy || reference), k3 on sampled tokens
                    loss = loss + s.kl_ref * (ref_k3 * w[m]).sum()
                    ref_kl += float(ref_k3.detach().sum())
                with torch.no_grad():
                    n_tok += int(m.sum())
                    dd = d.double()  # float64: float32 rounding makes tiny k3 values negative
                    kl_sum += float((torch.exp(-dd) + dd - 1).sum())
                    max_abs = max(max_abs, float(d.abs().max()))
                    ratio = torch.exp(lp - old)[m]
                    a = adv[m]
                    out = ((ratio < 1 - s.clip_low) & (a < 0)) | ((ratio > 1 + s.clip_high) & (a > 0))
                    clipped += float(out.sum())
                    masked += float((m & ~keep).sum())
            if loss.requires_grad:
                (loss * scale).backward()
            total_loss += float(loss.detach())
        self.model.eval()
        return {"loss": total_loss, "trained_tokens": n_tok, "kl_sum": kl_sum, "mismatch_max_abs": max_abs,
                "clipped": clipped, "masked": masked, "value_loss": value_sum, "ref_kl_sum": ref_kl,
                "entropy_sum": entropy_sum}  # fmt: skip


def finish(sums: dict) -> dict:
    """A step's statistics from its (possibly rank-summed: :func:`add_sums`) raw sums."""
    n = max(sums["trained_tokens"], 1)
    return {
        "loss": sums["loss"],
        "trained_tokens": sums["trained_tokens"],
        "mismatch_kl": sums["kl_sum"] / n,
        "mismatch_max_abs": sums["mismatch_max_abs"],
        "clip_fraction": sums["clipped"] / n,
        "masked_fraction": sums["masked"] / n,
        "value_loss": sums["value_loss"],
        "ref_kl": sums["ref_kl_sum"] / n,
        "entropy": sums["entropy_sum"] / n,  # at the policy's tokens, when the bonus is on
    }


def add_sums(a: dict, b: dict) -> dict:
    """Two shares' raw sums as one batch's (the max stays a max)."""
    return {k: max(a[k], b[k]) if k == "mismatch_max_abs" else a[k] + b[k] for k in a}


class PeerFailed(RuntimeError):
    """Another data-parallel rank's share of this step failed; no rank took the step."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"data-parallel rank(s) {ranks} failed this step; no rank took it")
        self.ranks = ranks


class DataParallelError(RuntimeError):
    """A data-parallel step failed on one or more ranks (``failed``: rank -> cause); no rank took it."""

    def __init__(self, failed: dict[int, str]) -> None:
        causes = "; ".join(f"rank {r}: {c}" for r, c in sorted(failed.items()))
        super().__init__(
            f"the data-parallel training step failed on {causes}. No rank took the step; fix the cause "
            "and continue the run from its newest checkpoint with --resume"
        )
        self.failed = failed


def _agree(error: Exception | None, device: torch.device, group) -> None:
    """Every rank says whether its share failed (one all-reduce of a flag per rank) before any
    gradient is reduced. Raises the rank's own ``error``, or :class:`PeerFailed` when another failed."""
    import torch.distributed as dist

    flags = torch.zeros(dist.get_world_size(group), device=device)
    flags[dist.get_rank(group)] = float(error is not None)
    dist.all_reduce(flags, group=group)
    if error is not None:
        raise error
    failed = flags.nonzero().flatten().tolist()
    if failed:
        raise PeerFailed(failed)


def _all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the gradients over the ranks in one flat buffer (a rank whose share trained nothing adds
    zeros), so every rank holds the whole batch's gradient and takes the same step."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
