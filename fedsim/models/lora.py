"""The ``lora:`` section: parameter-efficient fine-tuning with LoRA adapters (Hu et al. 2022,
"LoRA: Low-Rank Adaptation of Large Language Models"), placed by Hugging Face ``peft``.

Its keys, their defaults and meanings are declared once, in ``LoraConfig`` below (``fedsim list
keys`` prints them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..core.checks import Checks
from ..core.errors import ConfigError, cut, install, shown
from ..core.registry import Registry
from ..core.sections import option


def _without_adapters(key: str, lora: Any, config: Any) -> str | None:
    return None if lora.rank > 0 else "lora.rank is 0: no adapters"


@dataclass
class LoraConfig:
    """The ``lora:`` section (see the module's docstring)."""

    rank: int = option(
        0,
        "r of every LoRA adapter; `0`: no adapters, every parameter is trained. Otherwise only the adapters "
        "train, travel, are aggregated and checkpointed (see [Language models](language-models.md))",
    )
    alpha: float = option(16.0, "the adapters' output is scaled by alpha / rank", unread=_without_adapters)
    dropout: float = option(0.0, "dropout on an adapter's input, in [0, 1)", unread=_without_adapters)
    target_modules: Any | None = option(
        None,
        "the layers to adapt: a name (suffix), a list of them, or `all-linear`; `null`: the model's own list",
        unread=_without_adapters,
    )
    method: str = option(
        "fedit",
        "`fedit`: A and B trained and averaged (FedIT); `ffa`: A frozen, B alone trained and sent (FFA-LoRA)",
        unread=_without_adapters,
    )
    share_base: bool = option(
        True, "the frozen base: one copy every worker reads; `false`: a copy per worker", unread=_without_adapters
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self) -> None:
        """The section's values, each refused in one line."""
        checks = Checks("lora")
        checks.at_least("rank", self.rank, 0)
        if self.alpha <= 0:
            checks.fail("alpha", f"must be > 0, got {self.alpha}")
        checks.within("dropout", self.dropout, 0, 1, "[)")
        checks.choice("method", self.method, METHODS)
        targets = self.target_modules
        if not (targets is None or _names(targets)):
            checks.fail(
                "target_modules",
                f"must be a layer name, a list of them or all-linear (null: the model's), got {shown(targets)}",
            )


METHODS = Registry("LoRA method")
METHODS.register("fedit", "A and B trained, and averaged each as FedAvg averages any parameter (FedIT)")("fedit")
METHODS.register("ffa", "A frozen at its shared initialisation, B alone trained and sent: exact averaging (FFA-LoRA)")(
    "ffa"
)
INSTALL = install("llm")


def _names(value: object) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)


def apply_lora(module: nn.Module, lora: LoraConfig, model_name: str) -> nn.Module:
    """``module`` with LoRA adapters on its target layers, in place, everything else frozen.

    fedit (FedIT: Zhang et al. 2024, "Towards Building the Federated GPT: Federated Instruction
    Tuning"): A and B are trained and the server averages each, as FedAvg averages any
    parameter. ffa (FFA-LoRA: Sun et al. 2024, "Improving LoRA in Privacy-preserving Federated
    Learning"): A stays at its initialisation, the same for every client, and only B is trained,
    so the mean of the clients' products B_i A is the product of the mean B with A: averaging is
    exact, where averaging A and B apart is not. A is initialised as peft does (Kaiming-uniform)
    and B at zero, so the model starts as the base."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"lora: adapters are placed by peft, which is not installed: {INSTALL}") from None
    targets = lora.target_modules or getattr(module, "lora_targets", None)
    # a transformers model (an hf: model's .model) gets peft's default layers for its architecture
    inner = getattr(module, "model", None)
    host = inner if isinstance(inner, nn.Module) and hasattr(inner, "config") else module
    if targets is None and host is module:
        raise ConfigError(f"lora.target_modules: name the layers of {model_name} to adapt (or all-linear)")
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(targets) if isinstance(targets, (list, tuple)) else targets,
    )
    try:
        peft.inject_adapter_in_model(config, host)
    except (ValueError, TypeError) as e:  # no layer matched, or a layer type peft cannot adapt
        raise ConfigError(f"lora.target_modules: {cut(str(e).splitlines()[0], 200)} (model {model_name})") from None
    trained = "lora_B" if lora.method == "ffa" else "lora_"
    for name, parameter in module.named_parameters():
        parameter.requires_grad = trained in name
        if "lora_" in name and parameter.is_floating_point():
            parameter.data = parameter.data.float()  # adapters in float32 on a bf16 base, as peft's autocast does
    return module


# ----------------------------------------------------------------------------- batched adapters


class GroupedLinear(nn.Module):
    """One adapter matrix (an A or a B) for a group of c clients at once: the group's rows,
    stacked client after client (``[c x rows, ..., in]``), each through its own client's
    ``weight[i]`` (``[c, out, in]``) in one batched matmul, so that the frozen layer it adapts
    computes all the group's rows in one pass (as mLoRA fuses several adapters' batches)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight  # a plain tensor: the trainer owns it and asks autograd for its gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(len(self.weight), -1, x.shape[-1])
        return torch.bmm(rows, self.weight.transpose(1, 2).to(rows.dtype)).reshape(*x.shape[:-1], -1)


def groupable(module: nn.Module) -> bool:
    """Whether every parameter ``module`` trains is a LoRA adapter matrix that ``GroupedLinear``
    can stand in for (peft's A or B of a linear layer)."""
    trained = [name for name, p in module.named_parameters() if p.requires_grad]
    return bool(trained) and all(_adapter_slot(module, name) is not None for name in trained)


def _adapter_slot(module: nn.Module, name: str) -> tuple[nn.ModuleDict, str] | None:
    """The ModuleDict and key that hold the adapter whose weight is the parameter ``name``."""
    path, _, attribute = name.rpartition(".")
    holder_path, _, key = path.rpartition(".")
    if attribute != "weight" or holder_path.rpartition(".")[2] not in ("lora_A", "lora_B"):
        return None
    holder = module.get_submodule(holder_path)
    linear = holder[key] if isinstance(holder, nn.ModuleDict) and key in holder else None
    return (holder, key) if isinstance(linear, nn.Linear) and linear.bias is None else None


@contextmanager
def grouped_adapters(module: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
    """``module`` with each adapter named in ``weights`` (its parameter's name -> the group's
    ``[c, out, in]``) replaced by a ``GroupedLinear``, for one forward pass of a group's rows."""
    swapped = []
    try:
        for name, weight in weights.items():
            holder, key = _adapter_slot(module, name)
            swapped.append((holder, key, holder[key]))
            holder[key] = GroupedLinear(weight)
        yield module
    finally:
        for holder, key, adapter in swapped:
            holder[key] = adapter
