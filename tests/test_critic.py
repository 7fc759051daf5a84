"""The critic's values come from the same one-pass forward, under the same eviction mask."""

import torch

from compactrl.rl.critic import ValueHead
from compactrl.rl.forward import stream_logprobs
from compactrl.rl.reference import random_eviction_stream
from compactrl.trace import Trace


def test_values_follow_the_eviction_mask_and_packing(tiny_lm):
    traces = [random_eviction_stream(s, T=120) for s in range(3)]
    head = ValueHead(tiny_lm.config.hidden_size)
    torch.nn.init.normal_(head.proj.weight, std=0.5)
    with torch.no_grad():
        lp, v = stream_logprobs(tiny_lm, traces, value_head=head)
        lp2, v2 = stream_logprobs(tiny_lm, traces, value_head=head, max_row_tokens=400)  # packed rows
        plain = stream_logprobs(tiny_lm, traces)
        blind = [Trace.from_tokens(t.tokens) for t in traces]  # the same tokens, no evictions
        _, vb = stream_logprobs(tiny_lm, blind, value_head=head)
    for a, b, c, p, vv, bb in zip(lp, lp2, plain, v, v2, vb):
        torch.testing.assert_close(a, c)  # asking for values changes nothing else
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vv, p, atol=1e-5, rtol=1e-5)
        assert p[0] == 0 and p.shape == a.shape
        assert (p - bb).abs().max() > 1e-3  # evictions change the states the critic sees


def test_a_fresh_head_is_zero_and_learns(tiny_lm):
    trace = random_eviction_stream(9, T=60)
    head = ValueHead(tiny_lm.config.hidden_size)
    _, (v,) = stream_logprobs(tiny_lm, [trace], value_head=head)
    assert torch.all(v == 0)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    target = torch.linspace(0, 1, len(trace))
    losses = []
    for _ in range(20):
        _, (v,) = stream_logprobs(tiny_lm, [trace], value_head=head)
        loss = ((v[1:] - target[1:]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
