"""Byzantine clients, to test robust aggregation: each attack is one registered class.

A seeded set of clients (``attack.fraction`` of all clients, fixed for the run) misbehaves
whenever it is sampled. An attack rewrites the attackers' rows of the stacked updates on the
server before aggregation (``rewrite``), or changes the labels they train on (``relabel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import Checks
from ..core.registry import Registry
from ..core.sections import option
from ..core.streams import attackers_rng

ATTACKS = Registry("attack")


def _no_attack(key: str, attack: Any, config: Any) -> str | None:
    return "attack.type is none" if attack.type == "none" else None


def _not_scaled(key: str, attack: Any, config: Any) -> str | None:
    return None if attack.type in ("sign_flip", "scale") else f"attack.type {attack.type} does not use it"


@dataclass
class AttackConfig:
    """The ``attack:`` section: Byzantine clients (see [Attacks](algorithms.md#attacks))."""

    type: str = option(
        "none", "what the Byzantine clients do (see [Attacks](algorithms.md#attacks)); `none`: no attack"
    )
    fraction: float = option(
        0.0, "the share of all clients that are Byzantine, in [0, 1) (a seeded set)", unread=_no_attack
    )
    scale: float = option(1.0, "`sign_flip` sends -scale x update, `scale` sends scale x update", unread=_not_scaled)

    def check(self) -> None:
        checks = Checks("attack")
        checks.choice("type", self.type, ATTACKS)
        checks.within("fraction", self.fraction, 0, 1, "[)")
        if self.type != "none" and self.fraction == 0:
            checks.fail("fraction", f"attack.type is {self.type} but fraction is 0; set a fraction in (0, 1)")


class Attack:
    """Every client is honest: nothing is rewritten and nothing relabelled."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def rewrite(self, honest: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        """What the attackers send instead of their honest updates ``[a, L]``; None: unchanged."""
        return None

    def relabel(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The labels an attacker trains on instead of ``labels``."""
        return labels

    @property
    def relabels(self) -> bool:
        return type(self).relabel is not Attack.relabel


ATTACKS.register("none", "every client is honest")(Attack)


@ATTACKS.register("sign_flip", "send -scale x the honest update")
class SignFlip(Attack):
    def rewrite(self, honest: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return honest * -self.scale


@ATTACKS.register("scale", "send scale x the honest update")
class Scale(Attack):
    def rewrite(self, honest: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return honest * self.scale


@ATTACKS.register("gaussian", "send Gaussian noise with the honest update's standard deviation")
class Gaussian(Attack):
    def rewrite(self, honest: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.randn(honest.shape, generator=generator, device="cpu").to(honest.device)
        return noise * honest.std(dim=1, keepdim=True)


@ATTACKS.register("label_flip", "train on flipped labels (class c becomes C-1-c)")
class LabelFlip(Attack):
    def relabel(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        return num_classes - 1 - labels


def make_attack(attack_config: Any) -> Attack:
    return ATTACKS.get(attack_config.type)(scale=attack_config.scale)


def attacker_mask(seed: int, num_clients: int, attack_config: Any) -> torch.Tensor:
    """Bool tensor over clients: True for the round(fraction x num_clients) attackers (Python's
    round, so an exact half goes to the even count), drawn from their own stream of ``seed``."""
    mask = torch.zeros(num_clients, dtype=torch.bool)
    if attack_config.type != "none":
        count = int(round(attack_config.fraction * num_clients))
        mask[torch.from_numpy(attackers_rng(seed).choice(num_clients, size=count, replace=False))] = True
    return mask
