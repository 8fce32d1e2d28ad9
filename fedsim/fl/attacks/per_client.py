"""Attacks in which each attacker rewrites its own update, or trains on flipped labels."""

from __future__ import annotations

import torch

from . import ATTACKS, Attack, RoundView


@ATTACKS.register("sign_flip", "send -scale x the attacker's own honest update")
class SignFlip(Attack):
    """Each attacker sends ``-scale`` times its own update. ByzFL's ``SignFlipping`` sends minus
    the mean of the honest updates: that is this attack by the Byzantine clients of
    ``attack.count``, whose own update is that mean, or ``ipm`` with ``epsilon: 1``."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def rewrite(self, view: RoundView) -> torch.Tensor:
        return view.own * -self.scale


@ATTACKS.register("scale", "send scale x the attacker's own honest update")
class Scale(Attack):
    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def rewrite(self, view: RoundView) -> torch.Tensor:
        return view.own * self.scale


@ATTACKS.register("gaussian", "send Gaussian noise with the attacker's own update's standard deviation")
class Gaussian(Attack):
    def rewrite(self, view: RoundView) -> torch.Tensor:
        own = view.own
        noise = torch.randn(own.shape, generator=view.generator, device="cpu").to(own.device)
        return noise * own.std(dim=1, keepdim=True)


@ATTACKS.register("label_flip", "train on flipped labels (class c becomes C-1-c)")
class LabelFlip(Attack):
    def relabel(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        return num_classes - 1 - labels
