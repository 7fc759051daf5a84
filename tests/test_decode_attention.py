"""The decode attention kernel against float64 attention over holed rows, and the engine with it."""

import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.engine.decode_attention import SOURCE, DecodeAttention, build, load_kernel
from compactrl.models.tiny import init_random, tiny_config

needs_kernel = pytest.mark.skipif(isinstance(load_kernel(), str), reason="the kernel does not build here")


def holed_cache(dtype, rows=6, Hkv=3, cap=80, D=64, seed=0):
    """A layer's cache with holes, and NaN wherever the kernel must not read (holes, past each length)."""
    g = torch.Generator().manual_seed(seed)
    K, V = (torch.randn(rows, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
    valid = torch.rand(rows, cap, generator=g) > 0.4
    lens = torch.tensor([70, 9, 55, 1, 80, 33])
    for r, n in enumerate(lens.tolist()):
        valid[r, n - 1] = True  # the new token itself
        valid[r, n:] = False
    K[~valid[:, None, :, None].expand_as(K)] = float("nan")
    V[~valid[:, None, :, None].expand_as(V)] = float("nan")
    return K, V, valid, lens


def reference(q, K, V, valid, rows, lens):
    """float64 softmax attention of each query row over the valid entries of its cache row."""
    B, H, D = q.shape
    G = H // K.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        keep = valid[r, :n]
        k, v = K[r, :, :n][:, keep].double(), V[r, :, :n][:, keep].double()  # [Hkv, live, D]
        qb = q[b].double().view(-1, G, D)
        p = torch.softmax(qb @ k.transpose(1, 2) * D**-0.5, dim=-1)
        out[b] = (p @ v).view(H, D)
    return out


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_kernel_is_attention_over_the_valid_entries_and_never_weighs_a_hole(dtype, tol):
    K, V, valid, lens = holed_cache(dtype)
    rows = torch.tensor([4, 0, 2, 5, 1])  # scattered, out of order
    lens = lens[rows]
    q = torch.randn(5, 9, 64).to(dtype)
    out = torch.empty_like(q)
    DecodeAttention("kernel", "cpu", dtype, 3, 64)(q, K, V, valid, rows, lens, int(lens.max()), out)
    want = reference(q, K, V, valid, rows, lens)
    assert torch.isfinite(out).all()  # NaN sits in every hole and past every length
    assert (out.double() - want).abs().max() < tol
    # negative control: attending over the holes too (zeros in place of NaN) is a different result
    filled = reference(q, K.nan_to_num(0), V.nan_to_num(0), torch.ones_like(valid), rows, lens)
    assert (filled - want).abs().max() > 0.05


@needs_kernel
def test_kernel_reads_query_rows_with_a_stride_and_threads_do_not_change_it():
    K, V, valid, lens = holed_cache(torch.float32)
    qk = torch.randn(6, 9 + 3, 64)  # the fused projection's layout: q heads, then k heads, per token
    q = qk[:, :9]
    rows = torch.arange(6)
    attn = DecodeAttention("kernel", "cpu", torch.float32, 3, 64)
    one, two = torch.empty(6, 9, 64), torch.empty(6, 9, 64)
    attn(q, K, V, valid, rows, lens, 80, one)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        attn(q, K, V, valid, rows, lens, 80, two)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (row, KV head) is summed in the same order whatever thread runs it
    assert (one.double() - reference(q.contiguous(), K, V, valid, rows, lens)).abs().max() < 2e-6
    with pytest.raises(AssertionError, match="longer than longest"):  # its scratch would overflow
        attn(q, K, V, valid, rows, lens, 79, one)


def lm(dtype=torch.float32):
    return init_random(tiny_config("qwen3", vocab_size=300, eos_token_id=[1]), seed=0).to(dtype).eval()


@needs_kernel
def test_engine_decodes_the_same_tokens_and_logprobs_with_kernel_and_sdpa():
    model = lm()
    logprobs = {}
    for mode in ("kernel", "sdpa"):
        eng = Engine(model, None, EngineConfig(attention=mode))
        assert eng.attention.kind == mode
        sessions = [eng.session() for _ in range(5)]
        for k, s in enumerate(sessions):
            s.append([(11 * k + i) % 300 for i in range(12 + 7 * k)])
            if k % 2:
                s.evict([(2, 5 + k)])  # holes in some rows
            s.generate(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, model_logprobs=True))
        eng.run()
        logprobs[mode] = [(s.tokens, torch.tensor(s.model_logprobs[-12:])) for s in sessions]  # generated
    for (tk, lk), (ts, ls) in zip(logprobs["kernel"], logprobs["sdpa"]):
        assert tk == ts and (lk - ls).abs().max() < 1e-5


def test_a_kernel_that_cannot_run_is_refused_at_start_and_auto_falls_back():
    with pytest.raises(ValueError, match="float32 or bfloat16.*'auto' or 'sdpa'"):
        Engine(lm(torch.float16), None, EngineConfig(attention="kernel"))
    assert Engine(lm(torch.float16), None, EngineConfig(attention="auto")).attention.kind == "sdpa"
    with pytest.raises(ValidationError, match="attention"):
        EngineConfig(attention="flash")


@needs_kernel
def test_loading_the_kernel_leaves_the_process_float_mode_alone():
    """A library linked with -ffast-math flushes denormals to zero process-wide when it loads."""
    code = (
        "import sys, torch; from compactrl.engine.decode_attention import load_kernel; load_kernel(); "
        "x = float(sys.argv[1]); print(x / 4 > 0, (torch.tensor([1e-38]) / 4).item() > 0)"
    )  # the smallest normal float64 over 4, a float32 subnormal: both 0 once denormals are flushed
    tiny = "2.2250738585072014e-308"
    out = subprocess.run([sys.executable, "-c", code, tiny], capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True"], out.stderr


@needs_kernel  # a compiler to find first
def test_a_kernel_cache_that_cannot_be_written_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    assert "set XDG_CACHE_HOME to a writable folder" in build(SOURCE)
