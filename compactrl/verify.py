"""`compactrl verify model`: our decoder against transformers on the same checkpoint folder.

transformers is the oracle here, never a runtime dependency. Two comparisons per model:
plain causal logits, and logits under an eviction mask (transformers given the same 4-D
bool mask and explicit ``position_ids``: its defaults are wrong after an eviction).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from compactrl.masks import dense_mask
from compactrl.models.config import load_config
from compactrl.models.loading import config_summary, load_model, resolve_dtype
from compactrl.models.tiny import write_tiny_model

FAMILIES = ("llama", "qwen2", "qwen3")


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError(
            "`verify model` compares against transformers, which is not installed: "
            "pip install 'compactrl[test]' (or pip install transformers)"
        ) from e
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def sample_evict_at(T: int, seed: int) -> torch.Tensor:
    """A schedule with a few mid-stream evictions (token 0, the 'system prompt', is kept)."""
    rng = np.random.default_rng(seed)
    ev = np.full(T, T)
    for e in sorted(rng.choice(np.arange(T // 4, T), size=3, replace=False)):
        a = int(rng.integers(1, e - 1))
        b = int(rng.integers(a + 1, min(e, a + T // 6) + 1))
        ev[a:b] = np.minimum(ev[a:b], e)
    return torch.as_tensor(ev)


@torch.no_grad()
def compare_with_transformers(model_dir: Path, dtype: str = "float32", T: int = 96, seed: int = 0) -> dict:
    transformers = _import_transformers()
    torch_dtype = resolve_dtype(dtype)
    cfg = load_config(model_dir)
    ours = load_model(model_dir, dtype=torch_dtype)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, attn_implementation="sdpa"
    ).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    pos = torch.arange(T)[None]
    mask = dense_mask(sample_evict_at(T, seed))
    causal = (ours(ids, pos) - theirs(input_ids=ids, position_ids=pos).logits).abs().max()
    evict = (
        ours(ids, pos, mask) - theirs(input_ids=ids, position_ids=pos, attention_mask=mask[None, None]).logits
    )
    return {
        "model": str(model_dir),
        **config_summary(cfg),
        "dtype": dtype,
        "tokens": T,
        "max_abs_logit_diff": float(causal),
        "max_abs_logit_diff_evict_mask": float(evict.abs().max()),
    }


def verify_model(
    model_dir: str | Path | None = None, dtype: str = "float32", tolerance: float | None = None
) -> dict:
    """Compare one folder, or freshly built tiny Llama, Qwen2 and Qwen3 checkpoints."""
    tolerance = tolerance if tolerance is not None else (1e-4 if dtype == "float32" else 5e-2)
    results = {}
    if model_dir is not None:
        r = compare_with_transformers(Path(model_dir), dtype)
        results[r["family"]] = r
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for fam in FAMILIES:
                folder = write_tiny_model(Path(tmp) / fam, family=fam)
                results[fam] = compare_with_transformers(folder, dtype) | {"model": f"tiny {fam} (generated)"}
    worst = max(max(r["max_abs_logit_diff"], r["max_abs_logit_diff_evict_mask"]) for r in results.values())
    return {
        "families": results,
        "tolerance": tolerance,
        "max_abs_logit_diff": worst,
        "ok": worst <= tolerance,
    }
