"""Token evictors: attention-score KV eviction inside the engine (H2O, SnapKV, R-KV, StreamingLLM,
TOVA, KNorm), as the KV-compression literature runs them at fixed token budgets, and random
eviction, the baseline a score has to beat.

An evictor is one small config, as a kvpress press is: a token ``budget``, a ``window`` of recent
tokens it never evicts, and ``layer_scores``: how much each live token matters to one layer, per KV
head. The engine (:mod:`compactrl.engine.evicting`) runs it for every session that has one, after a
prefill that leaves the session over budget and every ``interval`` decoded tokens, and evicts the
lowest-scoring unprotected tokens down to the budget. It keeps what a method needs (its last
queries, H2O's running sums) only for those sessions, so sessions without one decode as before.

**Eviction is per token**: one decision for all layers and heads, the per-head scores averaged
over KV heads and layers (query heads sharing a KV head are pooled first, as each method says).
That is what a stream's ``evict_at`` records and the trainer's mask replays (so a policy can be
trained under the very evictions it meets), and what a paged engine can free. The papers and
kvpress prune per head (or per layer); the per-head scores here are theirs, the kept set is not.

Attention weights are recomputed from the queries the engine kept (post-RoPE, as fed) and the
live keys, each query over the keys at or before its position. After earlier evictions that is
attention over the live cache: what the method would see online.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Annotated, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def _logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [W, H, D]``, ``k [Hkv, N, D]`` -> scaled scores ``[Hkv, G, W, N]`` (G query heads per KV head)."""
    W, H, D = q.shape
    Hkv = k.shape[0]
    qg = q.float().permute(1, 0, 2).reshape(Hkv, H // Hkv, W, D)
    return (qg @ k.float().transpose(-1, -2)[:, None]) * D**-0.5


def _causal(s: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Hide from each query the keys after it (``s [..., W, N]``)."""
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Each query's attention over the keys it sees, ``[Hkv, G, W, N]`` in float32."""
    return _causal(_logits(q, k), q_pos, k_pos).softmax(-1)


def _odd(kernel: int) -> int:
    """A centred pooling kernel (padding ``kernel // 2``) keeps one score per key only if it is odd;
    an even one would fail inside the engine's step, taking the whole batch down."""
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (got {kernel}); use {kernel - 1} or {kernel + 1}")
    return kernel


OddKernel = Annotated[int, AfterValidator(_odd)]


class _Evictor(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    budget: int = Field(..., gt=0, description="live tokens left after an eviction (protected ones included)")
    interval: int = Field(
        16, ge=1, description="decoded tokens between evictions (a prefill over budget is evicted at once)"
    )
    window: int = Field(
        8, ge=1, description="the most recent tokens, never evicted (SnapKV's and R-KV's observation window)"
    )
    protect_turn: bool = Field(
        True, description="never evict the current turn (the message being read or written)"
    )
    queries: ClassVar[int] = 0  # the method's recent queries the engine keeps (0: none)
    accumulates: ClassVar[bool] = False  # the method sums attention over every query (H2O)
    draws: ClassVar[bool] = False  # the method draws its scores (``draw``), reading no keys (random)

    @model_validator(mode="after")
    def _room(self):
        if self.window >= self.budget:
            raise ValueError(f"window {self.window} >= budget {self.budget}: the budget must leave room "
                             "beyond the protected window; raise budget or lower window")  # fmt: skip
        return self

    def layer_scores(self, q, q_pos, k, k_pos, acc) -> torch.Tensor:
        """Per-KV-head importance ``[Hkv, N]`` of the live keys ``k [Hkv, N, D]`` at stream positions
        ``k_pos``, from the kept queries ``q [W, H, D]`` at ``q_pos`` (and H2O's sums ``acc``)."""
        raise NotImplementedError


class StreamingLLM(_Evictor):
    """StreamingLLM (Xiao et al., 2023, arXiv:2309.17453): keep ``sinks`` attention-sink tokens at
    the start and the most recent ones; the oldest others go first. Needs no attention."""

    name: Literal["streamingllm"] = "streamingllm"
    sinks: int = Field(4, ge=0, description="first tokens of the stream, never evicted")

    def layer_scores(self, q, q_pos, k, k_pos, acc):
        score = k_pos.float().masked_fill(k_pos < self.sinks, float("inf"))
        return score[None].expand(k.shape[0], -1)


class KNorm(_Evictor):
    """KNorm (Devoto et al., 2024, arXiv:2406.11430): a low key norm predicts high attention, so the
    largest-norm keys go first (score ``-||k||``). Needs no attention."""

    name: Literal["knorm"] = "knorm"

    def layer_scores(self, q, q_pos, k, k_pos, acc):
        return -k.float().norm(dim=-1)


class TOVA(_Evictor):
    """TOVA (Oren et al., 2024, arXiv:2401.06104): the newest query's attention, averaged over all
    heads (one score per token per layer, as the paper and kvpress define it)."""

    name: Literal["tova"] = "tova"
    queries: ClassVar[int] = 1

    def layer_scores(self, q, q_pos, k, k_pos, acc):
        a = attention(q[-1:], q_pos[-1:], k, k_pos)[:, :, 0]  # [Hkv, G, N]
        return a.mean((0, 1))[None].expand(k.shape[0], -1)


class H2O(_Evictor):
    """H2O (Zhang et al., 2023, arXiv:2306.14048): heavy hitters, the keys with the largest attention
    accumulated over every query so far (prompt and decode), plus the recent ``window``; query heads
    sharing a KV head are averaged. ``average`` divides by the queries that could see each key
    (kvpress's ObservedAttention, H2O's prefill form there)."""

    name: Literal["h2o"] = "h2o"
    average: bool = Field(False, description="mean attention received instead of the sum (kvpress's form)")
    accumulates: ClassVar[bool] = True

    @staticmethod
    def received(q, q_pos, k, k_pos) -> torch.Tensor:
        """Attention each key received from these queries, summed, ``[Hkv, N]``."""
        return attention(q, q_pos, k, k_pos).sum(2).mean(1)

    def layer_scores(self, q, q_pos, k, k_pos, acc):
        return acc  # the engine divides by each key's query count when ``average``


class SnapKV(_Evictor):
    """SnapKV (Li et al., 2024, arXiv:2404.14469): the attention the last ``window`` queries (the
    observation window) pay each older key, averaged over them, smoothed by average pooling with
    ``kernel`` along the live keys, and averaged over the query heads of each KV head."""

    name: Literal["snapkv"] = "snapkv"
    kernel: OddKernel = Field(5, ge=1, description="pooling kernel along the keys (odd)")

    @property
    def queries(self) -> int:  # the observation window
        return self.window

    def layer_scores(self, q, q_pos, k, k_pos, acc):
        old = k_pos < q_pos[0]  # keys before the observation window
        a = attention(q, q_pos, k, k_pos)[..., old].mean(2)  # [Hkv, G, N_old]
        a = F.avg_pool1d(a.flatten(0, 1), self.kernel, 1, self.kernel // 2).view(a.shape).mean(1)
        out = torch.full((k.shape[0], k.shape[1]), float("inf"), device=k.device)
        out[:, old] = a
        return out


class RKV(_Evictor):
    """R-KV (Cai et al., 2025, arXiv:2505.24133), for reasoning traces: importance minus redundancy.
    Importance: the observation window's attention over the older keys (query heads max-pooled per
    KV head before the softmax, the softmax over the older keys only), averaged over the window and
    max-pooled with ``kernel``. Redundancy: each key's mean cosine similarity to the others (the
    diagonal zeroed; of every key's similar (> ``threshold``) keys the latest is not counted, so the
    newest copy survives), softmaxed over keys. Score ``mix * importance - (1 - mix) * redundancy``;
    defaults are the authors' code's."""

    name: Literal["rkv"] = "rkv"
    kernel: OddKernel = Field(7, ge=1, description="max-pooling kernel along the keys (odd)")
    mix: float = Field(0.07, ge=0, le=1, description="weight of importance against redundancy (lambda)")
    threshold: float = Field(0.5, description="cosine similarity above which two keys are redundant")

    @property
    def queries(self) -> int:
        return self.window

    def layer_scores(self, q, q_pos, k, k_pos, acc):
        old = k_pos < q_pos[0]
        s = _logits(q, k).amax(1)[..., old]  # [Hkv, W, N_old]
        imp = F.max_pool1d(s.softmax(-1).mean(1), self.kernel, 1, self.kernel // 2)
        kn = k.float() / (k.float().norm(dim=-1, keepdim=True) + 1e-8)
        sim = kn @ kn.transpose(-1, -2)
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        n = sim.shape[-1]
        cols = torch.arange(n, device=k.device).expand_as(sim)
        last = torch.where(sim > self.threshold, cols, torch.zeros_like(cols)).amax(-1)  # [Hkv, N]
        sim.scatter_(-1, last[..., None], 0.0)
        red = sim.mean(1).softmax(-1)
        out = torch.full((k.shape[0], n), float("inf"), device=k.device)
        out[:, old] = self.mix * imp - (1 - self.mix) * red[:, old]
        return out


class Random(_Evictor):
    """Random eviction, the baseline: the tokens evicted are drawn uniformly among the unprotected
    ones. The draw is a function of ``seed`` and the stream so far (its tokens, so its length), as
    the other methods' scores are of the stream: not of wall clock, of the session's id or of other
    sessions; it replays after a preemption, and two streams draw apart as soon as they differ
    (streams equal up to an eviction, e.g. a group's shared prompt, evict alike there)."""

    name: Literal["random"] = "random"
    seed: int = Field(0, ge=0, description="seeds the draws, with the stream so far (same seed and stream: "
                      "same evictions)")  # fmt: skip
    draws: ClassVar[bool] = True

    def draw(self, tokens: list[int], k_pos: torch.Tensor) -> torch.Tensor:
        """A uniform score per live key at stream positions ``k_pos`` (the lowest go first), from a
        generator on their device seeded by ``seed`` and the stream's ``tokens`` so far."""
        key = hashlib.blake2b(array("q", [self.seed, *tokens]).tobytes(), digest_size=8).digest()
        g = torch.Generator(k_pos.device).manual_seed(int.from_bytes(key, "little"))
        return torch.rand(len(k_pos), generator=g, device=k_pos.device)


def check_mode(evictor: _Evictor | None, mode: str) -> None:
    """A token evictor evicts in place: stream mode only (re-prefill would re-render the cache every
    ``interval`` tokens; full is the no-compaction baseline)."""
    if evictor is not None and mode != "stream":
        raise ValueError(f"evictor {evictor.name!r} runs in mode = 'stream' (in place), not {mode!r}; "
                         "set mode = 'stream' or remove [evictor]")  # fmt: skip


EvictorConfig = Annotated[
    StreamingLLM | KNorm | TOVA | H2O | SnapKV | RKV | Random, Field(discriminator="name")
]
EVICTORS = ("h2o", "snapkv", "rkv", "streamingllm", "tova", "knorm", "random")
