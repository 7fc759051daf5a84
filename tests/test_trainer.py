"""The training step: exact gradient accumulation, the policy-gradient direction, and the
engine/trainer mismatch on real engine traces (with staleness as the negative control)."""

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from compactrl.config import load_config
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.rl import loop
from compactrl.rl.checkpoint import load_checkpoint, save_checkpoint
from compactrl.rl.critic import ValueHead
from compactrl.rl.forward import stream_logprobs
from compactrl.rl.loop import TrainConfig, train
from compactrl.rl.trainer import Sample, Trainer, TrainSettings, token_weights
from compactrl.trace import Trace


def engine_traces(lm, n=4, seed=0):
    """Sessions with appended prompts, sampled turns and an in-place eviction, from the engine."""
    eng = Engine(lm, None, EngineConfig(kv_pool_tokens=10_000))
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = eng.session(f"r{i}")
        s.append(torch.randint(3, 300, (20 + 5 * i,), generator=g).tolist())
        s.generate(SamplingParams(max_tokens=4 + 4 * i, seed=i, ignore_eos=True))
        eng.run()
        s.evict([(2, 10)])
        s.append(torch.randint(3, 300, (6,), generator=g).tolist())
        s.generate(SamplingParams(max_tokens=8, seed=100 + i, ignore_eos=True))
        eng.run()
        out.append(s.trace())
    return out


def samples_of(traces, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Sample(t, rng.normal(size=len(t)).astype(np.float32), sequence=i // 2) for i, t in enumerate(traces)
    ]


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_lm, norm):
    samples = samples_of(engine_traces(tiny_lm))
    full, micro = copy.deepcopy(tiny_lm), copy.deepcopy(tiny_lm)
    kw = dict(norm=norm, norm_constant=64.0)
    Trainer(full, TrainSettings(micro_batch_tokens=10_000, **kw)).backward(samples)
    t = Trainer(micro, TrainSettings(micro_batch_tokens=40, **kw))
    assert len(t.micro_batches(samples)) == len(samples)  # one trace per forward
    t.backward(samples)
    scale = float(grads(full).abs().max())
    torch.testing.assert_close(grads(micro), grads(full), rtol=1e-4, atol=1e-5 * scale)
    other = copy.deepcopy(tiny_lm)  # negative control: another normalisation is another gradient
    Trainer(other, TrainSettings(norm="sequence" if norm != "sequence" else "token")).backward(samples)
    assert float((grads(other) - grads(full)).abs().max()) > 1e-2 * scale


def test_token_weights_per_normalisation():
    def trace(n_trainable):
        tr = np.zeros(10, dtype=bool)
        tr[1 : 1 + n_trainable] = True
        return Trace.from_tokens(np.arange(10), trainable=tr, logprobs=np.where(tr, -1.0, np.nan))

    samples = [
        Sample(trace(6), np.zeros(10), 0),
        Sample(trace(2), np.zeros(10), 1),
        Sample(trace(2), np.zeros(10), 1),
    ]
    tok = token_weights(samples, "token")
    assert all(np.allclose(w[s.trace.trainable], 1 / 10) for w, s in zip(tok, samples))
    seq = token_weights(samples, "sequence")  # two rollouts weigh 1/2 each, spread over their tokens
    assert np.allclose(seq[0][samples[0].trace.trainable], 1 / 12)
    assert np.allclose(seq[1][samples[1].trace.trainable], 1 / 8)
    assert np.isclose(sum(w.sum() for w in seq), 1.0) and np.isclose(sum(w.sum() for w in tok), 1.0)
    assert np.allclose(token_weights(samples, "constant", 100.0)[0][1:7], 0.01)


def test_engine_traces_match_the_trainer_until_the_weights_move(tiny_lm):
    model = copy.deepcopy(tiny_lm)
    traces = engine_traces(model, seed=3)
    trainer = Trainer(model, TrainSettings(lr=1e-2))
    stats = trainer.step(samples_of(traces))
    assert stats["mismatch_kl"] < 1e-6 and stats["mismatch_max_abs"] < 5e-5  # same weights: ~0
    stale = trainer.backward(samples_of(traces))  # the same rollouts, one update later
    assert stale["mismatch_kl"] > 1e-4


