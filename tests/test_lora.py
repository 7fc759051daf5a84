"""LoRA via peft: adapters start as the identity, train alone, run in the engine (which drops
its fused projection for them), and export as a plain merged Hugging Face model."""

import copy

import numpy as np
import pytest
import torch
from test_trainer import engine_traces, samples_of

from compactrl.models.loading import load_model, save_model
from compactrl.models.lora import Adapters, LoraSettings, add_lora, has_lora
from compactrl.rl.forward import stream_logprobs
from compactrl.rl.trainer import Trainer, TrainSettings

pytest.importorskip("peft")


def logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens), torch.arange(len(tokens)))


def test_adapters_train_alone_run_in_the_engine_and_merge(tiny_lm, tmp_path):
    model = copy.deepcopy(tiny_lm)
    traces = engine_traces(model, n=2, seed=11)  # engine with its fused projection, before LoRA
    base = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = traces[0].tokens
    before = logits(model, tokens)
    trainer = Trainer(model, TrainSettings(lr=1e-2, lora=LoraSettings(r=4)))
    assert has_lora(model) and torch.equal(logits(model, tokens), before)  # B = 0: the identity
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    for _ in range(2):
        trainer.step(samples_of(traces))
    after = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base is frozen
    assert (logits(model, tokens) - before).abs().max() > 1e-3  # the adapters moved the outputs

    fresh = engine_traces(model, n=2, seed=12)  # a new engine on the adapted model samples with LoRA
    stats = trainer.backward(samples_of(fresh))
    assert stats["mismatch_kl"] < 1e-6 and stats["mismatch_max_abs"] < 5e-5
    plain = copy.deepcopy(tiny_lm)
    with torch.no_grad():
        ignored = stream_logprobs(plain, fresh)[0][torch.as_tensor(fresh[0].trainable)]
    engine_lp = torch.as_tensor(fresh[0].logprobs[fresh[0].trainable], dtype=torch.float32)
    assert (ignored - engine_lp).abs().max() > 1e-3  # negative control: without the adapters

    save_model(model, tmp_path / "merged")  # a plain HF folder with the adapters merged in
    merged = load_model(tmp_path / "merged")
    assert not has_lora(merged)
    torch.testing.assert_close(logits(merged, tokens), logits(model, tokens), atol=1e-4, rtol=1e-5)


def test_adapter_checkpoint_state_round_trips_and_names_a_mismatch(tiny_lm):
    a, b = copy.deepcopy(tiny_lm), copy.deepcopy(tiny_lm)
    add_lora(a, LoraSettings(r=4, targets=("q_proj", "v_proj")))
    add_lora(b, LoraSettings(r=4, targets=("q_proj", "v_proj")))
    state = {k: torch.randn_like(v) for k, v in Adapters(a).state_dict().items()}
    Adapters(a).load_state_dict(state)
    Adapters(b).load_state_dict(Adapters(a).state_dict())
    tokens = np.arange(3, 40)
    torch.testing.assert_close(logits(a, tokens), logits(b, tokens), atol=0, rtol=0)
    c = copy.deepcopy(tiny_lm)
    add_lora(c, LoraSettings(r=4, targets=("q_proj",)))
    with pytest.raises(ValueError, match="lora settings"):
        Adapters(c).load_state_dict(state)
    with pytest.raises(ValueError, match="not projections"):
        LoraSettings(targets=("qkv",))


