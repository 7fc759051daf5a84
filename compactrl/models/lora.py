"""LoRA adapters (peft) on our decoder, and the views of them that checkpoints need.

peft injects ``lora.Linear`` wrappers into the named projections of our own ``CausalLM`` (no
transformers model involved); the base weights are frozen. The engine sees a wrapped projection
and falls back from its fused q/k/v GEMM to the layer's own ``project``, so sampling runs the
adapters too. Checkpoints store the adapters alone (the base is the run's initial model) plus a
merged, plain Hugging Face model folder that ``eval``, ``verify`` and transformers load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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
    """The adapter weights as a checkpointable unit (``state_dict`` / ``load_state_dict``); the
    settings go into the file's metadata, so a checkpoint's adapters load without the run config."""

    def __init__(self, model: torch.nn.Module, settings: LoraSettings | None = None):
        self.model = model
        self.metadata = {"lora": settings.model_dump_json()} if settings is not None else None

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


class AdapterGate:
    """Which tokens of the next forward the adapters act on: ``mask [N]`` over the forward's tokens
    (1 where they act), or None (everywhere). A forward hook scales each adapter's ``B`` output,
    so a gated-off token computes exactly what the base model computes.

    SideQuest's thread adapter: the adapters act on the auxiliary thread's own tokens only, so the
    main thread is the base model and the thread reads the prefix KV the base wrote (the KV the
    engine's fork shares)."""

    def __init__(self, model: torch.nn.Module):
        from peft.tuners.lora import LoraLayer

        self.mask: torch.Tensor | None = None
        self.handles = [b.register_forward_hook(self._hook) for m in model.modules()
                        if isinstance(m, LoraLayer) for b in m.lora_B.values()]  # fmt: skip
        if not self.handles:
            raise ValueError("the model has no LoRA adapters to gate")

    def _hook(self, module, args, out: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return out
        if self.mask.shape[0] != out.shape[-2]:
            raise RuntimeError(f"adapter gate of {self.mask.shape[0]} tokens on a forward of {out.shape[-2]}")
        return out * self.mask.to(out.dtype)[:, None]


@contextmanager
def adapter_mask(model: torch.nn.Module, mask: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Run a forward with the adapters on the tokens ``mask()`` marks, if the model is gated (the
    mask is built only then); the gate opens fully again afterwards."""
    gate = getattr(model, "adapter_gate", None)
    if gate is None:
        yield
        return
    gate.mask = mask()
    try:
        yield
    finally:
        gate.mask = None


def gate_adapters(model: torch.nn.Module) -> AdapterGate:
    """Install (once) and return the model's adapter gate."""
    if getattr(model, "adapter_gate", None) is None:
        model.adapter_gate = AdapterGate(model)
    return model.adapter_gate


def load_thread_adapter(model: torch.nn.Module, checkpoint: str | Path) -> AdapterGate:
    """Inject a checkpoint's adapters (``lora.safetensors``, its settings in the metadata) into
    ``model`` and gate them: they act where the gate says (SideQuest: the auxiliary thread)."""
    from safetensors import safe_open

    f = Path(checkpoint) / "lora.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: point at a checkpoint folder of a run with train.lora")
    with safe_open(f, "pt") as h:
        meta = (h.metadata() or {}).get("lora")
        state = {k: h.get_tensor(k) for k in h.keys()}
    if meta is None:
        raise ValueError(f"{f} carries no LoRA settings in its metadata (written before they were "
                         "saved): train the adapter again")  # fmt: skip
    add_lora(model, LoraSettings.model_validate_json(meta))
    p = next(model.parameters())
    Adapters(model).load_state_dict({k: v.to(p.device, p.dtype) for k, v in state.items()})
    model.requires_grad_(False)
    return gate_adapters(model)
