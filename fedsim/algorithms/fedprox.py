"""FedProx (Li et al. 2020): local SGD on the loss plus mu/2 ||w - w_global||^2."""

from __future__ import annotations

from typing import Any

import torch

from ..core.checks import Checks
from . import ALGORITHMS
from .base import Algorithm


@ALGORITHMS.register("fedprox", "local SGD plus the proximal term mu/2 ||w - w_global||^2 (Li et al. 2020)")
class FedProx(Algorithm):
    """Every step adds mu (w - w_global), the gradient of the proximal term, before momentum;
    ``mu = 0`` is exactly FedAvg."""

    def __init__(self, mu: float = 0.01):
        self.mu = Checks("algorithm_options", options=True).non_negative("mu", mu)

    def adjust_gradient(self, grad: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, local: Any) -> None:
        grad.add_(weights - start, alpha=self.mu)
