"""Worker momentum (Karimireddy, He & Jaggi 2021, "Learning from history for Byzantine robust
optimization"): each client keeps its momentum from one round to the next."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ..core.checks import Checks
from ..core.errors import ConfigError
from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult


@ALGORITHMS.register(
    "worker_momentum",
    "local SGD with a momentum each client keeps across rounds, m <- beta m + (1 - beta) g "
    "(Karimireddy et al. 2021; ByzFL's DSGD clients)",
)
class WorkerMomentum(Algorithm):
    """Every step of a client moves its weights by the learning rate times its momentum
    ``m <- beta m + (1 - beta) g``, ``g`` the minibatch gradient with weight decay, and the
    client keeps ``m`` for its next round (a client starts from ``m = 0``). The robustness
    papers train so, one step a round: the momentum averages out the noise of the honest
    gradients, which the robust rules would otherwise take for attacks. With one local step a
    round, a client's update is ``-lr m``: ByzFL's DSGD clients send ``m`` and its server steps by
    ``lr`` times the aggregate, so the two compute the same for rules that commute with scaling
    (the bounds of clipping and of the geometric median's smoothing scale by ``lr``).
    ``local.momentum`` (a momentum reset every round) must stay 0, and the step is SGD's.
    """

    personal_state = ("momentum",)  # kept on the client: it never travels

    def __init__(self, beta: float = 0.9):
        checks = Checks("algorithm_options", options=True)
        self.beta = checks.within("beta", checks.number("beta", beta, "must be a number"), 0, 1, "[)")

    def setup(self, config: Any) -> None:
        super().setup(config)
        if config.local.momentum:
            raise ConfigError(
                f"local.momentum: worker_momentum keeps its own momentum (algorithm_options.beta); "
                f"leave local.momentum at 0, got {config.local.momentum}"
            )
        if config.local.optimizer != "sgd":
            raise ConfigError(
                f"local.optimizer: worker_momentum is a momentum of SGD; use sgd, got {config.local.optimizer}"
            )
        if config.backend != "process":
            raise ConfigError(
                "backend: worker_momentum keeps each client's momentum through the steps it takes, which a vmap "
                "group masks; use backend: process"
            )

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"momentum": (num_params,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"momentum": (num_params,)}

    def start_client(self, clients: Clients) -> SimpleNamespace:
        return SimpleNamespace(momentum=clients.state["momentum"].clone())

    def adjust_gradient(
        self, grad: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, local: SimpleNamespace
    ) -> None:
        local.momentum.mul_(self.beta).add_(grad, alpha=1 - self.beta)
        grad.copy_(local.momentum)

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        return {"momentum": local.momentum}
