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
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the rope parameters each type must have: transformers 5.24 refuses a config without them
# (llama3 and yarn fall back to max_position_embeddings for original_max_position_embeddings)
ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
YARN_FIELDS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")

# what transformers 5.24's config classes assume when config.json lacks a field (None: derived,
# head_dim = hidden_size // num_attention_heads, num_key_value_heads = num_attention_heads)
HF_DEFAULTS = {
    "llama": {"head_dim": None, "num_key_value_heads": None, "max_position_embeddings": 2048},
    "qwen2": {"head_dim": None, "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768},
}


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or config value this decoder does not implement."""


class RopeConfig(BaseModel):
    """RoPE parameters, named as in transformers' ``rope_parameters``. A parameter left None takes
    transformers' default where it has one (yarn: ``beta_fast`` 32, ``beta_slow`` 1, the attention
    factor from ``factor``/``mscale``); the ones a type requires (:data:`ROPE_REQUIRED`) have none."""

    model_config = ConfigDict(extra="forbid")

    rope_type: Literal["default", "linear", "llama3", "yarn"] = "default"
    theta: float = 10000.0  # transformers' default_theta
    factor: float | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    attention_factor: float | None = None  # yarn: cos/sin scale
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    @model_validator(mode="after")
    def _check(self) -> RopeConfig:
        missing = [k for k in ROPE_REQUIRED[self.rope_type] if getattr(self, k) is None]
        if missing:
            raise UnsupportedModelError(f"rope type {self.rope_type!r} needs {missing}")
        return self


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
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        if mt == "llama" and hidden % heads:  # transformers' LlamaConfig refuses it, head_dim or not
            raise UnsupportedModelError(
                f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); "
                "transformers refuses this llama config too"
            )
        defaults = HF_DEFAULTS[mt]
        head_dim = hf.get("head_dim", defaults["head_dim"])
        if head_dim is None and "head_dim" in hf and mt != "llama":
            raise UnsupportedModelError(
                f"head_dim is null in a {mt} config.json (transformers cannot load it either): "
                "write the number, or remove the key"
            )
        kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
        max_pos = hf.get("max_position_embeddings", defaults["max_position_embeddings"])
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or heads,
            head_dim=head_dim or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=attn_bias and mt != "qwen2",  # qwen2: q/k/v biases always, o never
            qkv_bias=mt == "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)) and mt == "llama",  # the qwen MLPs have none
            qk_norm=mt == "qwen3",
            rope=_rope_from_hf(hf, max_pos),
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
            r = self.rope
            keys = ROPE_REQUIRED[r.rope_type] + (YARN_FIELDS if r.rope_type == "yarn" else ())
            hf["rope_scaling"] = {"rope_type": r.rope_type} | {
                k: getattr(r, k) for k in keys if getattr(r, k) is not None
            }
            if r.rope_type == "yarn" and not r.truncate:
                hf["rope_scaling"]["truncate"] = False
        return hf


def _rope_from_hf(hf: dict, max_position_embeddings: int) -> RopeConfig:
    """RoPE parameters resolved as transformers 5.24 resolves them, from the classic
    (``rope_theta`` + ``rope_scaling``) or the transformers 5 (``rope_parameters``) layout.

    A non-empty ``rope_scaling`` replaces ``rope_parameters`` outright; ``rope_theta`` inside the
    dict beats the top-level one (default 10000); ``type`` is the old name of ``rope_type``. For
    llama3 and yarn a top-level ``original_max_position_embeddings`` beats the dict's, and with
    neither it is ``max_position_embeddings``. A yarn ``factor`` of null is
    ``max_position_embeddings / original_max_position_embeddings``. Parameters a type does not
    use are ignored (transformers only warns about them); a missing required one is an error.
    """
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise UnsupportedModelError(f"per-layer-type rope parameters ({nested}) are not supported")
    rope_type = params["rope_type"] if "rope_type" in params else params.get("type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; compactrl implements {list(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("rope parameter partial_rotary_factor != 1 is not supported")
    fields = {"rope_type": rope_type, "theta": params.get("rope_theta", hf.get("rope_theta", 10000.0))}
    if fields["theta"] is None:
        raise UnsupportedModelError("rope_theta is null in config.json; give a number or remove it")
    required = ROPE_REQUIRED[rope_type]
    missing = [k for k in required if k not in params and k != "original_max_position_embeddings"]
    if missing:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} needs {missing} in config.json's rope_scaling / rope_parameters "
            "(transformers refuses this config too); add the value(s) the checkpoint was trained with"
        )
    for k in required + (YARN_FIELDS if rope_type == "yarn" else ()):
        fields[k] = params.get(k)
    if "original_max_position_embeddings" in required:
        if "original_max_position_embeddings" in hf:  # top level first, as transformers (Phi-3 style)
            fields["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        elif "original_max_position_embeddings" not in params:
            fields["original_max_position_embeddings"] = max_position_embeddings
    if rope_type == "yarn":
        omax = fields["original_max_position_embeddings"]
        if fields["factor"] is None and omax:
            fields["factor"] = max_position_embeddings / omax
        fields["truncate"] = bool(params.get("truncate", True))
    for k, v in fields.items():
        if k in required and v is None:
            raise UnsupportedModelError(f"rope parameter {k} is null in config.json; give its value")
    return RopeConfig(**fields)


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
