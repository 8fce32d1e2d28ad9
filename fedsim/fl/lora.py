"""The ``lora:`` section: parameter-efficient fine-tuning with LoRA adapters (Hu et al. 2022,
"LoRA: Low-Rank Adaptation of Large Language Models"), placed by Hugging Face ``peft``.

Experiment file (every key optional; shown with its default)::

    lora:
      rank: 0                 # r of every adapter; 0: no adapters, every parameter is trained
      alpha: 16.0             # the adapters' output is scaled by alpha / rank
      dropout: 0.0            # dropout on an adapter's input
      target_modules: null    # the layers to adapt: names (suffixes) or "all-linear"; null: peft's
                              #   default for a transformers model
      method: fedit           # fedit: A and B trained and averaged (FedIT); ffa: A frozen (FFA-LoRA)
      share_base: true        # the frozen base: one copy for all workers; false: a copy per worker
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..core.checks import Checks, shown
from ..core.errors import ConfigError, cut, install


@dataclass
class LoraConfig:
    """The ``lora:`` section (see the module's docstring)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Any | None = None  # a name, a list of names, "all-linear", or null
    method: str = "fedit"  # fedit | ffa
    share_base: bool = True

    @property
    def enabled(self) -> bool:
        return self.rank > 0


METHODS = ("fedit", "ffa")
INSTALL = install("llm")


def check(lora: LoraConfig) -> None:
    """The section's values, each refused in one line."""
    checks = Checks("lora")
    checks.at_least("rank", lora.rank, 0)
    if lora.alpha <= 0:
        checks.fail("alpha", f"must be > 0, got {lora.alpha}")
    checks.within("dropout", lora.dropout, 0, 1, "[)")
    checks.one_of("method", lora.method, METHODS)
    targets = lora.target_modules
    if not (targets is None or _names(targets)):
        checks.fail(
            "target_modules",
            f"must be a layer name, a list of them or all-linear (null: the model's), got {shown(targets)}",
        )


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
