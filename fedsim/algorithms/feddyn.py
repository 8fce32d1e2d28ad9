"""FedDyn (Acar et al. 2021, "Federated learning based on dynamic regularization")."""

from __future__ import annotations

import torch

from ..core.checks import Checks
from . import ALGORITHMS
from .base import Algorithm, Clients, Round


@ALGORITHMS.register(
    "feddyn",
    "dynamic regularization: each client's objective corrected by its last "
    "gradient, the server's model by h (Acar et al. 2021; option alpha)",
)
class FedDyn(Algorithm):
    """Client k minimizes L_k(w) - <g_k, w> + alpha/2 ||w - x||^2, where g_k, its state, is the
    gradient of L_k at its last local optimum: every step adds alpha (w - x) - g_k. After the
    round, g_k <- g_k - alpha (w_k - x) for every client that reported, the server's h <- h -
    alpha (1/N) sum_k (w_k - x), and the global model becomes the aggregate of the w_k minus
    h / alpha. With ``aggregator: mean`` (the paper averages its active clients unweighted), the
    rule a run gets when it sets none, this is Algorithm 1 of the paper; other rules replace that
    average.
    """

    paper_aggregator = "mean"

    def __init__(self, alpha: float = 0.01):
        self.alpha = Checks("algorithm_options", options=True).positive("alpha", alpha)

    def server_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"h": (num_params,)}

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"gradient": (num_params,)}

    def start_client(self, clients: Clients) -> torch.Tensor:
        return clients.state["gradient"]

    def adjust_gradient(
        self, grad: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, local: torch.Tensor
    ) -> None:
        grad.add_(weights - start, alpha=self.alpha).sub_(local)

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        n, alpha = round.num_params, self.alpha
        moved = round.updates[:, :n]
        clients["gradient"] -= alpha * moved
        server["h"].sub_(moved.sum(dim=0), alpha=alpha / round.num_clients)
        delta = round.aggregate(round.updates, round.weights)
        delta[:n] -= server["h"] / alpha
        return delta
