"""Token sampling for the engine: temperature -> top-k -> top-p, per-request seeds, exact log-probs.

The trainer recomputes log-probs and compares them with ``SampleOutput.logprobs``, so those are
the log-probs of the distribution actually sampled from (after truncation and renormalisation).
Greedy rows (temperature 0) report the log-prob under the *untempered* model distribution,
because a greedy policy's trainer recompute uses temperature 1.

Sampling inverts the CDF with one uniform number per row drawn from that row's own generator
(float64 cumulative sums), so a seeded request gets the same token whatever else is in the
batch, and a step costs one random number per row rather than V. Ties (top-k cut, top-p cut,
argmax) go to the lower token id: the sort is stable and ``argmax`` returns the first maximum.

Rows without top-k / top-p truncation (and steps that ask no top log-probs) are sampled on a CPU
by ``sampling.c``: the same float64 arithmetic in passes over the float32 logits, without the
float64 ``[B, V]`` copies the torch path makes (a tenth of a decode step at batch 32 on
SmolLM2's 49,152-token vocabulary); the torch path does the rest, and anything without a C compiler.
"""

from __future__ import annotations

import ctypes
import math
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pydantic
import torch

from compactrl.engine.kernels import compile_c, traced


class SamplingParams(pydantic.BaseModel):
    """Per-request sampling settings (immutable, unknown fields rejected)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stop: list[str] = []
    model_logprobs: bool = False
    top_logprobs: int = pydantic.Field(0, ge=0, le=20, description="also report this many most likely "
                                       "tokens per step, with log-probs under the distribution sampled from")
    # teacher forcing: emit exactly these tokens (a demonstration), each scored as if sampled (its
    # log-prob under this distribution), so a demonstrated trace is checked like a sampled one
    forced: list[int] = []

    @pydantic.field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {v}")
        return v

    @pydantic.field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {v}")
        return v

    @pydantic.field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @pydantic.field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {v}")
        return v

    @pydantic.field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {v}")
        return v

    @pydantic.model_validator(mode="after")
    def _forced(self) -> SamplingParams:
        if len(self.forced) > self.max_tokens or any(t < 0 for t in self.forced):
            raise ValueError(f"forced needs at most max_tokens ({self.max_tokens}) token ids >= 0, "
                             f"got {len(self.forced)}")  # fmt: skip
        return self

    @pydantic.field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty (an empty string would match at once)")
        return v


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # long [B]
    logprobs: torch.Tensor  # float64 [B], under the distribution sampled from
    model_logprobs: torch.Tensor | None  # float64 [B], log_softmax(raw logits); None if no row asked
    top: list[list[tuple[int, float]]] | None = None  # per row its top_logprobs (token, log-prob), best first


def make_generator(seed: int | None) -> random.Random | None:
    """A seeded generator for one request; None (torch's global RNG) when the request has no seed.

    A step draws one uniform number per row, so a plain Python generator does it without a tensor
    call per row, and its state pickles with a checkpoint.
    """
    return None if seed is None else random.Random(seed)


def find_stop(text: str, stops: list[str]) -> int | None:
    """End index of the stop string occurrence that completes first in ``text``, or None."""
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return min(ends) if ends else None


def _truncated_logprobs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probs after top-k then top-p, renormalised; dropped tokens get -inf. One sort for all rows."""
    V = scaled.shape[-1]
    s, idx = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=scaled.device)
    s = s.masked_fill(rank >= top_k[:, None], -math.inf)
    probs = s.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly ahead of each token in sorted order
    # keep the smallest prefix reaching top_p; top_p == 1 means off (cumsum rounding must not cut the tail)
    s = s.masked_fill((before >= top_p[:, None]) & (top_p[:, None] < 1), -math.inf)
    return torch.full_like(scaled, -math.inf).scatter(-1, idx, s.log_softmax(-1))


@cache
def load_sampling_kernel() -> ctypes.CDLL | str:
    """``sampling.c`` compiled, or the reason it is not (no C compiler, a failed build)."""
    P, I, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    args = [P, I64, I, I64, P, P, P, P, P, P, P, I]
    return compile_c(Path(__file__).with_name("sampling.c"), {"sample_rows": (args, None)})


def _uniforms(greedy: list[bool], generators: list[random.Random | None]) -> list[float]:
    """One uniform per row from its own generator (torch's global RNG for rows without one), 0 for greedy."""
    unseeded = iter(torch.rand(sum(g is None for g in generators), dtype=torch.float64).tolist())
    return [0.0 if gr else (g.random() if g else next(unseeded)) for gr, g in zip(greedy, generators)]


