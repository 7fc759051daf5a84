"""An independent oracle for the trainer forward: a token-by-token evicting KV cache.

It feeds one token at a time, keeps per-layer K/V for live tokens only and drops the entries
each eviction removes, exactly as an engine with in-place eviction does, but in the plainest
possible code. The one-pass masked forward must reproduce it.
"""

from __future__ import annotations

import numpy as np
import torch

from compactrl.models.attention import attend
from compactrl.models.decoder import CausalLM, _logits
from compactrl.trace import Trace


@torch.no_grad()
def incremental_logprobs(lm: CausalLM, trace: Trace) -> torch.Tensor:
    """``out[i] = log p(tokens[i] | live context when token i-1 was fed)``; ``out[0] = 0``."""
    device = next(lm.parameters()).device
    T = len(trace)
    tokens = torch.as_tensor(trace.tokens, device=device)
    cache: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in lm.model.layers]
    out = torch.zeros(T, dtype=torch.float64)
    for i in range(T):
        for layer_cache in cache:
            for j in [j for j in layer_cache if trace.evict_at[j] <= i]:
                del layer_cache[j]
        x = lm.model.embed_tokens(tokens[i : i + 1])[None]
        cos, sin = lm.rope(torch.tensor([[i]], device=device), x.dtype)
        for layer, layer_cache in zip(lm.model.layers, cache, strict=True):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
            layer_cache[i] = (k, v)
            keys = sorted(layer_cache)
            K = torch.cat([layer_cache[j][0] for j in keys], dim=2)
            V = torch.cat([layer_cache[j][1] for j in keys], dim=2)
            a = attend(q, K, V, torch.ones(1, len(keys), dtype=torch.bool, device=device))
            x = x + attn.o_proj(a.transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i + 1 < T:
            logits = _logits(lm, lm.model.norm(x))[0, 0].double()  # the trainer's head (float32 for bf16)
            out[i + 1] = torch.log_softmax(logits, -1)[tokens[i + 1]].cpu()
    return out


def random_eviction_stream(seed: int, T: int = 160, vocab: int = 300, n_events: int = 3) -> Trace:
    """A stream with several evictions of random spans (mid-stream ones and ones right before
    the end); token 0, standing for the system prompt, is never evicted."""
    rng = np.random.default_rng(seed)
    evict_at = np.full(T, T)
    for e in sorted(rng.choice(np.arange(8, T), size=n_events, replace=False)):
        live = np.flatnonzero(evict_at[:e] == T)
        live = live[live > 0]
        if len(live) < 2:
            continue
        a = rng.integers(0, len(live) - 1)
        b = rng.integers(a + 1, min(a + 40, len(live)) + 1)
        evict_at[live[a:b]] = e
    trainable = rng.random(T) < 0.5
    trainable[0] = False
    tokens = rng.integers(0, vocab, T)
    return Trace.from_tokens(tokens, evict_at=evict_at, trainable=trainable, rollout_id=f"r{seed}")
