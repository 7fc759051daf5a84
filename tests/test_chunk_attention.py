"""The prompt-chunk attention kernel against float64 causal attention over holed rows; the engine with it."""

import pytest
import torch

from compactrl.engine import Engine, EngineConfig, SamplingParams, chunk_attention
from compactrl.engine.chunk_attention import ChunkAttention, load_kernel
from compactrl.models.tiny import init_random, tiny_config

needs_kernel = pytest.mark.skipif(isinstance(load_kernel(), str), reason="the kernel does not build here")

# (row, first entry, tokens): a fresh prompt, chunks appended after holes, a two-token chunk,
# lengths on and off the kernel's key blocks
CHUNKS = [(1, 0, 70), (3, 100, 23), (0, 0, 2), (2, 37, 64), (4, 129, 1)]


def holed_rows(dtype, Hkv, D, cap=200, seed=0):
    """A layer's cache whose rows have holes before their chunks, and NaN in every hole and past
    every chunk's end (entries the kernel must weigh 0 or never read)."""
    g = torch.Generator().manual_seed(seed)
    K, V = (torch.randn(5, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
    valid = torch.zeros(5, cap, dtype=torch.bool)
    for row, first, n in CHUNKS:
        valid[row, :first] = torch.rand(first, generator=g) > 0.3
        valid[row, first : first + n] = True  # the chunk's own tokens
    K[~valid[:, None, :, None].expand_as(K)] = float("nan")
    V[~valid[:, None, :, None].expand_as(V)] = float("nan")
    return K, V, valid


def reference(q, K, V, valid, chunks, causal=True):
    """float64 softmax attention of each chunk token over the valid entries of its row up to its own."""
    N, H, D = q.shape
    G = H // K.shape[1]
    out = torch.full((N, H, D), float("nan"), dtype=torch.float64)
    for at, row, first, n in chunks.tolist():
        for t in range(n):
            end = first + t + 1 if causal else first + n
            keep = valid[row, :end]
            k, v = K[row, :, :end][:, keep].double(), V[row, :, :end][:, keep].double()  # [Hkv, live, D]
            p = torch.softmax(q[at + t].double().view(-1, G, D) @ k.transpose(1, 2) * D**-0.5, dim=-1)
            out[at + t] = (p @ v).view(H, D)
    return out


def step(dtype, G, D, Hkv=3):
    """A step's chunks in an order of their own (offsets not by row), their queries and cache."""
    K, V, valid = holed_rows(dtype, Hkv, D)
    offsets = [66, 136, 0, 2, 159]  # where each chunk's tokens sit among the step's 160
    chunks = torch.tensor([[o, r, e, n] for o, (r, e, n) in zip(offsets, CHUNKS, strict=True)])
    q = torch.randn(160, Hkv * G, D).to(dtype)
    return q, K, V, valid, chunks


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("G,D", [(3, 64), (2, 16), (4, 32)])
def test_kernel_is_causal_attention_over_each_rows_valid_entries(dtype, tol, G, D):
    q, K, V, valid, chunks = step(dtype, G, D)
    out = torch.full_like(q, float("nan"))
    ChunkAttention("kernel", "cpu", dtype, G, D)(q, K, V, valid, chunks, out)
    want = reference(q, K, V, valid, chunks)
    assert torch.isfinite(out).all()  # every token written; NaN in holes never reaches a result
    assert (out.double() - want).abs().max() < tol
    # negative controls: no causal mask, or the holes attended (zeros in place of NaN), differ
    assert (reference(q, K, V, valid, chunks, causal=False) - want).abs().max() > 0.05
    filled = reference(q, K.nan_to_num(0), V.nan_to_num(0), valid | True, chunks)
    assert (filled - want).abs().max() > 0.05


@needs_kernel
def test_kernel_reads_query_rows_with_a_stride_and_threads_do_not_change_it():
    _, K, V, valid, chunks = step(torch.float32, 3, 64)
    qkv = torch.randn(160, 9 + 3 + 3, 64)  # the fused projection's layout: q, k, v heads per token
    q = qkv[:, :9]
    attn = ChunkAttention("kernel", "cpu", torch.float32, 3, 64)
    one, two = torch.empty(160, 9, 64), torch.empty(160, 9, 64)
    attn(q, K, V, valid, chunks, one)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        attn(q, K, V, valid, chunks, two)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each work item is summed in the same order whatever thread runs it
    assert (one.double() - reference(q.contiguous(), K, V, valid, chunks)).abs().max() < 2e-6
    with pytest.raises(AssertionError, match="past the cache"):
        short = (t[:, :, :120].contiguous() for t in (K, V))  # a chunk ends at entry 123
        attn(q, *short, valid[:, :120].contiguous(), chunks, one)


@needs_kernel
def test_chunks_whose_keys_do_not_fit_the_scratch_together_go_in_groups(monkeypatch):
    """The scratch stays bounded (a long row's chunk, not a step's sum of them): the same bits."""
    q, K, V, valid, chunks = step(torch.float32, 3, 64)
    whole, grouped = torch.empty_like(q), torch.empty_like(q)
    one_call = ChunkAttention("kernel", "cpu", torch.float32, 3, 64)
    one_call(q, K, V, valid, chunks, whole)
    monkeypatch.setattr(chunk_attention, "SCRATCH_FLOATS", 1)  # room for the largest chunk only
    in_groups = ChunkAttention("kernel", "cpu", torch.float32, 3, 64)
    in_groups(q, K, V, valid, chunks, grouped)
    assert torch.equal(whole, grouped) and in_groups.scratch.numel() < one_call.scratch.numel() / 2


def test_a_head_size_the_kernel_cannot_read_is_refused_and_auto_falls_back():
    with pytest.raises(ValueError, match="head sizes.*'auto' or 'sdpa'"):
        ChunkAttention("kernel", "cpu", torch.float32, 3, 63)
    assert ChunkAttention("auto", "cpu", torch.float32, 3, 63).kind == "sdpa"
    assert ChunkAttention("sdpa", "cpu", torch.float32, 3, 64).kind == "sdpa"


def run_counting_kernel_calls(eng, mode, layers):
    """``eng.run()``, whose chunks all fit one step: one kernel call per layer, none with SDPA."""
    with torch.profiler.profile() as prof:
        eng.run()
    calls = sum(e.name == "compactrl::chunk_attention" for e in prof.events())
    assert calls == (layers if mode == "kernel" else 0)


@needs_kernel
def test_engine_prefills_and_appends_after_evictions_the_same_with_kernel_and_sdpa():
    """Prompts, then turns appended to rows with holes (later chunks): the same tokens and
    log-probs with the kernels as with SDPA, and the kernel ran on those chunks."""
    model = init_random(tiny_config("llama", vocab_size=300, eos_token_id=[1]), seed=0).eval()
    sample = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, model_logprobs=True)
    seen = {}
    for mode in ("kernel", "sdpa"):
        eng = Engine(model, None, EngineConfig(attention=mode))
        assert eng.chunk_attention.kind == mode
        eng.decode_layers = None  # the kernel as the torch path calls it (decode_layers.c's: its tests)
        sessions = [eng.session() for _ in range(4)]
        for k, s in enumerate(sessions):
            s.append([(13 * k + i) % 300 for i in range(20 + 9 * k)])
            s.generate(sample)
        run_counting_kernel_calls(eng, mode, model.config.num_hidden_layers)  # the prompts
        for k, s in enumerate(sessions):
            s.evict([(3, 9 + k)])  # a hole before the next turn
            s.append([(7 * k + i) % 300 for i in range(11 + 5 * k)])
            s.generate(sample)
        run_counting_kernel_calls(eng, mode, model.config.num_hidden_layers)  # the appended turns
        seen[mode] = [(s.tokens, torch.tensor(s.model_logprobs)) for s in sessions]
    for (tk, lk), (ts, ls) in zip(seen["kernel"], seen["sdpa"], strict=True):
        sampled = ~lk.isnan()  # prompt and appended tokens have none
        assert tk == ts and torch.equal(sampled, ~ls.isnan()) and sampled.sum() == 12
        assert (lk[sampled] - ls[sampled]).abs().max() < 1e-5
