"""Decoder config read from a Hugging Face ``config.json``, with every field we do not implement refused.

A config field we silently ignored would give wrong numbers with no error, so anything that
changes the math and is not implemented here is an error that names the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or config value this decoder does not implement."""


class RopeConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rope_type: Literal["default", "linear", "llama3"] = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(BaseModel):
    """The subset of a HF Llama/Qwen2/Qwen3 config that defines the forward pass."""

    model_config = ConfigDict(extra="forbid")

    model_type: Literal["llama", "qwen2", "qwen3"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # llama/qwen3: bias on q,k,v,o
    qkv_bias: bool = False  # qwen2: bias on q,k,v only
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3
    rope: RopeConfig = RopeConfig()
    eos_token_id: list[int] = []
    bos_token_id: int | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        return self

    @property
    def architecture(self) -> str:
        return FAMILIES[self.model_type]

    def num_parameters(self) -> int:
        d, f, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        hq, hkv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = d * hq + 2 * d * hkv + hq * d
        if self.attention_bias or self.qkv_bias:
            attn += hq + 2 * hkv + (d if self.attention_bias else 0)
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        return V * d * (1 if self.tie_word_embeddings else 2) + L * per_layer + d

    # ---- HF config.json ---------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        mt = hf.get("model_type")
        if mt not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type {mt!r} is not supported; compactrl implements {sorted(FAMILIES)} "
                "(Llama, Qwen2, Qwen3 decoders)"
            )
        archs = hf.get("architectures") or [FAMILIES[mt]]
        if archs != [FAMILIES[mt]]:
            raise UnsupportedModelError(
                f"architectures {archs} is not supported; expected [{FAMILIES[mt]!r}]"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU) is")
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=true is not supported; full attention only")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError("pretraining_tp != 1 is not supported")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in hf]
        if missing:
            raise UnsupportedModelError(f"config.json lacks required field(s) {missing}")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=attn_bias and mt != "qwen2",
            qkv_bias=mt == "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=mt == "qwen3",
            rope=_rope_from_hf(hf),
            eos_token_id=eos,
            bos_token_id=hf.get("bos_token_id"),
        )

    def to_hf(self) -> dict:
        """A config.json that transformers loads into the same architecture."""
        hf = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope.theta,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        else:
            hf["use_sliding_window"] = False
        if self.rope.rope_type != "default":
            scaling = {"rope_type": self.rope.rope_type, "factor": self.rope.factor}
            if self.rope.rope_type == "llama3":
                scaling |= {
                    "low_freq_factor": self.rope.low_freq_factor,
                    "high_freq_factor": self.rope.high_freq_factor,
                    "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                }
            hf["rope_scaling"] = scaling
        return hf


def _rope_from_hf(hf: dict) -> RopeConfig:
    """RoPE from either the classic (``rope_theta`` + ``rope_scaling``) or the transformers 5
    (``rope_parameters``) layout."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; compactrl implements {list(ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) not in (None, 1, 1.0):
            raise UnsupportedModelError(f"rope parameter {key}={params[key]} is not supported")
    fields = {
        k: params[k] for k in RopeConfig.model_fields if k in params and k not in ("rope_type", "theta")
    }
    return RopeConfig(**fields, rope_type=rope_type, theta=theta)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: point at a Hugging Face model folder (config.json + *.safetensors), "
            "or create a tiny one with `compactrl init-model DIR`"
        )
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return ModelConfig.from_hf(hf)
