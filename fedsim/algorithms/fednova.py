"""FedNova (Wang et al. 2020, "Tackling the objective inconsistency problem in heterogeneous
federated optimization"): normalized averaging by each client's amount of local work."""

from __future__ import annotations

from typing import Any

import torch

from . import ALGORITHMS
from .base import Algorithm, LocalResult, Round


@ALGORITHMS.register(
    "fednova",
    "normalized averaging: each update divided by its client's local steps, "
    "the average scaled by the effective steps (Wang et al. 2020)",
)
class FedNova(Algorithm):
    """Clients that take more local steps (more data, more epochs) push the plain average
    towards their own optimum. FedNova divides client i's update by a_i, the length of its
    local work, and scales the average back by tau_eff = sum_i p_i a_i, p_i its share of the
    samples:  delta = tau_eff * aggregate(updates_i / a_i).  For local SGD with momentum rho over
    tau_i steps, a_i = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho); a_i = tau_i without
    momentum, and with equal tau_i it is exactly FedAvg. The rule (aggregator) averages the
    normalized updates, so FedNova combines with any of them.
    """

    def setup(self, config: Any) -> None:
        super().setup(config)
        self.momentum = config.local.momentum

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"steps": ()}

    def client_report(self, result: LocalResult, local: Any) -> dict[str, torch.Tensor]:
        return {"steps": result.steps.to(result.weights.dtype)}

    def work(self, steps: torch.Tensor) -> torch.Tensor:
        """a_i for clients that took ``steps`` local steps."""
        rho = self.momentum
        if rho == 0:
            return steps
        return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        work = self.work(round.reports["steps"])
        if bool((work == work[0]).all()):  # equal work: normalizing changes nothing but the rounding
            return round.aggregate(round.updates, round.weights)
        share = round.weights / round.weights.sum()
        effective = (share.to(work.dtype) * work).sum()
        return effective * round.aggregate(round.updates / work[:, None], round.weights)