def test_policy_gradient_moves_log_probs_with_the_advantage(tiny_lm):
    model = copy.deepcopy(tiny_lm)
    traces = engine_traces(model, n=2, seed=5)
    samples = [Sample(traces[0], np.ones(len(traces[0]), np.float32), 0),
               Sample(traces[1], -np.ones(len(traces[1]), np.float32), 1)]  # fmt: skip
    trainer = Trainer(model, TrainSettings(lr=1e-3))
    before = [np.nansum(t.logprobs) for t in traces]
    for _ in range(3):
        trainer.step(samples)
    from compactrl.rl.forward import stream_logprobs

    with torch.no_grad():
        after = [
            float(lp[torch.as_tensor(t.trainable)].sum())
            for t, lp in zip(traces, stream_logprobs(model, traces))
        ]
    assert after[0] > before[0] and after[1] < before[1]


def test_adam_epsilon_damps_steps_on_small_gradients(tiny_lm):
    """``eps`` reaches AdamW: far above the gradients' scale, steps shrink to ~lr * grad / eps."""
    traces = engine_traces(tiny_lm, n=2, seed=5)
    samples = [Sample(t, np.full(len(t), a, np.float32), i) for i, (t, a) in enumerate(zip(traces, (1, -1)))]
    moved = []
    for eps in (1e-8, 10.0):
        model = copy.deepcopy(tiny_lm)
        Trainer(model, TrainSettings(lr=1e-3, eps=eps)).step(samples)
        with torch.no_grad():
            moved.append(
                max(float((p - q).abs().max()) for p, q in zip(model.parameters(), tiny_lm.parameters()))
            )
    assert moved[0] > 5e-4 and moved[1] < 1e-2 * moved[0]


def test_distillation_is_the_kl_from_the_full_context_pass(tiny_lm):
    from compactrl.masks import dense_mask
    from compactrl.rl.forward import full_context

    model = copy.deepcopy(tiny_lm)
    traces = engine_traces(model, n=2, seed=7)
    vocab = model.config.vocab_size
    trainer = Trainer(model, TrainSettings(lr=1e-3, distill_top_k=vocab))  # top-k = all: the exact KL
    stats = trainer.backward(
        [Sample(t, np.zeros(len(t), np.float32), i) for i, t in enumerate(traces)], "distill"
    )
    expected, n = 0.0, 0
    with torch.no_grad():
        for t in traces:
            tok, pos = torch.as_tensor(t.tokens), torch.arange(len(t))
            masks = [dense_mask(torch.as_tensor(u.evict_at)) for u in (full_context(t), t)]
            logits = [model(tok, pos, m)[0] for m in masks]
            views = [torch.log_softmax(x.double(), -1) for x in logits]
            kl = (views[0].exp() * (views[0] - views[1])).sum(-1)  # row i predicts token i + 1
            m = torch.as_tensor(t.trainable)[1:]
            expected += float(kl[:-1][m].sum())
            n += int(m.sum())
            first_after = int(min(e for e, _ in t.eviction_events()))
            assert kl[: first_after - 1].abs().max() < 1e-6  # before any eviction the views agree
    assert stats["loss"] == pytest.approx(expected / n, rel=1e-4) and expected > 1e-3
    clean = Trace.from_tokens(traces[0].tokens, trainable=traces[0].trainable)  # nothing evicted
    assert trainer.backward([Sample(clean, np.zeros(len(clean), np.float32))], "distill")[
        "loss"
    ] == pytest.approx(0.0, abs=1e-6)
    # with a frozen reference, it teaches (the same clean trace now shows their difference)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.reference = reference
    samples = [Sample(clean, np.zeros(len(clean), np.float32))]
    assert trainer.backward(samples, "distill")["loss"] > 1e-3


def test_reference_kl_starts_at_zero_and_grows_as_the_policy_moves(tiny_lm):
    model = copy.deepcopy(tiny_lm)
    traces = engine_traces(model, n=2, seed=9)
    with pytest.raises(ValueError, match="reference model"):
        Trainer(model, TrainSettings(kl_ref=0.1)).backward(samples_of(traces))
    trainer = Trainer(model, TrainSettings(lr=1e-2, kl_ref=0.1), reference=copy.deepcopy(model).eval())
    first = trainer.step(samples_of(traces))
    assert first["ref_kl"] < 1e-9
    for _ in range(3):
        last = trainer.step(samples_of(traces))
    assert last["ref_kl"] > 1e-4


