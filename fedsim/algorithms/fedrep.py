"""FedRep (Collins, Hassani, Mokhtari, Shakkottai 2021, "Exploiting shared representations for
personalized federated learning"): each round, the personal head first, then the shared body."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from . import ALGORITHMS
from .fedper import CHECKS, FedPer


@ALGORITHMS.register(
    "fedrep",
    "a personal head trained head_epochs with the body frozen, then the shared body "
    "local.epochs with the head frozen; only the body is averaged (Collins et al. 2021)",
)
class FedRep(FedPer):
    """A sampled client starts from the global body and its own head (``personal_layers``, as in
    FedPer). It trains the head for ``head_epochs`` epochs with the body frozen, then the body for
    local.epochs epochs with the head frozen (Algorithm 1 of the paper), keeps its new head and
    sends the body, which the server averages. Step caps count per phase: local.steps caps the
    body's steps, as under any algorithm, and ``head_steps`` (None: local.steps) the head's. Both
    phases count on the simulated clock and in clients.csv's steps (see ``phase_epochs`` and
    ``phase_steps``); its training loss is the body phase's.
    """

    def __init__(self, personal_layers: list[str] | None = None, head_epochs: int = 1, head_steps: int | None = None):
        super().__init__(personal_layers)
        self.head_epochs = CHECKS.count("head_epochs", head_epochs, 1)
        self.head_steps = CHECKS.count("head_steps", head_steps, 1, optional=True)

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> Any:
        head = self.mask(start).to(start.dtype)
        with_head = self.personal_weights(start, {"head": local.head})
        head_phase = fit(with_head, epochs=self.head_epochs, trainable=head)
        body_phase = fit(head_phase.weights.clone(), trainable=1 - head)
        return self.keep_head(body_phase, start, local)

    def phase_epochs(self, epochs: int) -> tuple[int, ...]:
        return (self.head_epochs, int(epochs))

    def phase_steps(self, steps: int | None) -> tuple[int | None, ...]:
        return (steps if self.head_steps is None else self.head_steps, steps)
