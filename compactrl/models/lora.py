"""LoRA adapters (peft) on our decoder, and the views of them that checkpoints need.

peft injects ``lora.Linear`` wrappers into the named projections of our own ``CausalLM`` (no
transformers model involved); the base weights are frozen. The engine sees a wrapped projection
and falls back from its fused q/k/v GEMM to the layer's own ``project``, so sampling runs the
adapters too. Checkpoints store the adapters alone (the base is the run's initial model) plus a
merged, plain Hugging Face model folder that ``eval``, ``verify`` and transformers load.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scale alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="> 0: trainer log-probs differ from the engine's")
    targets: tuple[str, ...] = Field(PROJECTIONS, min_length=1, description="projections that get adapters")

    @field_validator("targets")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = sorted(set(v) - set(PROJECTIONS))
        if bad:
            raise ValueError(f"{bad} are not projections of the decoder; choose from {list(PROJECTIONS)}")
        return v


def add_lora(model: torch.nn.Module, settings: LoraSettings) -> None:
    """Inject adapters in place (``B = 0``: the model's outputs are unchanged) and freeze the base."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ImportError("train.lora needs peft: pip install 'compactrl[lora]' (or pip install peft)") from e

    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.targets))  # fmt: skip
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def has_lora(model: torch.nn.Module) -> bool:
    return any("lora_" in name for name, _ in model.named_parameters())


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights (Hugging Face names) with every adapter merged in."""
    from peft.tuners.lora import LoraLayer

    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                key = f"{name}.weight"
                state[key] = state[key] + module.get_delta_weight(adapter).to(state[key].dtype)
    return state


class Adapters:
    """The adapter weights as a checkpointable unit (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if "lora_" in k}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = set(self.state_dict())
        if set(state) != mine:
            raise ValueError(
                f"adapter weights do not fit the model (missing {sorted(mine - set(state))[:3]}, unexpected "
                f"{sorted(set(state) - mine)[:3]}); resume with the run's own lora settings"
            )
        self.model.load_state_dict(state, strict=False)
