"""One Llama / Qwen2 / Qwen3 decoder in plain PyTorch, with Hugging Face parameter names.

The math follows transformers op for op (float32 RoPE and RMSNorm, SDPA with GQA) so logits
match it to float rounding. Attention takes whatever mask form the caller built from
``evict_at`` (see :mod:`compactrl.masks`): None (causal), a dense bool mask, a
:class:`~compactrl.masks.ChunkedMask` (CPU training), or a flex ``BlockMask`` (CUDA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from compactrl.models.attention import attend
from compactrl.models.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused kernel, same math
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scale)`` for every RoPE type, computed as transformers 5.24 does;
    cos and sin are multiplied by ``attention_scale`` (YaRN's magnitude correction, else 1)."""
    base = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / base
    if rope.rope_type == "linear":
        return inv / rope.factor, 1.0
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, base)
    return inv, 1.0


def _yarn(rope: RopeConfig, head_dim: int, base: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times are kept, and a
    linear ramp blends the dimensions between; cos/sin are scaled by the attention factor."""
    factor, old = rope.factor, rope.original_max_position_embeddings

    def magnitude(m: float) -> float:  # 1 + 0.1 m ln(factor), 1 when the context is not extended
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if rope.attention_factor is not None:
        scale = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        scale = float(magnitude(rope.mscale) / magnitude(rope.mscale_all_dim))
    else:
        scale = magnitude(1)

    def dim_at(turns: float) -> float:  # the (fractional) dimension whose frequency turns `turns` times
        return (head_dim * math.log(old / (turns * 2 * math.pi))) / (2 * math.log(rope.theta))

    lo, hi = dim_at(rope.beta_fast or 32), dim_at(rope.beta_slow or 1)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original (unscaled) frequency
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep, scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v as ``[B, heads, T, head_dim]`` with RoPE applied: what a KV cache stores."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=b)
        self.up_proj = nn.Linear(d, f, bias=b)
        self.down_proj = nn.Linear(f, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``model.*`` backbone + ``lm_head``, named as in the HF checkpoints so state dicts load strictly."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self._rope: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, head_dim]`` in float32 (times YaRN's attention scale), cast to the
        activation dtype (as transformers). Every forward path (model, engine, trainer) uses this."""
        cached = self._rope.get(positions.device)
        if cached is None:  # computed once per device (it is a function of the config alone)
            inv, scale = rope_frequencies(self.config.rope, self.config.head_dim)
            cached = self._rope[positions.device] = (inv.to(positions.device), scale)
        inv, scale = cached
        freqs = positions[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, mask=None) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, d]``. ``positions`` are stream indices (never renumbered)."""
        if input_ids.dim() == 1:
            input_ids, positions = input_ids[None], positions[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask=None) -> torch.Tensor:
        """Logits ``[B, T, vocab]``; for long streams use :func:`token_logprobs` on hidden states."""
        return self.lm_head(self.hidden_states(input_ids, positions, mask))


def _logits(lm: CausalLM, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Next-token logits in float32 (float64 for a float64 model), divided by ``temperature``.
    A bfloat16/float16 model's head runs in float32 on its (exact) upcast weights, as the engine's
    does: rounded logits would move log-probs by up to ~0.06 nats (steps of 0.125 at a logit of 20).
    Under autocast too: the head of a float32 model trained in bfloat16 stays float32 (on SmolLM2
    that takes a third off the log-probs' distance from float32's, for a few percent of the step)."""
    head = lm.lm_head
    low = head.weight.dtype in (torch.bfloat16, torch.float16) and type(head) is nn.Linear
    with torch.autocast(hidden.device.type, enabled=False):
        if low:
            bias = None if head.bias is None else head.bias.float()
            logits = F.linear(hidden.float(), head.weight.float(), bias)
        else:
            logits = head(hidden.to(head.weight.dtype))
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return logits / temperature if temperature != 1.0 else logits


def token_logprobs(
    lm: CausalLM,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = 1024,
    temperature: float = 1.0,
    entropy: bool = False,
) -> torch.Tensor:
    """``log p(targets[n] | hidden[n])`` in float32 (float64 for a float64 model), ``chunk`` rows at a time.
    ``targets`` of shape ``[n, m]`` scores ``m`` candidate tokens per row (``[n, m]`` out). With a
    ``temperature`` it is ``softmax(logits / temperature)``, the distribution a tempered sampler drew from.
    ``entropy`` appends a column with the entropy of that distribution (``[n, 2]`` or ``[n, m + 1]``).

    Never holds more than a ``[chunk, vocab]`` float32 logits tensor: under autograd each chunk
    is recomputed in backward instead of stored.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(hidden.shape[0], -1) if targets.dim() == 2 else targets.reshape(-1)

    def one(h, t):
        logits = _logits(lm, h, temperature)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        lp = logits.gather(-1, t if t.dim() == 2 else t[:, None]) - lse
        if entropy:
            logp = logits - lse
            lp = torch.cat([lp, -(logp.exp() * logp).sum(-1, keepdim=True)], dim=-1)
        return lp if lp.shape[-1] > 1 or t.dim() == 2 else lp.squeeze(-1)

    outs = []
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], targets[s : s + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(torch.utils.checkpoint.checkpoint(one, h, t, use_reentrant=False))
        else:
            outs.append(one(h, t))
    if outs:
        return torch.cat(outs)
    columns = (targets.shape[1] if targets.dim() == 2 else 1) + 1
    return hidden.new_zeros((targets.shape[0], columns) if entropy else targets.shape, dtype=torch.float32)


@torch.no_grad()
def topk_logprobs(lm: CausalLM, hidden: torch.Tensor, k: int, chunk: int = 1024, temperature: float = 1.0):
    """The ``k`` most likely next tokens per row and their (tempered) log-probs (``[n, k]`` each)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    ids, lps = [], []
    for s in range(0, hidden.shape[0], chunk):
        logits = _logits(lm, hidden[s : s + chunk], temperature)
        top = logits.topk(min(k, logits.shape[-1]), dim=-1)
        ids.append(top.indices)
        lps.append(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
    return torch.cat(ids), torch.cat(lps)