def test_topk_reference_kl_is_the_exact_forward_kl_and_pulls_the_policy_back(tiny_lm):
    """``kl_ref_estimator = "topk"`` with top-k = vocabulary: KL(reference || policy) at every
    policy token, both reading the same evicted view; with zero advantages it restores the policy."""
    from compactrl.masks import dense_mask

    reference = copy.deepcopy(tiny_lm).eval()
    model = copy.deepcopy(tiny_lm)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())))
    traces = engine_traces(model, n=2, seed=9)
    settings = TrainSettings(
        lr=3e-3, kl_ref=1.0, kl_ref_estimator="topk", distill_top_k=model.config.vocab_size
    )
    trainer = Trainer(model, settings, reference=reference)
    zero = [Sample(t, np.zeros(len(t), np.float32), i) for i, t in enumerate(traces)]
    expected, n = 0.0, 0
    with torch.no_grad():
        for t in traces:
            tok, pos = torch.as_tensor(t.tokens), torch.arange(len(t))
            mask = dense_mask(torch.as_tensor(t.evict_at))
            ref, pol = (torch.log_softmax(m(tok, pos, mask)[0].double(), -1) for m in (reference, model))
            kl = (ref.exp() * (ref - pol)).sum(-1)[:-1]  # row i predicts token i + 1
            m = torch.as_tensor(t.trainable)[1:]
            expected, n = expected + float(kl[m].sum()), n + int(m.sum())
    first = trainer.step(zero)
    assert first["ref_kl"] == pytest.approx(expected / n, rel=1e-4) and expected / n > 1e-3
    for _ in range(5):
        last = trainer.step(zero)
    assert last["ref_kl"] < 0.5 * first["ref_kl"]  # the anchor alone pulls the policy back


def test_bfloat16_autocast_trains_close_to_float32_with_a_visible_mismatch(tiny_lm):
    model = copy.deepcopy(tiny_lm)
    traces = engine_traces(model, n=2, seed=13)
    runs = {}
    for precision in ("float32", "bfloat16"):
        trainer = Trainer(copy.deepcopy(model), TrainSettings(lr=1e-3, precision=precision))
        runs[precision] = trainer.backward(samples_of(traces))
        grad = grads(trainer.model)
        runs[precision]["grad"] = grad / grad.norm()
    f32, bf16 = runs["float32"], runs["bfloat16"]
    assert f32["mismatch_kl"] < 1e-9 < bf16["mismatch_kl"] < 1e-2  # bf16 rounding shows, but small
    assert float(f32["grad"] @ bf16["grad"]) > 0.95  # the same direction