class Sampler:
    """Samples one token per row. Stateless: each request owns its generator (see ``make_generator``).
    ``kernel``: sample untruncated rows with ``sampling.c`` where it builds (module docstring)."""

    def __init__(self, kernel: bool = True):
        lib = load_sampling_kernel() if kernel else "not asked"
        self.kernel = None if isinstance(lib, str) else lib.sample_rows

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[random.Random | None],
        forced: list[int | None] | None = None,
    ) -> SampleOutput:
        """``forced``: per row a token to emit instead of a draw (teacher forcing), or None."""
        B, V = logits.shape
        assert len(params) == B and len(generators) == B, "one SamplingParams and generator per row"
        temps = [p.temperature for p in params]
        greedy = [t == 0 for t in temps]
        trunc = [b for b, p in enumerate(params) if not greedy[b] and (0 < p.top_k < V or p.top_p < 1)]
        plain = not trunc and not any(p.top_logprobs for p in params) and self.kernel is not None
        if plain and logits.device.type == "cpu" and logits.dtype == torch.float32:
            return self._sample_kernel(logits, params, generators, forced, temps, greedy)
        # float64: over a real vocabulary (49k) a float32 log-softmax alone is off by ~3e-5 nats, which
        # would hide the engine/trainer agreement (sampling.c does the same sums without B x V copies)
        logits = logits.double()
        dev = logits.device
        model_lp = logits.log_softmax(-1)
        # greedy rows keep the argmax and its untempered log-prob (temperature 1 in what follows)
        if all(t in (0.0, 1.0) for t in temps) and not trunc:
            lp = model_lp  # every row samples the model's own distribution: nothing to recompute
        else:
            scale = torch.tensor([t or 1.0 for t in temps], dtype=torch.float64, device=dev)[:, None]
            lp = (logits / scale).log_softmax(-1)
            if trunc:
                r = torch.tensor(trunc, device=dev)
                k = torch.tensor([min(params[b].top_k or V, V) for b in trunc], device=dev)
                p = torch.tensor([params[b].top_p for b in trunc], device=dev)
                lp[r] = _truncated_logprobs(logits[r] / scale[r], k, p)

        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            # inverse CDF with one uniform per row from the row's own generator: reproducible whatever
            # else is in the batch, and V times fewer random numbers than Gumbel noise
            cdf = lp.exp().cumsum(-1)
            target = torch.tensor(_uniforms(greedy, generators), dtype=torch.float64, device=dev) * cdf[:, -1]
            # first index whose cdf exceeds the target: never a probability-0 token (a flat cdf step)
            tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp_max(V - 1)
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=dev), logits.argmax(-1), tokens)
        if forced is not None and any(f is not None for f in forced):
            force = torch.tensor([f is not None for f in forced], device=dev)
            tokens = torch.where(force, torch.tensor([f or 0 for f in forced], device=dev), tokens)
        logprobs = lp.gather(-1, tokens[:, None]).squeeze(-1)
        want_model = any(p.model_logprobs for p in params)
        model_out = model_lp.gather(-1, tokens[:, None]).squeeze(-1) if want_model else None
        top = None
        if k := max(p.top_logprobs for p in params):
            vals, ids = lp.topk(k, dim=-1)
            top = [list(zip(i[: p.top_logprobs], v[: p.top_logprobs], strict=True)) for p, i, v in
                   zip(params, ids.tolist(), vals.tolist(), strict=True)]  # fmt: skip
        return SampleOutput(tokens=tokens, logprobs=logprobs, model_logprobs=model_out, top=top)

    def _sample_kernel(self, logits, params, generators, forced, temps, greedy) -> SampleOutput:
        """The untruncated rows' draw and log-probs by ``sampling.c`` (same numbers as the torch path)."""
        B, V = logits.shape
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        u = torch.tensor(_uniforms(greedy, generators) if not all(greedy) else [0.0] * B, dtype=torch.float64)
        temp = torch.tensor([t or 1.0 for t in temps], dtype=torch.float64)
        is_greedy = torch.tensor(greedy, dtype=torch.uint8)
        force = torch.tensor([-1 if f is None else f for f in forced or [None] * B], dtype=torch.int64)
        tokens, lp, model_lp = torch.empty(B, dtype=torch.int64), *torch.empty(2, B, dtype=torch.float64)
        ins = [t.data_ptr() for t in (temp, is_greedy, u, force)]
        outs = [t.data_ptr() for t in (tokens, lp, model_lp)]
        args = logits.data_ptr(), logits.stride(0), B, V, *ins, *outs, torch.get_num_threads()
        traced("compactrl::sample_rows", self.kernel, *args)
        want_model = any(p.model_logprobs for p in params)
        return SampleOutput(tokens=tokens, logprobs=lp, model_logprobs=model_lp if want_model else None)
