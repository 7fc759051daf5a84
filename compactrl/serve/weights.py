"""What ``POST /v1/load_weights`` reads: a model folder's (or checkpoint's) weights, or a LoRA adapter,
merged over the weights it was trained on.

An adapter is what RL trainers that train LoRA (TRL, verl, prime-rl, ART; peft's ``save_pretrained``)
hand an inference server each step: ``adapter_config.json`` + ``adapter_model.safetensors``, a few MB
instead of the whole model. compactrl's own checkpoints hold theirs as ``lora.safetensors`` (the
settings in its metadata) next to the merged ``model/`` folder. Each adapter replaces the previous
one: it is merged over the base weights (those loaded before the first adapter), never over a
previous adapter's merge.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from compactrl.serve.protocol import ApiError

PEFT_CONFIG, PEFT_WEIGHTS, OWN_WEIGHTS = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "lora.safetensors",
)
# peft's key of an adapter matrix: [base_model.model.]<module>.lora_{A,B}[.<adapter name>].weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<name>[\w-]+))?\.weight$"
)


def is_adapter(path: Path) -> bool:
    return (path / PEFT_CONFIG).is_file() or (path / OWN_WEIGHTS).is_file() or path.name == OWN_WEIGHTS


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A model folder's weights (or a training checkpoint's or run folder's newest model)."""
    from compactrl.models.loading import checkpoint_files
    from compactrl.rl.checkpoint import CheckpointError, resolve_checkpoint

    if not path.exists():
        raise ApiError(
            400, f"{path} does not exist; give a model folder (model.safetensors) or a checkpoint", "path"
        )
    if not (path / "model.safetensors").exists() and not (path / "model.safetensors.index.json").exists():
        try:
            path = resolve_checkpoint(path) / "model"
        except CheckpointError as e:
            raise ApiError(400, f"{e}; or give a model folder (model.safetensors)", "path") from None
    state = {}
    for f in checkpoint_files(path):
        state.update(load_file(f))
    return state


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """A LoRA adapter's weight deltas ``scale * B @ A`` (float32), by the names of the weights they
    change: a peft adapter folder, or compactrl's ``lora.safetensors`` (a file or a checkpoint)."""
    if (path / PEFT_CONFIG).is_file():
        cfg = json.loads((path / PEFT_CONFIG).read_text())
        unsupported = [
            k for k in ("use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out") if cfg.get(k)
        ]
        if unsupported:
            raise ApiError(
                400, f"{path / PEFT_CONFIG} sets {unsupported}; only plain LoRA merges here", "path"
            )
        r, alpha = cfg["r"], cfg["lora_alpha"]
        scale = alpha / r**0.5 if cfg.get("use_rslora") else alpha / r
        f = path / PEFT_WEIGHTS
        if not f.is_file():
            raise ApiError(
                400, f"{f} is missing next to {PEFT_CONFIG} (peft's save_pretrained writes both)", "path"
            )
    else:
        f = path if path.name == OWN_WEIGHTS else path / OWN_WEIGHTS
        with safe_open(f, "pt") as h:
            meta = (h.metadata() or {}).get("lora")
        if meta is None:
            raise ApiError(
                400,
                f"{f} has no lora settings in its metadata; it was not written by compactrl train",
                "path",
            )
        settings = json.loads(meta)
        scale = settings["alpha"] / settings["r"]
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(f).items():
        m = _KEY.match(key)
        if m is None:
            raise ApiError(
                400, f"{f}: {key!r} is not a LoRA matrix (lora_A / lora_B of a linear layer)", "path"
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = t.float()
    deltas = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ApiError(400, f"{f}: {module} has lora_{''.join(ab)} without its other half", "path")
        deltas[f"{module}.weight"] = scale * ab["B"] @ ab["A"]
    return deltas


class AdapterMerger:
    """Merges adapters over the base weights it saved when the first came (the engine's thread)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # the weights an adapter changed, as they were before

    def state(self, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights to load for this adapter: base + delta where it acts, and the base back where a
        previous adapter acted and this one does not."""
        params = {
            k.replace(".base_layer.", "."): p for k, p in self.model.named_parameters() if "lora_" not in k
        }
        for name, d in deltas.items():
            if name not in params:
                raise ApiError(
                    400, f"the adapter changes {name!r}, which this model does not have; was it trained on "
                    "another model?", "path"
                )  # fmt: skip
            if tuple(d.shape) != tuple(params[name].shape):
                raise ApiError(
                    400,
                    f"the adapter's {name} is {tuple(d.shape)}, the model's {tuple(params[name].shape)}",
                    "path",
                )
        for name in deltas:
            self.base.setdefault(name, params[name].detach().clone())
        return {
            name: (b.float() + deltas[name]).to(b.dtype) if name in deltas else b
            for name, b in self.base.items()
        }

    def forget(self) -> None:
        """Whole weights were loaded: they are the base of the next adapter."""
        self.base = {}
