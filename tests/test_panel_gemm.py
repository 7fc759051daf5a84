"""The float32 GEMM on packed panels (panel_gemm.c) against float64 products, and the engine's
layers through it."""

import pytest
import torch

from compactrl.engine.linear import Linears, load_panel_gemm, panels
from compactrl.models.tiny import init_random, tiny_config

needs_kernel = pytest.mark.skipif(
    isinstance(load_panel_gemm(), str) or not torch.backends.mkldnn.is_available(),
    reason="the kernel does not build here, or no oneDNN (auto takes it where it would take oneDNN)",
)


def lm():
    cfg = tiny_config("qwen2", vocab_size=300, size="tiny", eos_token_id=[1])  # q/k/v biases
    return init_random(cfg, seed=0).eval()


def panel_gemm(lin: Linears, x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    return lin.on_panels(x, panels(w, lin.panel_width), w.shape[0], bias)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 32, 133])  # whole and partial 6-row tiles
@pytest.mark.parametrize("n_out,n_in", [(37, 5), (16, 576), (301, 1000)])  # partial and whole panels
def test_panel_products_are_the_float64_product(rows, n_out, n_in):
    g = torch.Generator().manual_seed(rows * n_in)
    w, x, bias = (
        torch.randn(n_out, n_in, generator=g),
        torch.randn(rows, n_in, generator=g),
        torch.randn(n_out),
    )
    lin = Linears(lm(), "auto")
    out = panel_gemm(lin, x, w, bias)
    want = x.double() @ w.double().T + bias.double()
    assert out.dtype == torch.float32 and out.shape == (rows, n_out)
    scale = x.double().abs() @ w.double().abs().T  # float32 sums err relative to their terms' size
    assert ((out.double() - want).abs() / scale).max() < 1e-5
    # negative control: the weight packed a row off (panels out of step) is a different product
    off = lin.on_panels(x, panels(w[1:], lin.panel_width), n_out - 1, None)
    assert (off.double() - (want[:, :-1] - bias[:-1].double())).abs().max() > 0.1


@needs_kernel
def test_a_rows_product_is_the_same_for_any_thread_count_and_any_batch():
    w, x = torch.randn(301, 576), torch.randn(40, 576)
    lin, threads = Linears(lm(), "auto"), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = panel_gemm(lin, x, w)
        torch.set_num_threads(2)
        assert torch.equal(panel_gemm(lin, x, w), one)  # each panel is one thread's, summed in one order
    finally:
        torch.set_num_threads(threads)
    # each output one sum in k order: rows 7-8 alone (another tile position) give the same bits
    assert torch.equal(panel_gemm(lin, x[7:9], w), one[7:9])
    assert not torch.equal(torch.mm(x[7:9], w.T), one[7:9])  # control: a BLAS product sums otherwise


@needs_kernel
def test_decode_batches_and_prefill_go_through_the_kernel_and_follow_weight_updates():
    model = lm()
    lin = Linears(model, "auto")
    assert lin.panel_gemm is not None and lin.kind.startswith("panel_gemm (2+ rows)")
    assert Linears(model, "onednn").panel_gemm is None  # only auto uses it: onednn is vLLM's path
    lin.prepare(model)
    assert all(pack[1].dim() == 3 for pack in lin._packs.values())  # panels only, no oneDNN copy beside
    layer, d = model.model.layers[0], model.config.hidden_size
    calls = []
    kernel = lin.panel_gemm
    lin.panel_gemm = lambda *a: calls.append(a[3]) or kernel(*a)  # rows of each call
    with torch.inference_mode():
        for rows in (2, 33, 300):  # decode batches, a prefill chunk
            x = torch.randn(rows, d)
            calls.clear()
            torch.testing.assert_close(lin.mlp(layer.mlp, x), layer.mlp(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lin.logits(model, x), model.lm_head(x), rtol=1e-5, atol=1e-5)
            assert calls == [rows] * 3  # gate+up, down, head
        x = torch.randn(4, d)
        layer.mlp.up_proj.weight.mul_(2)  # an optimizer step on the shared model: repacked, no bookkeeping
        torch.testing.assert_close(lin.mlp(layer.mlp, x), layer.mlp(x), rtol=1e-5, atol=1e-5)
