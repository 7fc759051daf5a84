import math
import random

import numpy as np
import pydantic
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from compactrl.engine.sampling import Sampler, SamplingParams, _truncated_logprobs, find_stop, make_generator

torch.set_num_threads(1)
SAMPLER = Sampler()


def ref_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent float64 reference: temperature, then top-k, then the smallest top-p prefix."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), dtype=bool)
    keep[order[: top_k or len(x)]] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        cum = np.cumsum(p[order])
        n = int(np.searchsorted(cum, top_p)) + 1  # first index whose cumulative mass reaches top_p
        keep[:] = False
        keep[order[:n]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def sample(logits, params, gens=None):
    if isinstance(params, SamplingParams):
        params = [params] * logits.shape[0]
    gens = gens if gens is not None else [make_generator(p.seed) for p in params]
    return SAMPLER.sample(logits, params, gens)


def test_greedy_is_argmax_with_untempered_logprob():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    assert torch.equal(out.tokens, logits.argmax(-1))
    ref = logits.double().log_softmax(-1).gather(-1, out.tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, ref)  # float64 log-probs of the float32 logits
    assert out.model_logprobs is None


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 5, 1.0),
        (1.0, 0, 0.8),
        (0.5, 10, 0.9),
        (2.0, 3, 0.3),
        (1.0, 1000, 0.95),
    ],
)
def test_logprobs_equal_reference_truncated_distribution(temperature, top_k, top_p):
    logits = 3 * torch.randn(64, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i) for i in range(64)]
    out = sample(logits, params)
    for b in range(64):
        p = ref_probs(logits[b].numpy(), temperature, top_k, top_p)
        t = int(out.tokens[b])
        assert p[t] > 0, "sampled a token outside the truncated support"
        assert math.isclose(float(out.logprobs[b]), math.log(p[t]), abs_tol=2e-5)


def test_empirical_frequencies_match_truncated_distribution():
    """Two param sets interleaved in one batch; counts must fit each truncated distribution."""
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0])
    sets = [SamplingParams(temperature=0.8, top_k=6, top_p=0.9), SamplingParams(temperature=1.5, top_p=0.8)]
    n = 20000
    g = random.Random(1234)
    out = sample(logits.expand(2 * n, -1).clone(), sets * n, [g] * (2 * n))
    for i, sp in enumerate(sets):
        p = ref_probs(logits.numpy(), sp.temperature, sp.top_k, sp.top_p)
        counts = np.bincount(out.tokens[i::2].numpy(), minlength=len(p))
        assert counts[p == 0].sum() == 0
        kept = p > 0
        chi2 = (((counts - n * p) ** 2)[kept] / (n * p[kept])).sum()
        df = kept.sum() - 1
        assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, counts, n * p)


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    out = sample(logits, [SamplingParams(top_k=1, temperature=1.7, seed=i) for i in range(8)])
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert torch.equal(out.logprobs, torch.zeros(8))


def test_tiny_top_p_keeps_exactly_the_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    out = sample(logits, [SamplingParams(top_p=1e-6, seed=i) for i in range(8)])
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert torch.equal(out.logprobs, torch.zeros(8))


def test_ties_go_to_the_lower_token_id_and_top_p_stops_at_reaching_mass():
    """Four equal logits: top_p=0.5 is reached by exactly two tokens, and ties keep ids 0 and 1."""
    logits = torch.zeros(200, 4)
    for sp in (SamplingParams(top_p=0.5), SamplingParams(top_k=2), SamplingParams(top_k=3, top_p=0.6)):
        out = sample(logits, [sp.model_copy(update={"seed": i}) for i in range(200)])
        assert set(out.tokens.tolist()) == {0, 1}
        torch.testing.assert_close(out.logprobs, torch.full((200,), math.log(0.5), dtype=torch.float64))


def test_top_p_one_keeps_the_tail_when_float32_cumsum_overshoots():
    logits = 3 * torch.randn(1, 10000, generator=torch.Generator().manual_seed(0))
    p = logits.softmax(-1).sort(descending=True).values
    assert (p.cumsum(-1) - p >= 1).any()  # the premise: naive float32 cumsum would cut the tail
    lp = _truncated_logprobs(logits, torch.tensor([10000]), torch.tensor([1.0]))
    torch.testing.assert_close(lp, logits.log_softmax(-1))


@settings(max_examples=60, deadline=None)
@given(
    ints=st.lists(st.integers(-40, 40), min_size=2, max_size=30, unique=True),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    top_k=st.integers(0, 35),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**31),
)
def test_never_samples_outside_top_k_top_p(ints, temperature, top_k, top_p, seed):
    logits = torch.tensor(ints, dtype=torch.float32) / 4  # exact in float32: no accidental ties
    x = np.array(ints) / 4 / temperature
    e = np.exp(np.sort(x)[::-1][: top_k or len(x)] - x.max())
    cum = np.cumsum(e / e.sum())
    assume(np.all(np.abs(cum[:-1] - top_p) > 1e-4))  # stay off the float32 rounding boundary
    p = ref_probs(np.array(ints) / 4, temperature, top_k, top_p)
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    out = sample(logits.expand(16, -1).clone(), [sp] * 16, [make_generator(seed + i) for i in range(16)])
    assert all(p[t] > 0 for t in out.tokens.tolist())
    np.testing.assert_allclose(out.logprobs.numpy(), np.log(p[out.tokens.numpy()]), atol=2e-5)


