"""The GEMMs on packed panels (panel_gemm.c in float32, panel_gemm_bf16.c in bfloat16) against
float64 products and torch's rounding, and the engine's layers through them."""

import pytest
import torch

from compactrl.engine.linear import (
    Linears,
    has_native_low_precision_matmul,
    load_panel_gemm,
    load_panel_gemm_bf16,
    panels,
)
from compactrl.models.decoder import _logits
from compactrl.models.tiny import init_random, tiny_config

needs_kernel = pytest.mark.skipif(
    isinstance(load_panel_gemm(), str) or not torch.backends.mkldnn.is_available(),
    reason="the kernel does not build here, or no oneDNN (auto takes it where it would take oneDNN)",
)

needs_bf16_kernel = pytest.mark.skipif(
    isinstance(load_panel_gemm_bf16(), str) or not has_native_low_precision_matmul("cpu"),
    reason="no bfloat16 dot products on this CPU (AVX512-BF16), or no oneDNN using them",
)


def lm(family="qwen2", dtype=torch.float32):
    cfg = tiny_config(family, vocab_size=300, size="tiny", eos_token_id=[1])  # qwen2: q/k/v biases
    return init_random(cfg, seed=0).to(dtype).eval()


def panel_gemm(lin: Linears, x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    return lin.on_panels(x, panels(w, lin.panel_width), w.shape[0], bias)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 32, 133])  # whole and partial tiles of 6 and 8 rows
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
def test_long_sums_are_as_close_to_float64_as_torchs_own_product():
    """Each output sums blocks of 64 terms, then the blocks: over K = 1,536 about 4 times closer to
    float64 than one float32 chain over all K (which measured 2.7 times further off than torch.mm's
    error here), so the engine's log-probs stay within the trainer's gate on real models."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(301, 1536, generator=g), torch.randn(40, 1536, generator=g)
    want = x.double() @ w.double().T

    def rms(y):
        return float(((y.double() - want) ** 2).mean().sqrt())

    assert rms(panel_gemm(Linears(lm(), "auto"), x, w)) < rms(torch.mm(x, w.T))


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


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 133])  # whole and partial 8-row tiles
@pytest.mark.parametrize("n_out,n_in", [(37, 6), (32, 576), (301, 1000)])  # partial and whole panels
def test_bfloat16_panel_products_are_float32_sums_rounded_as_torch_rounds(rows, n_out, n_in):
    g = torch.Generator().manual_seed(rows * n_in)
    w, x, bias = (
        torch.randn(shape, generator=g).bfloat16() for shape in ((n_out, n_in), (rows, n_in), (n_out,))
    )
    lin = Linears(lm(dtype=torch.bfloat16), "auto")
    pack = panels(w, lin.panel_width_bf16)
    sums = lin.on_panels(x, pack, n_out, None, torch.float32)
    scale = x.double().abs() @ w.double().abs().T
    assert ((sums.double() - x.double() @ w.double().T).abs() / scale).max() < 1e-5
    assert torch.equal(lin.on_panels(x, pack, n_out, None, torch.bfloat16), sums.to(torch.bfloat16))
    with_bias = lin.on_panels(x, pack, n_out, bias, torch.bfloat16)  # added before rounding, once
    assert torch.equal(with_bias, (sums + bias.float()).to(torch.bfloat16))
    # negative control: panels laid out as float32's (k not in pairs) are a different product
    wrong = lin.on_panels(x, panels(w.float(), lin.panel_width_bf16).bfloat16(), n_out, None)
    assert (wrong - sums).abs().max() > 0.1


@needs_bf16_kernel
def test_a_bfloat16_models_products_and_float32_head_go_through_the_kernels():
    model = lm("qwen3", torch.bfloat16)  # tied embeddings
    lin = Linears(model, "auto")
    assert lin.kind == "panel_gemm_bf16 (2+ rows), gemv (1 row)" and lin.panel_gemm is None
    lin.prepare(model)
    assert {p[1].dtype for p in lin._packs.values()} == {torch.bfloat16}  # the head too: no float32 copy
    layer, d = model.model.layers[0], model.config.hidden_size
    calls = []
    kernel = lin.panel_gemm_bf16
    lin.panel_gemm_bf16 = lambda *a: calls.append(a[3]) or kernel(*a)
    with torch.inference_mode():
        for rows in (1, 5, 300):  # batch-1 decode (gemv.c), decode batches, a prefill chunk
            h = torch.randn(rows, d).bfloat16()
            calls.clear()
            mlp = lin.mlp(layer.mlp, h)
            native = layer.mlp(h)  # oneDNN's bfloat16: float32 sums too, rounded at each product
            assert mlp.dtype == torch.bfloat16 and (mlp.float() - native.float()).abs().max() < 0.05
            logits = lin.logits(model, h)
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, _logits(model, h), rtol=1e-5, atol=1e-5)  # the trainer's head
            assert calls == ([] if rows == 1 else [rows] * 3)  # gate+up, down, head


def swiglu_weights(F: int, K: int, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, K, generator=g) / K**0.5).to(dtype) for n in (F, F)]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 133])
@pytest.mark.parametrize("F", [40, 48, 1536])  # a partly padded last panel, whole panels, SmolLM2's size
def test_swiglu_epilogue_is_silu_of_gate_times_up(rows, F):
    gate, up = swiglu_weights(F, 576, torch.float32)
    x = torch.randn(rows, 576)
    lin = Linears(lm(), "auto")
    stacked = torch.cat([gate, up])
    out = lin.on_panels(x, panels(stacked, lin.panel_width, swiglu=True), 2 * F, None, swiglu=True)
    g, u = x.double() @ gate.double().T, x.double() @ up.double().T
    assert out.shape == (rows, F) and (out.double() - torch.nn.functional.silu(g) * u).abs().max() < 1e-5
    # negative control: gate and up stacked but not interleaved by half panels
    wrong = lin.on_panels(x, panels(stacked, lin.panel_width), 2 * F, None, swiglu=True)
    assert (wrong.double() - torch.nn.functional.silu(g) * u).abs().max() > 0.1


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [2, 9, 133])
@pytest.mark.parametrize("F", [40, 1536])  # a partly padded last panel, SmolLM2's intermediate size
def test_bfloat16_swiglu_epilogue_rounds_where_torch_rounds(rows, F):
    """SiLU(gate) * up from the kernel against the torch path on the kernel's own rounded gate and
    up: equal but where SiLU's float32 value sits within an ulp of a bfloat16 rounding boundary
    (its exp differs from torch's in the last float32 bits)."""
    gate, up = swiglu_weights(F, 576, torch.bfloat16)
    x = torch.randn(rows, 576).bfloat16()
    lin = Linears(lm(dtype=torch.bfloat16), "auto")
    width = lin.panel_width_bf16
    out = lin.on_panels(x, panels(torch.cat([gate, up]), width, True), 2 * F, None, torch.bfloat16, True)
    g, u = (lin.on_panels(x, panels(w, width), F, None, torch.bfloat16) for w in (gate, up))
    want = torch.nn.functional.silu(g) * u
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert (out != want).float().mean() < 1e-3
    assert ((out.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()  # one bfloat16 ulp
