"""Tiny random-weight checkpoints in Hugging Face format, for tests, demos and benchmarks.

Nothing can be downloaded here, so every test model is made locally: a BPE tokenizer trained
on local text with a ChatML template, and random weights scaled so that attention is peaked
and the context visibly changes the next-token distribution (the negative controls need that).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import torch

from compactrl.models.config import ModelConfig, RopeConfig
from compactrl.models.decoder import CausalLM
from compactrl.models.loading import save_model
from compactrl.models.tiny_tokenizer import train_tiny_tokenizer

Family = Literal["llama", "qwen2", "qwen3"]

# name -> (hidden, layers, heads, kv_heads, intermediate)
SIZES = {
    "tiny": (64, 2, 4, 2, 128),
    "small": (256, 4, 8, 2, 704),
    "base": (512, 8, 8, 4, 1408),
}

ROPES = {
    "llama": RopeConfig(
        rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=1024,
    ),
    "qwen2": RopeConfig(rope_type="yarn", theta=1000000.0, factor=4.0, original_max_position_embeddings=8192),
    "qwen3": RopeConfig(theta=1000000.0),
}  # fmt: skip


def tiny_config(family: Family, vocab_size: int, size: str = "tiny", **overrides) -> ModelConfig:
    """A config exercising each family's particular features (llama3 RoPE; qkv bias and YaRN RoPE,
    as Qwen2.5's long-context configs; q/k-norm)."""
    if size not in SIZES:
        raise ValueError(f"size {size!r} unknown; choose one of {list(SIZES)}")
    d, L, h, kv, f = SIZES[size]
    fields = dict(
        model_type=family,
        vocab_size=vocab_size,
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=L,
        num_attention_heads=h,
        num_key_value_heads=kv,
        head_dim=d // h,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=family == "qwen3",
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        rope=ROPES[family],
    )
    return ModelConfig(**(fields | overrides))


@torch.no_grad()
def init_random(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """Fan-in scaled normal weights (not the 0.02 of LLM pre-training, which leaves attention flat)."""
    gen = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name or "lm_head" in name:
            # logits std ~2 whether or not the head is tied: peaked but not saturated
            p.copy_(2.0 * torch.randn(p.shape, generator=gen) / math.sqrt(cfg.hidden_size))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model


def write_tiny_model(
    out_dir: str | Path,
    family: Family = "qwen3",
    size: str = "tiny",
    seed: int = 0,
    vocab_size: int = 2048,
    chat_format: str = "chatml",
    **overrides,
) -> Path:
    """Write tokenizer + config.json + model.safetensors + generation_config.json into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(out_dir, vocab_size=vocab_size, chat_format=chat_format)
    eos = tok.eos_token_ids
    cfg = tiny_config(family, tok.vocab_size, size, eos_token_id=eos, **overrides)
    save_model(init_random(cfg, seed), out_dir)
    gen = {"eos_token_id": eos, "pad_token_id": tok.pad_token_id, "do_sample": True, "temperature": 1.0}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir
