"""Llama / Qwen2 / Qwen3 decoders in plain PyTorch, HF checkpoint loading, tokenizers, tiny models."""

from compactrl.models.config import ModelConfig, UnsupportedModelError, load_config
from compactrl.models.decoder import CausalLM, token_logprobs
from compactrl.models.loading import load_model, save_model

__all__ = [
    "CausalLM",
    "ModelConfig",
    "UnsupportedModelError",
    "load_config",
    "load_model",
    "save_model",
    "token_logprobs",
]
