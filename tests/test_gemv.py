"""The one-row kernel (gemv.c) against float64 products, and the engine's layers through it."""

from pathlib import Path

import pytest
import torch

from compactrl.engine import linear
from compactrl.engine.kernels import compile_c
from compactrl.engine.linear import Linears, load_gemv
from compactrl.models.tiny import init_random, tiny_config

needs_kernel = pytest.mark.skipif(isinstance(load_gemv(), str), reason="the kernel does not build here")


def lm(dtype=torch.float32):
    cfg = tiny_config("qwen2", vocab_size=300, size="tiny", eos_token_id=[1])  # q/k/v biases
    return init_random(cfg, seed=0).to(dtype).eval()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("n_in", [5, 77, 576, 1000])  # below, across and past the vector blocks' sizes
def test_one_row_is_the_float64_product_of_the_stored_weights(dtype, tol, n_in):
    g = torch.Generator().manual_seed(n_in)
    w = torch.randn(37, n_in, generator=g).to(dtype)
    x = torch.randn(1, n_in, generator=g).to(dtype)
    bias = torch.randn(37, generator=g)
    lin = Linears(lm(dtype), "auto")
    out = lin.row(x, w, bias)
    want = x.double() @ w.double().T + bias.double()  # a bfloat16 value is exact in float32 and float64
    assert out.dtype == torch.float32 and out.shape == (1, 37)
    assert ((out.double() - want).abs() / want.abs().clamp(min=1)).max() < tol
    # negative control: the row read with a one-element shift is a different product
    shifted = lin.row(x[:, 1:], w[:, :-1].contiguous())
    assert (shifted.double() - (want - bias.double())).abs().max() > 0.1


@needs_kernel
def test_one_row_is_the_same_for_any_thread_count():
    w, x = torch.randn(301, 576), torch.randn(576)
    lin, threads = Linears(lm(), "auto"), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin.row(x, w)
        torch.set_num_threads(2)
        assert torch.equal(lin.row(x, w), one)  # each output row is summed by one thread, in one order
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_step_of_one_row_goes_through_the_kernel_and_equals_the_modules(dtype):
    model = lm(dtype)
    lin = Linears(model, "auto")
    if dtype == torch.bfloat16 and not lin.upcast:
        pytest.skip("native bfloat16 GEMMs here: one bfloat16 row stays with them")
    assert lin.gemv is not None and lin.kind.endswith("gemv (1 row)")
    assert Linears(model, "native").gemv is None  # only auto uses it
    layer, x = model.model.layers[0], torch.randn(1, model.config.hidden_size).to(dtype)
    with torch.inference_mode():
        got = lin.mlp(layer.mlp, x), lin.linear(layer.self_attn.q_proj, x), lin.logits(model, x)
        head = (x.double() @ model.lm_head.weight.double().T).float()  # the head is float32 either way
        want = layer.mlp(x), layer.self_attn.q_proj(x), head
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: each projection rounded to it
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_without_a_compiler_the_reason_is_returned(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert "no C compiler" in compile_c(Path(linear.__file__).with_name("gemv.c"), {})