def test_seeded_row_is_the_same_alone_or_in_a_batch():
    gen = torch.Generator().manual_seed(4)
    target = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=123)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=7),
        SamplingParams(temperature=1.2),  # global RNG
        SamplingParams(top_p=0.5, seed=9),
    ]
    g_alone, g_batch = make_generator(123), make_generator(123)
    g_others = [make_generator(p.seed) for p in others]
    for _ in range(20):
        row = torch.randn(1, 300, generator=gen)
        alone = sample(row, [target], [g_alone])
        batch_logits = torch.cat(
            [torch.randn(2, 300, generator=gen), row, torch.randn(2, 300, generator=gen)]
        )
        params = others[:2] + [target] + others[2:]
        batch = sample(batch_logits, params, g_others[:2] + [g_batch] + g_others[2:])
        assert int(batch.tokens[2]) == int(alone.tokens[0])
        assert float(batch.logprobs[2]) == pytest.approx(float(alone.logprobs[0]), abs=1e-6)


def test_different_seeds_give_different_samples():
    logits = torch.zeros(32, 1000)
    out = sample(logits, [SamplingParams(seed=s) for s in range(32)])
    assert len(set(out.tokens.tolist())) > 20
    again = sample(logits, [SamplingParams(seed=s) for s in range(32)])
    assert torch.equal(out.tokens, again.tokens)


def test_global_rng_rows_follow_torch_manual_seed():
    logits = torch.zeros(4, 1000)
    torch.manual_seed(5)
    a = sample(logits, SamplingParams()).tokens
    torch.manual_seed(5)
    b = sample(logits, SamplingParams()).tokens
    assert torch.equal(a, b)


def test_model_logprobs_are_raw_log_softmax_at_sampled_token():
    logits = torch.randn(10, 60, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.6, top_k=8, top_p=0.7, seed=i, model_logprobs=i % 2 == 0)
        for i in range(10)
    ]
    out = sample(logits, params)
    ref = logits.double().log_softmax(-1).gather(-1, out.tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.model_logprobs, ref)
    assert (out.logprobs > out.model_logprobs).all()  # truncation + low temperature sharpen the top tokens


def test_forced_tokens_are_emitted_and_scored_under_the_sampling_distribution():
    """Teacher forcing: the forced rows emit their token, with its log-prob under that row's
    (tempered, truncated) distribution; the other rows sample as they would alone."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([1.0, 0.7, 0.0, 1.0])]
    free = sample(logits, params)
    forced = [7, 3, 9, None]
    out = SAMPLER.sample(logits, params, [make_generator(p.seed) for p in params], forced)
    assert out.tokens.tolist()[:3] == [7, 3, 9] and out.tokens[3] == free.tokens[3]
    scaled = logits.double() / torch.tensor([1.0, 0.7, 1.0, 1.0], dtype=torch.float64)[:, None]
    ref = scaled.log_softmax(-1).gather(-1, out.tokens[:, None]).squeeze(-1)  # greedy: untempered
    torch.testing.assert_close(out.logprobs, ref)
    assert out.tokens[0] != free.tokens[0] or out.tokens[1] != free.tokens[1]  # forcing changed a draw


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, "temperature must be a finite float >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite float >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"stop_token_ids": [-2]}, "stop_token_ids must be token ids >= 0"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"topp": 0.5}, "Extra inputs are not permitted"),
        ({"forced": [1, 2, 3], "max_tokens": 2}, "forced needs at most max_tokens (2)"),
    ],
)
def test_params_validation_names_field_and_range(kwargs, needle):
    with pytest.raises(pydantic.ValidationError) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)
    assert next(iter(kwargs)) in str(e.value)


def test_params_are_frozen():
    with pytest.raises(pydantic.ValidationError):
        SamplingParams().temperature = 0.5


def test_find_stop():
    assert find_stop("hello world", ["xyz"]) is None
    assert find_stop("hello world", []) is None
    assert find_stop("hello world", ["world", "lo"]) == 5  # "lo" completes before "world"
    assert find_stop("abcd", ["bcd", "c"]) == 3
    assert find_stop("a</s>b</s>", ["</s>"]) == 5


@pytest.mark.skipif(SAMPLER.kernel is None, reason="sampling.c does not build here")
@pytest.mark.parametrize("vocab", [7, 300, 49152])  # one block, several, a real vocabulary's
def test_kernel_draws_and_scores_as_the_torch_path(vocab):
    """Untruncated rows go to sampling.c: the same tokens and float64 log-probs as the torch path,
    with greedy, tempered, forced and seeded rows in one batch and masked (-inf) logits."""
    torch_path, rng = Sampler(kernel=False), random.Random(vocab)
    assert torch_path.kernel is None
    for trial in range(40):
        B = rng.randint(1, 9)
        gen = torch.Generator().manual_seed(trial)
        logits = torch.randn(B, vocab, generator=gen) * rng.choice([0.5, 3, 20])
        logits[0, rng.sample(range(vocab), vocab // 2)] = -math.inf
        temps = [rng.choice([0, 0.7, 1.0, 1.3]) for _ in range(B)]
        params = [SamplingParams(temperature=t, model_logprobs=True) for t in temps]
        forced = [rng.choice([None, None, 3]) for _ in range(B)]
        seeds = [rng.randrange(10**6) for _ in range(B)]
        a = SAMPLER.sample(logits, params, [make_generator(s) for s in seeds], forced)
        b = torch_path.sample(logits, params, [make_generator(s) for s in seeds], forced)
        assert torch.equal(a.tokens, b.tokens)
        for x, y in ((a.logprobs, b.logprobs), (a.model_logprobs, b.model_logprobs)):
            assert torch.equal(x.isfinite(), y.isfinite())  # a forced masked token scores -inf in both
            fin = y.isfinite()
            assert torch.allclose(x[fin], y[fin], rtol=0, atol=1e-12)
        assert not logits[0, a.tokens[0]].isinf() or forced[0] is not None  # never a masked token drawn
