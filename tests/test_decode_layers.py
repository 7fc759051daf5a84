"""Every layer of an engine step in one C call (decode_layers.c: decode tokens, prompt chunks over
their own rows) against the torch path it replaces."""

import pytest
import torch
from torch import nn

from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.models.tiny import init_random, tiny_config


def lm(family: str = "llama", dtype=torch.float32):
    return init_random(tiny_config(family, vocab_size=300, eos_token_id=[1]), seed=0).to(dtype).eval()


def engine(model, one_call: bool = True):
    """An engine on ``model`` and its one-call path, which the engine uses only if ``one_call``."""
    eng = Engine(model, None, EngineConfig())
    layers = eng.decode_layers
    if layers.why:
        pytest.skip(layers.why)
    if not one_call:
        eng.decode_layers = None
    return eng, layers


def decode(model, sessions: int, one_call: bool, corrupt=None):
    """Tokens, the last turn's log-probs and the cache after two turns of 10 tokens in ``sessions``
    sessions, some with holes: prompts prefilled, decoded, a turn appended after an eviction (a
    chunk over a holed row), decoded; ``corrupt`` wraps the one-call path's arguments (a negative
    control)."""
    eng, layers = engine(model, one_call)
    if one_call and corrupt is not None:
        call = layers.__call__
        eng.decode_layers = lambda *a: call(*corrupt(*a))
        eng.decode_layers.applies = layers.applies
    ss = [eng.session() for _ in range(sessions)]
    for k, s in enumerate(ss):
        s.append([(11 * k + i) % 300 for i in range(12 + 5 * k)])
        if k % 2:
            s.evict([(2, 5 + k)])  # holes in some rows
        params = SamplingParams(max_tokens=10, temperature=0.8, seed=k, ignore_eos=True, model_logprobs=True)
        s.generate(params)
    eng.run()
    for k, s in enumerate(ss):
        s.evict([(9 + 5 * k, 11 + 5 * k)])  # the prompt's last tokens but one
        s.append([(7 * k + i) % 300 for i in range(3 + 4 * k % 13)])
        params = SamplingParams(max_tokens=10, temperature=0.8, seed=k, ignore_eos=True, model_logprobs=True)
        s.generate(params)
    eng.run()
    out = [(s.tokens, torch.tensor(s.model_logprobs[-10:])) for s in ss]
    return out, [k.clone() for k in eng.kv.k + eng.kv.v], layers.calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biases on q/k/v
@pytest.mark.parametrize("sessions", [1, 5, 37])  # gemv.c and panel_gemm.c inside
def test_one_call_decodes_what_the_torch_path_decodes(family, sessions):
    model = lm(family)
    fast, fast_cache, calls = decode(model, sessions, one_call=True)
    slow, slow_cache, _ = decode(model, sessions, one_call=False)
    assert calls >= 22  # every step: both prefills, the decode steps
    for (tf, lf), (ts, ls) in zip(fast, slow):
        assert tf == ts and (lf - ls).abs().max() < 1e-5
    for a, b in zip(fast_cache, slow_cache):  # the K/V it wrote, holes included
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("sessions", [1, 5, 37])  # gemv.c and panel_gemm_bf16.c inside
def test_one_call_decodes_in_bfloat16_what_the_torch_path_decodes(family, sessions):
    """Rounded where the torch path rounds, with the same GEMM and attention kernels: the same bits
    but for the norms' float32 statistics, summed in another order, which now and then rounds a
    value to the neighbouring bfloat16 (measured over two turns: 1 of 37 sessions' samples diverged,
    none at 1 or 5; the others' log-probs within 1.1e-2)."""
    model = lm(family, torch.bfloat16)
    fast, fast_cache, calls = decode(model, sessions, one_call=True)
    slow, slow_cache, _ = decode(model, sessions, one_call=False)
    assert calls >= 22
    same = [(lf - ls).abs().max() for (tf, lf), (ts, ls) in zip(fast, slow) if tf == ts]
    assert len(same) >= 0.9 * sessions and max(same) < 2e-2
    differ = sum((a != b).sum() for a, b in zip(fast_cache, slow_cache))
    assert differ <= 0.01 * sum(a.numel() for a in fast_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_written_to_the_wrong_cache_entry_is_seen(dtype):
    """Negative control: the comparisons above catch a one-call path that misplaces K/V."""
    model = lm(dtype=dtype)
    slow, _, _ = decode(model, 3, one_call=False)

    def shifted(x, cos, sin, kv, rows, ents, lens, longest, chunks=None):
        return x, cos, sin, kv, rows, ents + 1, lens, longest, chunks  # written one entry late

    bad, _, _ = decode(model, 3, one_call=True, corrupt=shifted)
    assert max((lb - ls).abs().max() for (_, lb), (_, ls) in zip(bad, slow)) > 1e-2


def test_steps_it_does_not_cover_run_the_torch_path():
    model = lm()
    _, layers = engine(model)
    assert layers.applies(1, prefill=False, keep_queries=False)
    assert layers.applies(64, prefill=False, keep_queries=False)
    assert layers.applies(4, prefill=True, keep_queries=False) == (layers.chunks is not None)
    assert not layers.applies(4, prefill=False, keep_queries=True)  # a token evictor reads the queries

    class Adapter(nn.Module):  # what a LoRA injection puts in a projection's place
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return self.base(x)

    mlp = model.model.layers[1].mlp
    mlp.up_proj = Adapter(mlp.up_proj)
    assert not layers.applies(4, prefill=False, keep_queries=False)
    mlp.up_proj = mlp.up_proj.base
    assert layers.applies(4, prefill=False, keep_queries=False)


def test_models_it_does_not_cover_say_why():
    for model, why in [(lm("qwen3"), "q/k-norm"), (lm(dtype=torch.float16), "float32 and bfloat16")]:
        eng = Engine(model, None, EngineConfig())
        layers = eng.decode_layers
        assert why in layers.why and not layers.applies(2, prefill=False, keep_queries=False)


@pytest.mark.parametrize("sessions", [1, 3])
def test_an_in_place_weight_update_reaches_the_one_call_path(sessions):
    got = {}
    for one_call in (True, False):
        model = lm()
        eng, layers = engine(model, one_call)
        ss = [eng.session() for _ in range(sessions)]
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, model_logprobs=True)
        for k, s in enumerate(ss):
            s.append([(7 * k + i) % 300 for i in range(9)])
            s.generate(greedy)
        eng.run()
        with torch.no_grad():  # an optimizer step on the shared model: nothing tells the engine
            model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
            model.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
        for s in ss:
            s.generate(greedy)
        eng.run()
        got[one_call] = [torch.tensor(s.model_logprobs[-8:]) for s in ss], layers.calls
    assert got[True][1] >= 6
    for a, b in zip(got[True][0], got[False][0]):
        assert (a - b).abs().max() < 1e-5