def test_a_gated_adapter_acts_only_on_the_tokens_the_mask_marks(tiny_lm):
    """SideQuest's thread adapter: a gated-off token computes exactly what the base computes."""
    from compactrl.models.lora import adapter_mask, gate_adapters

    plain, model = copy.deepcopy(tiny_lm), copy.deepcopy(tiny_lm)
    add_lora(model, LoraSettings(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    tokens = np.arange(3, 40)
    T, k = len(tokens), 20
    base, everywhere = logits(plain, tokens), logits(model, tokens)
    gate = gate_adapters(model)
    assert torch.equal(logits(model, tokens), everywhere)  # no mask: everywhere
    with adapter_mask(model, lambda: torch.zeros(T, dtype=torch.bool)):
        assert torch.equal(logits(model, tokens), base)
    with adapter_mask(model, lambda: torch.ones(T, dtype=torch.bool)):
        assert torch.equal(logits(model, tokens), everywhere)
    with adapter_mask(model, lambda: torch.arange(T) >= k):
        mixed = logits(model, tokens)
    assert gate.mask is None  # open again after the forward
    assert torch.equal(mixed[:, :k], base[:, :k])  # before the thread: the base (causal)
    assert (mixed[:, k:] - base[:, k:]).abs().max() > 1e-3  # the adapter acts on the thread's tokens
    assert (mixed[:, k:] - everywhere[:, k:]).abs().max() > 1e-3  # reading the base's K/V of the prefix
    short = lambda: torch.ones(T - 1, dtype=torch.bool)  # noqa: E731
    with adapter_mask(model, short), pytest.raises(RuntimeError, match="gate"):
        logits(model, tokens)


def test_eval_of_a_thread_adapter_run_runs_the_adapter_on_the_forks_only(tmp_path):
    """`compactrl eval --checkpoint` on a sidequest.adapter = 'thread' run evaluates what was trained:
    the main thread is the base model exactly and the forks run the checkpoint's adapter (gated to
    their tokens); the checkpoint's merged model folder is the base, what the main thread computes.
    An RL run under a frozen thread adapter (strategy.thread_adapter) is evaluated with it too."""
    from pathlib import Path

    from compactrl.config import load_config
    from compactrl.models.lora import load_thread_adapter
    from compactrl.rl.evaluate import evaluate
    from compactrl.rl.loop import TrainConfig, train
    from compactrl.trace import load_traces

    def gap(model, trace) -> float:  # the engine's sampling log-probs vs the model's one-pass forward
        with torch.no_grad():
            (lp,) = stream_logprobs(model, [trace])
        m = trace.trainable
        return float(np.abs(lp.double().numpy()[m] - trace.logprobs[m]).max())

    run = tmp_path / "train"
    sets = [f"out={run}", "steps=1", "prompts=2", "threads=1", "model.path=", "model.size=tiny",
            "env.world_size=40", "env.max_hops=3", "strategy.max_tokens=16", "train.lr=5e-2"]  # fmt: skip
    cfg = load_config(TrainConfig, "configs/sidequest/train_thread.toml", sets)
    assert train(cfg)["aux_samples"] > 0
    ckpt = run / "checkpoints" / "step_00000001"
    base, thread = load_model(run / "model"), load_model(run / "model")
    load_thread_adapter(thread, ckpt)
    short = {"mode": "stream", "rollout": cfg.rollout.model_copy(update={"max_turns": 3})}

    def played(cfg, checkpoint):
        result = evaluate(cfg.model_copy(update=short), checkpoint, episodes=2, traces=True)
        traces = load_traces(Path(result["path"]).with_suffix(".traces.jsonl"))
        return [t for t in traces if not t.meta.get("aux")], [t for t in traces if t.meta.get("aux")]

    main, aux = played(cfg, ckpt)
    assert max(gap(base, t) for t in main) < 5e-5  # the main thread: the base model
    assert aux and max(gap(thread, t) for t in aux) < 5e-5  # the forks: the trained adapter
    assert min(gap(base, t) for t in aux) > 1e-3  # negative control: it acts on them
    merged = load_model(ckpt / "model").state_dict()
    assert all(torch.equal(merged[k], v) for k, v in base.state_dict().items())

    rl = load_config(TrainConfig, "configs/sidequest/rl.toml", [  # the initial policy under the adapter
        f"out={tmp_path / 'rl'}", f"model.path={run / 'model'}", f"strategy.thread_adapter={ckpt}",
        "strategy.every=1", "strategy.max_tokens=16", "env.world_size=40", "threads=1"])  # fmt: skip
    main, aux = played(rl, None)
    assert max(gap(base, t) for t in main) < 5e-5
    assert aux and max(gap(thread, t) for t in aux) < 5e-5 and min(gap(base, t) for t in aux) > 1e-3
