"""Load and save Hugging Face checkpoint folders (config.json + single or sharded safetensors)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from compactrl.models.config import ModelConfig, load_config
from compactrl.models.decoder import CausalLM

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(DTYPES)}")
    return DTYPES[dtype]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map'; it is not a safetensors shard index")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {model_dir}: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir}; compactrl loads safetensors "
        "checkpoints only (convert .bin with transformers' save_pretrained(safe_serialization=True))"
    )


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the decoder for ``config.json`` and load its weights strictly (every tensor accounted for)."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    files = checkpoint_files(model_dir)
    dtype = resolve_dtype(dtype)
    state, where = {}, {}
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                # a copy, not a view: safetensors hands out tensors at the file's byte offsets, so a
                # weight can start mid cache line and every vector load of it then spans two lines
                # (SmolLM2 decodes ~1.2x slower at batch 1); torch's allocator aligns to 64 bytes
                state[name], where[name] = sf.get_tensor(name).to(dtype, copy=True), f
    if cfg.tie_word_embeddings:
        cfg = _tie(cfg, state, where, model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = {n for n, _ in model.named_parameters()}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match the {cfg.architecture} built from its config.json: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, p in model.named_parameters():
        if tuple(state[name].shape) != tuple(p.shape):
            raise ValueError(
                f"{name} has shape {tuple(state[name].shape)} in the checkpoint but the config implies "
                f"{tuple(p.shape)}; config.json and the weights disagree"
            )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()


def _tie(
    cfg: ModelConfig, state: dict[str, torch.Tensor], where: dict[str, Path], model_dir: Path
) -> ModelConfig:
    """``tie_word_embeddings: true`` as transformers 5.24 loads it: a checkpoint with only one of
    the two matrices ties both to it; one with both, equal, ties them; one with both, different,
    keeps both untied (with a warning) rather than dropping one."""
    head, emb = "lm_head.weight", "model.embed_tokens.weight"
    if head not in state:
        return cfg
    if emb not in state:
        state[emb] = state.pop(head)
        return cfg
    if torch.equal(state[head], state[emb]):
        del state[head]
        return cfg
    warnings.warn(
        f"{where[head]} holds an lm_head.weight that differs from model.embed_tokens.weight although "
        f"{model_dir / 'config.json'} sets tie_word_embeddings=true; loading them untied, as transformers "
        "does (set tie_word_embeddings to false in config.json to silence this)",
        stacklevel=3,
    )
    return cfg.model_copy(update={"tie_word_embeddings": False})


def save_model(model: CausalLM, model_dir: str | Path, extra_config: dict | None = None) -> None:
    """Write config.json + model.safetensors that both compactrl and transformers load."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    from compactrl.models.lora import has_lora, merged_state_dict

    weights = merged_state_dict(model) if has_lora(model) else model.state_dict()
    state = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    hf = model.config.to_hf() | (extra_config or {})
    hf["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (model_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")  # fmt: skip


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy the tokenizer and chat-template files a model folder has, so ``dst`` is complete."""
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


def config_summary(cfg: ModelConfig) -> dict:
    return {
        "family": cfg.model_type,
        "parameters": cfg.num_parameters(),
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
    }
