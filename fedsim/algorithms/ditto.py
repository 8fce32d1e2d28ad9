"""Ditto (Li, Hu, Beirami, Smith 2021, "Ditto: fair and robust federated learning through
personalization"): a personal model per client beside the global one."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.checks import Checks
from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult

_CHECKS = Checks("algorithm_options", options=True)


@ALGORITHMS.register(
    "ditto",
    "a personal model per client, trained toward the global one with "
    "lam/2 ||v_k - w||^2; the global model by plain local SGD (Li et al. 2021)",
)
class Ditto(Algorithm):
    """Each sampled client k trains two models from the round's global weights w (Algorithm 1 of
    the paper). Its personal model v_k takes ``personal_epochs`` epochs (None: local.epochs) of
    SGD on its loss plus lam/2 ||v_k - w||^2, that is steps v_k -= lr (grad + lam (v_k - w));
    then its copy of w takes local.epochs of plain local SGD, which the server aggregates as
    FedAvg does. Both see the same minibatches (the client's stream). Step caps count per model:
    local.steps caps the global model's steps, as under any algorithm, and ``personal_steps``
    (None: local.steps) the personal model's (the paper's s local iterations). v_k starts as the
    global model of the round the client is first sampled in, stays on the client, and is what
    ``eval_per_client`` scores; batch-norm statistics, not trained, are the global model's.
    ``lam = 0`` trains v_k as a purely local model. Both phases count on the simulated clock and
    in clients.csv's steps (see ``phase_epochs`` and ``phase_steps``).
    """

    personal_state = ("personal",)

    def __init__(self, lam: float = 0.1, personal_epochs: int | None = None, personal_steps: int | None = None):
        self.lam = _CHECKS.non_negative("lam", lam)
        self.personal_epochs = _CHECKS.count("personal_epochs", personal_epochs, 1, optional=True)
        self.personal_steps = _CHECKS.count("personal_steps", personal_steps, 1, optional=True)

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"personal": (num_params,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"personal": (num_params,)}

    def new_client_state(self, global_weights: torch.Tensor, num_params: int) -> dict[str, torch.Tensor]:
        return {"personal": global_weights[:num_params].clone()}

    def personal_weights(
        self, global_weights: torch.Tensor, rows: dict[str, torch.Tensor], server: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        weights = global_weights.clone()
        weights[: len(rows["personal"])] = rows["personal"]
        return weights

    def phase_epochs(self, epochs: int) -> tuple[int, ...]:
        return (int(epochs) if self.personal_epochs is None else self.personal_epochs, int(epochs))

    def phase_steps(self, steps: int | None) -> tuple[int | None, ...]:
        return (steps if self.personal_steps is None else self.personal_steps, steps)

    def start_client(self, clients: Clients) -> SimpleNamespace:
        return SimpleNamespace(personal=clients.state["personal"][0], trained=None)

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> Any:
        n = len(local.personal)
        anchor = start[:n]
        personal = self.personal_weights(start, {"personal": local.personal})
        local.trained = (
            fit(
                personal,
                epochs=self.personal_epochs,
                term=lambda grad, weights: grad.add_(weights - anchor, alpha=self.lam),
            )
            .weights[:n]
            .clone()
        )
        return fit(start)

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        return {"personal": local.trained[None]}
