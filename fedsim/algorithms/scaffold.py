"""SCAFFOLD (Karimireddy et al. 2020): local steps corrected by control variates c - c_i."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult, Round


@ALGORITHMS.register(
    "scaffold",
    "local SGD corrected by control variates c - c_i; the new c_i is the mean "
    "uncorrected gradient (option II under plain SGD; Karimireddy et al. 2020)",
)
class Scaffold(Algorithm):
    """Every step adds c - c_i, the server's control variate minus the client's. A client's new
    c_i is the mean of its uncorrected minibatch gradients over the round: with plain SGD that
    equals option II, (x - y_i) / (K lr) + c_i - c, and unlike that formula it stays right with
    local momentum, where the weights travel about 1 / (1 - momentum) times further than the
    gradients alone would take them (option II then overshoots and training diverges).
    The server adds (1/N) sum of the changes to c, and each change to its client's c_i. The global
    model moves by the unweighted mean of the client updates (the paper's x + (eta_g / |S|) sum_i
    Delta y_i with eta_g = 1): ``mean`` is the rule a run gets when it sets none.
    """

    keeps_mean_gradient = True
    sent_to_clients = ("control",)  # c goes down with the global weights; the change of c_i comes back as a report
    paper_aggregator = "mean"

    def server_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"control": (num_params,)}

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"control": (num_params,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"control_change": (num_params,)}

    def start_client(self, clients: Clients) -> SimpleNamespace:
        own = clients.state["control"]
        return SimpleNamespace(control=own, correction=clients.server["control"] - own)

    def adjust_gradient(
        self, grad: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, local: SimpleNamespace
    ) -> None:
        grad.add_(local.correction)

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        return {"control_change": result.mean_gradient - local.control}

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        changes = round.reports["control_change"]
        server["control"].add_(changes.sum(dim=0), alpha=1 / round.num_clients)
        clients["control"] += changes
        return round.aggregate(round.updates, round.weights)