def test_bfloat16_on_a_cpu_without_bfloat16_gemms_is_warned_about(tiny_lm, monkeypatch):
    import warnings

    import compactrl.rl.trainer as trainer_module

    for native in (True, False):
        monkeypatch.setattr(trainer_module, "has_native_low_precision_matmul", lambda device, n=native: n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(copy.deepcopy(tiny_lm), TrainSettings(precision="bfloat16"))
            Trainer(copy.deepcopy(tiny_lm), TrainSettings(precision="float32"))
        said = [str(w.message) for w in caught if "train.precision" in str(w.message)]
        assert len(said) == (0 if native else 1) and all("'float32' is faster" in m for m in said)


def test_tempered_rollouts_match_the_trainer_at_their_temperature(tiny_lm):
    model = copy.deepcopy(tiny_lm)
    eng = Engine(model, None, EngineConfig(kv_pool_tokens=10_000))
    s = eng.session("hot")
    s.append(list(range(3, 30)))
    s.generate(SamplingParams(max_tokens=16, seed=1, temperature=1.7, ignore_eos=True))
    eng.run()
    trace = s.trace()
    sample = [Sample(trace, np.ones(len(trace), np.float32))]
    assert Trainer(model, TrainSettings(), temperature=1.7).backward(sample)["mismatch_max_abs"] < 5e-5
    assert Trainer(model, TrainSettings()).backward(sample)["mismatch_max_abs"] > 0.1  # untempered: not it
    with pytest.raises(ValueError, match="temperature > 0"):
        Trainer(model, TrainSettings(), temperature=0.0)


def test_entropy_bonus_is_the_policy_entropy_and_raises_it(tiny_lm):
    from compactrl.masks import dense_mask
    from compactrl.rl.forward import stream_logprobs

    model = copy.deepcopy(tiny_lm)
    traces = engine_traces(model, n=2, seed=17)
    with torch.no_grad():
        both = stream_logprobs(model, traces, entropy=True, temperature=1.3)
        plain = stream_logprobs(model, traces, temperature=1.3)
        t = traces[0]
        logits = model(
            torch.as_tensor(t.tokens), torch.arange(len(t)), dense_mask(torch.as_tensor(t.evict_at))
        )
        logp = torch.log_softmax(logits[0].double() / 1.3, -1)
        dense = -(logp.exp() * logp).sum(-1)[:-1]  # row i: the distribution token i + 1 came from
    assert both[0].shape == (len(t), 2) and torch.equal(both[0][:, 0], plain[0])
    torch.testing.assert_close(both[0][1:, 1].double(), dense, atol=1e-4, rtol=0)
    zero = [Sample(x, np.zeros(len(x), np.float32), i) for i, x in enumerate(traces)]  # no reward signal
    entropies = {}
    for coef in (0.0, 0.05):
        trainer = Trainer(copy.deepcopy(model), TrainSettings(lr=1e-2, entropy_coef=coef))
        first = trainer.step(zero)
        for _ in range(4):
            last = trainer.backward(zero)
            trainer.optimizer.step()
        entropies[coef] = (first["entropy"], last["entropy"], first["grad_norm"])
    assert entropies[0.0][2] == 0.0  # negative control: without the bonus nothing moves
    assert entropies[0.05][1] > entropies[0.05][0] > 0  # the bonus raises the policy's entropy


# ---- the PPO critic: trained values track the returns, and a trained head survives a checkpoint ----
def kind_trace(seed, kind, T=40):
    """A trace whose tokens say its kind (ids 10-109 or 150-249), the second half sampled."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(10, 110, T) + 140 * kind
    trainable = np.arange(T) >= T // 2
    return Trace.from_tokens(tokens, trainable=trainable, logprobs=np.where(trainable, -5.0, np.nan))


def kind_batch(seeds):
    """Traces of two kinds, one rollout each; kind k has return k (e.g. failure / success)."""
    return [kind_trace(s, s % 2) for s in seeds], [float(s % 2) for s in seeds]


def critic_values(model, head, traces):
    with torch.no_grad():
        _, values = stream_logprobs(model, traces, value_head=head)
    return values


def critic_error(model, head, traces, returns):
    """Mean squared error and correlation of the values with the returns, over sampled tokens."""
    values = critic_values(model, head, traces)
    v = torch.cat([x[torch.as_tensor(t.trainable)] for x, t in zip(values, traces)]).double()
    r = torch.cat([torch.full((int(t.trainable.sum()),), r) for t, r in zip(traces, returns)]).double()
    corr = float(torch.corrcoef(torch.stack([v, r]))[0, 1]) if v.std() > 0 else 0.0
    return float(((v - r) ** 2).mean()), corr


def ppo_critic_steps(trainer, head, traces, returns, steps):
    """PPO's critic updates: old values re-read before each step (the clip is around them), no
    policy signal (advantages 0), so only the value loss moves the head and the shared backbone."""
    stats = []
    for _ in range(steps):
        old = critic_values(trainer.model, head, traces)
        samples = [
            Sample(t, np.zeros(len(t), np.float32), i, np.full(len(t), r, np.float32), o.numpy())
            for i, (t, r, o) in enumerate(zip(traces, returns, old))
        ]
        stats.append(trainer.step(samples))
    return stats


@pytest.fixture(scope="module")
def trained_critic(tiny_lm):
    model, head = copy.deepcopy(tiny_lm), ValueHead(tiny_lm.config.hidden_size)
    trainer = Trainer(model, TrainSettings(lr=1e-2), head)
    traces, returns = kind_batch(range(8))
    stats = ppo_critic_steps(trainer, head, traces, returns, 20)
    return model, head, trainer, stats


def test_trained_values_track_the_returns_on_held_out_traces(tiny_lm, trained_critic):
    """A zero head has ``value_loss > 0`` too, so that alone proves nothing: after training, the
    values on traces it never saw must separate the two kinds (MSE down >= 10x from the zero head's,
    correlation > 0.9). Breaks if the value loss does not reach the head (a detached value, a wrong
    sign, returns and values misaligned by a token) or the head reads no hidden state."""
    model, head, _, stats = trained_critic
    held_out, returns = kind_batch(range(100, 108))
    zero_mse, zero_corr = critic_error(tiny_lm, ValueHead(tiny_lm.config.hidden_size), held_out, returns)
    assert zero_mse == pytest.approx(0.5) and zero_corr == 0.0  # the useless critic: values all 0
    assert stats[0]["value_loss"] == pytest.approx(0.5 * zero_mse)  # the trainer's 0.5 * MSE, from 0
    mse, corr = critic_error(model, head, held_out, returns)
    assert mse < 0.1 * zero_mse and corr > 0.9, (mse, corr)
    assert stats[-1]["value_loss"] < 0.1 * stats[0]["value_loss"]


def test_a_trained_critic_round_trips_a_checkpoint_bit_for_bit(tmp_path, tiny_lm, trained_critic):
    """Into a fresh (untrained) model and a fresh zero head: the values equal the trained ones
    exactly. Negative controls: the fresh pair gives other values before the load, and so does a
    load that leaves the head out (the backbone alone does not carry the critic). Breaks if the
    head is not saved, saved before its last step, or loaded into a copy instead of in place."""
    model, head, trainer, _ = trained_critic
    traces, _ = kind_batch(range(100, 104))
    want = critic_values(model, head, traces)
    path = save_checkpoint(tmp_path, 20, model, trainer.optimizer, {}, modules={"value_head": head})

    def fresh():
        m, h = copy.deepcopy(tiny_lm), ValueHead(tiny_lm.config.hidden_size)
        return m, h, Trainer(m, TrainSettings(lr=1e-2), h)

    m, h, t = fresh()
    before = critic_values(m, h, traces)  # zero; kind 1 (return 1) must be far from it
    assert max(float((a - b).abs().max()) for a, b in zip(before, want)) > 0.5
    load_checkpoint(path, m, t.optimizer, modules={"value_head": h})
    assert all(torch.equal(a, b) for a, b in zip(critic_values(m, h, traces), want))
    m, h, t = fresh()
    load_checkpoint(path, m, t.optimizer)  # the policy only: the head stays at zero
    assert all(torch.all(v == 0) for v in critic_values(m, h, traces))


# ---- the loop: a PPO run (advantage = "gae") resumed mid-way equals the uninterrupted run --------
# One SFT step (so the tiny model answers with digits and rewards are not all 0: with 0 rewards the
# critic never moves and any resume looks right), then RL steps 2-4 with the critic; checkpoints at 2, 4.
GAE_RUN = ["prompts=2", "group_size=4", "checkpoint_every=2", "objective.advantage=gae", "sft_steps=1",
           "sft_lr=1e-2"]  # fmt: skip


def gae_config(out, steps=4):
    return load_config(TrainConfig, "configs/quickstart.toml", [f"out={out}", f"steps={steps}", *GAE_RUN])


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def uninterrupted_gae_run(tmp_path_factory):
    rows = []
    train(gae_config(tmp_path_factory.mktemp("gae") / "run"), on_step=rows.append)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[1]["value_loss"] > 0  # the critic learns
    return rows


def assert_same_steps(got, want):
    """Rewards and token counts exactly; losses to float rounding. Two fresh runs of one config in
    one process already differ there: the engine's sampling log-probs (mismatch_kl ~1e-13) enter the
    policy loss through the ratio, ~1e-7 absolute; value_loss is the trainer's alone (1e-6 covers
    the weights' rounding after one more step)."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for k in ("reward", "reward_max", "tokens", "trained_tokens"):
            assert g[k] == w[k], (g["step"], k)
        assert g["value_loss"] == pytest.approx(w["value_loss"], rel=1e-6), g["step"]
        for k in ("loss", "grad_norm"):
            assert g[k] == pytest.approx(w[k], rel=1e-3, abs=1e-6), (g["step"], k)


@pytest.mark.parametrize("how", ["crash", "extend"])
def test_a_resumed_gae_run_equals_the_uninterrupted_one(tmp_path, uninterrupted_gae_run, how, monkeypatch):
    """Resumed from the step-2 checkpoint: after a crash in step 3 (the same config), or a run of
    steps = 2 extended to steps = 4. Breaks if the critic, its optimizer state or the RNG/data
    position is not restored (steps 3-4 then sample or score differently). Negative control: the
    same resume with the value head left out of the load differs (value_loss by ~40%)."""
    want = uninterrupted_gae_run[2:]
    run = tmp_path / "run"
    if how == "crash":

        def crash(m):
            if m["step"] == 3:  # after the step-2 checkpoint
                raise Crash

        with pytest.raises(Crash):
            train(gae_config(run), on_step=crash)
    else:
        train(gae_config(run, steps=2))
    control_dir = shutil.copytree(run, tmp_path / "control")  # the same run in another folder
    saved = json.loads((control_dir / "config.json").read_text())
    (control_dir / "config.json").write_text(json.dumps(saved | {"out": str(control_dir)}))
    got = []
    train(gae_config(run), resume=True, on_step=got.append)  # extend: a larger steps is allowed
    assert_same_steps(got, want)

    real = loop.load_checkpoint

    def without_the_critic(path, model, optimizer, modules=None, **kw):
        kept = {k: v for k, v in (modules or {}).items() if k != "value_head"}
        return real(path, model, optimizer, kept, **kw)

    monkeypatch.setattr(loop, "load_checkpoint", without_the_critic)
    control = []
    train(gae_config(control_dir), resume=True, on_step=control.append)
    assert abs(control[0]["value_loss"] - want[0]["value_loss"]) > 0.1 * want[0]["value_loss"]
