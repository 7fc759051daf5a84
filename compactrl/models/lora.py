"""LoRA adapters (peft) on our decoder, and the views of them that checkpoints need.

peft injects ``lora.Linear`` wrappers into the named projections of our own ``CausalLM`` (no
transformers model involved); the base weights are frozen. The engine sees a wrapped projection
and falls back from its fused q/k/v GEMM to the layer's own ``project``, so sampling runs the
adapters too. Checkpoints store the adapters alone (the base is the run's initial model) plus a
merged, plain Hugging Face model folder that ``eval``, ``verify`` and transformers load.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

THREAD = "thread"  # the adapter name of a loaded SideQuest thread adapter (strategy.thread_adapter)
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


def add_lora(model: torch.nn.Module, settings: LoraSettings, name: str = "default") -> None:
    """Inject adapters ``name`` in place (``B = 0``: the model's outputs are unchanged) and freeze the
    base. Adapters already there (a thread adapter) stay active and frozen: each layer sums them all."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer
    except ImportError as e:
        raise ImportError("train.lora needs peft: pip install 'compactrl[lora]' (or pip install peft)") from e

    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.targets))  # fmt: skip
    with warnings.catch_warnings():  # a second adapter is what we mean: peft warns of it
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        inject_adapter_in_model(config, model, adapter_name=name)
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.set_adapter(list(m.lora_A))  # peft activates only the newest adapter
    for pname, p in model.named_parameters():
        p.requires_grad_(_of(pname, "default") and name != THREAD)


def _of(key: str, name: str) -> bool:
    """Whether weight ``key`` belongs to adapter ``name``: the run's own ("default"), or a loaded
    (frozen) thread adapter's (THREAD)."""
    return "lora_" in key and (f".{THREAD}." in key) == (name == THREAD)


def has_lora(model: torch.nn.Module) -> bool:
    """Whether the model has adapters of its own (a loaded thread adapter does not count)."""
    return any(_of(key, "default") for key, _ in model.named_parameters())


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights (Hugging Face names) with the model's own adapters merged in. A
    gated adapter is not (a loaded thread adapter, or the run's own under sidequest.adapter =
    'thread'): it acts on the auxiliary thread's tokens only, so merged it would act on the main
    thread's too; the weights are then what the main thread computes, and the adapter loads on its
    own (:func:`load_thread_adapter`)."""
    from peft.tuners.lora import LoraLayer

    gate = getattr(model, "adapter_gate", None)
    gated = {THREAD} | ({gate.name} if gate is not None else set())
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in gated:
                    continue
                key = f"{name}.weight"
                state[key] = state[key] + module.get_delta_weight(adapter).to(state[key].dtype)
    return state


class Adapters:
    """The adapter weights as a checkpointable unit (``state_dict`` / ``load_state_dict``); the
    settings go into the file's metadata, so a checkpoint's adapters load without the run config."""

    def __init__(self, model: torch.nn.Module, settings: LoraSettings | None = None, name: str = "default"):
        self.model, self.name = model, name
        self.metadata = {"lora": settings.model_dump_json()} if settings is not None else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if _of(k, self.name)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = set(self.state_dict())
        if set(state) != mine:
            raise ValueError(
                f"adapter weights do not fit the model (missing {sorted(mine - set(state))[:3]}, unexpected "
                f"{sorted(set(state) - mine)[:3]}); resume with the run's own lora settings"
            )
        self.model.load_state_dict(state, strict=False)


class AdapterGate:
    """Which tokens of the next forward adapter ``name`` acts on: ``mask [N]`` over the forward's
    tokens (1 where it acts), or None (everywhere). A forward hook scales the adapter's ``B``
    output, so a gated-off token computes exactly what the model without it computes.

    SideQuest's thread adapter: it acts on the auxiliary thread's own tokens only, so the main
    thread is the policy without it and the thread reads the prefix KV the policy wrote (the KV the
    engine's fork shares). Other adapters (the policy's own, trained by RL) act everywhere."""

    def __init__(self, model: torch.nn.Module, name: str):
        from peft.tuners.lora import LoraLayer

        self.mask: torch.Tensor | None = None
        self.name = name
        self.handles = [m.lora_B[name].register_forward_hook(self._hook) for m in model.modules()
                        if isinstance(m, LoraLayer) and name in m.lora_B]  # fmt: skip
        if not self.handles:
            raise ValueError(f"the model has no LoRA adapter {name!r} to gate")

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


def gate_adapters(model: torch.nn.Module, name: str = "default") -> AdapterGate:
    """Install (once) and return the model's adapter gate, on adapter ``name``."""
    if getattr(model, "adapter_gate", None) is None:
        model.adapter_gate = AdapterGate(model, name)
    return model.adapter_gate


def load_thread_adapter(model: torch.nn.Module, checkpoint: str | Path) -> AdapterGate:
    """Inject a checkpoint's adapters (``lora.safetensors``, its settings in the metadata) into
    ``model`` as adapter ``thread``, frozen, and gate them: they act where the gate says (SideQuest:
    the auxiliary thread). Load it before the run's own adapters (``add_lora``), if any."""
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
    if has_lora(model) or getattr(model, "adapter_gate", None) is not None:
        raise ValueError("load the thread adapter into a model without adapters (before add_lora), once")
    add_lora(model, LoraSettings.model_validate_json(meta), name=THREAD)
    p = next(model.parameters())
    state = {k.replace(".default.", f".{THREAD}."): v.to(p.device, p.dtype) for k, v in state.items()}
    try:
        Adapters(model, name=THREAD).load_state_dict(state)
    except ValueError as e:
        raise ValueError(f"{f}: {e} (it was trained on another model)") from e
    return gate_adapters(model, THREAD)
