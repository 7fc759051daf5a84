import pytest
import torch
from torch import nn

from compactrl.engine.fused import FusedProjection
from compactrl.models.tiny import init_random, tiny_config


def project(attn, x, cos, sin):
    """The model's own path, token-major like the fused one."""
    q, k, v = attn.project(x[None], cos[None], sin[None])
    return [t[0].transpose(0, 1) for t in (q, k, v)]


def inputs(lm, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, lm.config.hidden_size, generator=g)
    cos, sin = lm.rope(torch.arange(40, 40 + n)[None], x.dtype)
    return x, cos[0], sin[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_projection_is_bit_identical(family):
    lm = init_random(tiny_config(family, vocab_size=64, attention_bias=family == "llama"), seed=1)
    attn = lm.model.layers[0].self_attn
    fused = FusedProjection(attn)
    assert fused.fusable
    x, cos, sin = inputs(lm)
    for a, b in zip(fused(x, cos, sin), project(attn, x, cos, sin)):
        assert torch.equal(a, b)


def test_in_place_updates_reach_the_pack_and_replaced_weights_are_repacked():
    lm = init_random(tiny_config("qwen3", vocab_size=64), seed=1)
    attn = lm.model.layers[0].self_attn
    fused = FusedProjection(attn)
    x, cos, sin = inputs(lm)
    before = fused(x, cos, sin)[0].clone()
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)  # in place (update_weights, an optimizer step): no repack needed
        attn.q_norm.weight.add_(0.5)
    assert not torch.equal(fused(x, cos, sin)[0], before)
    for a, b in zip(fused(x, cos, sin), project(attn, x, cos, sin)):
        assert torch.equal(a, b)
    attn.q_proj.weight.data = torch.randn_like(attn.q_proj.weight)  # replaced: must be repacked
    for a, b in zip(fused(x, cos, sin), project(attn, x, cos, sin)):
        assert torch.equal(a, b)


def test_a_wrapped_projection_is_not_fused():
    lm = init_random(tiny_config("qwen2", vocab_size=64), seed=1)
    attn = lm.model.layers[0].self_attn
    attn.q_proj = nn.Sequential(attn.q_proj)  # what an adapter wrapper looks like from outside
    fused = FusedProjection(attn)
    assert not fused.fusable
    x, cos, sin = inputs(lm)
    for a, b in zip(fused(x, cos, sin), project(attn, x, cos, sin)):
        assert torch.equal(a, b)
