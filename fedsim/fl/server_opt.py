"""Server optimizers: turn the aggregated client update into new global weights.

Following Reddi et al. 2021 ("Adaptive Federated Optimization"), the aggregated update
``delta`` (mean client weights minus global weights) is a pseudo-gradient with its sign
flipped; an optimizer applies it to the global weights in place. State is a dict of tensors,
saved in checkpoints (which load with ``weights_only=True``, so tensors only).

Each optimizer is built with the keyword arguments of ``make_server_optimizer``: ``lr``
(``server_lr``; ``None`` means the optimizer's ``default_lr``), ``momentum``, ``beta1``,
``beta2``, ``tau``, ``num_params`` and ``device``; each takes the ones it needs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.registry import Registry

SERVER_OPTIMIZERS = Registry("server optimizer")


class ServerOptimizer:
    default_lr = 1.0

    def __init__(self, lr: float | None = None, **_: object):
        self.lr = self.default_lr if lr is None else lr

    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the state tensors, named like the attributes that hold them."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            getattr(self, name).copy_(value)


@SERVER_OPTIMIZERS.register("none", "the global weights become the aggregate (plain FedAvg)")
class NoServerOptimizer(ServerOptimizer):
    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> None:
        weights.add_(delta)


@SERVER_OPTIMIZERS.register(
    "fedavgm", "server momentum: v = momentum v + delta, x += server_lr v (default lr 1; Hsu et al. 2019)"
)
class FedAvgM(ServerOptimizer):
    """FedAvgM (Hsu et al. 2019, "Measuring the effects of non-identical data distribution"):
    heavy-ball momentum on the pseudo-gradient, ``v <- beta v + delta; x <- x + lr v``, with
    ``beta = server_momentum`` and ``v`` starting at zero. With ``beta = 0`` and ``lr = 1`` it
    is plain FedAvg; the effective step grows to about ``lr / (1 - beta)``.
    """

    default_lr = 1.0

    def __init__(
        self,
        lr: float | None = None,
        momentum: float = 0.9,
        num_params: int = 0,
        device: torch.device | str = "cpu",
        **_: object,
    ):
        super().__init__(lr)
        self.momentum = momentum
        self.velocity = torch.zeros(num_params, device=device)

    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> None:
        self.velocity.mul_(self.momentum).add_(delta)
        weights.add_(self.velocity, alpha=self.lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"velocity": self.velocity.clone()}


class AdaptiveServerOptimizer(ServerOptimizer):
    """The FedOpt template (Reddi et al. 2021, Algorithm 2), per coordinate:

        m <- beta1 m + (1 - beta1) delta
        v <- (Adagrad, Adam or Yogi rule of the subclass)
        x <- x + lr m / (sqrt(v) + tau)

    with ``m = 0`` and ``v = tau^2`` at the start (the paper's ``v_{-1} >= tau^2``). There is
    no bias correction, as in Algorithm 2, whose convergence analysis covers exactly this
    update; ``tau`` in the denominator and ``v`` starting at ``tau^2`` already keep the first
    steps bounded (at most about ``lr`` per coordinate), which is what bias correction is for
    in Adam.
    """

    default_lr = 0.01

    def __init__(
        self,
        lr: float | None = None,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        num_params: int = 0,
        device: torch.device | str = "cpu",
        **_: object,
    ):
        super().__init__(lr)
        self.beta1, self.beta2, self.tau = beta1, beta2, tau
        self.first_moment = torch.zeros(num_params, device=device)
        self.second_moment = torch.full((num_params,), tau * tau, device=device)

    def update_second_moment(self, squared: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> None:
        self.first_moment.mul_(self.beta1).add_(delta, alpha=1 - self.beta1)
        self.update_second_moment(delta * delta)
        denominator = self.second_moment.sqrt().add_(self.tau)
        weights.addcdiv_(self.first_moment, denominator, value=self.lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"first_moment": self.first_moment.clone(), "second_moment": self.second_moment.clone()}


@SERVER_OPTIMIZERS.register(
    "fedadagrad", "Adagrad on the pseudo-gradient: v += delta^2 (default lr 0.1; Reddi et al. 2021)"
)
class FedAdagrad(AdaptiveServerOptimizer):
    """FedAdagrad (Reddi et al. 2021): ``v <- v + delta^2``. Since ``v`` only grows, the step
    shrinks over rounds, so the default ``lr`` is ten times that of FedAdam and FedYogi."""

    default_lr = 0.1

    def update_second_moment(self, squared: torch.Tensor) -> None:
        self.second_moment.add_(squared)


@SERVER_OPTIMIZERS.register(
    "fedadam", "Adam on the pseudo-gradient, no bias correction (default lr 0.01; Reddi et al. 2021)"
)
class FedAdam(AdaptiveServerOptimizer):
    """FedAdam (Reddi et al. 2021): ``v <- beta2 v + (1 - beta2) delta^2``."""

    def update_second_moment(self, squared: torch.Tensor) -> None:
        self.second_moment.mul_(self.beta2).add_(squared, alpha=1 - self.beta2)


@SERVER_OPTIMIZERS.register(
    "fedyogi", "Yogi on the pseudo-gradient, no bias correction (default lr 0.01; Reddi et al. 2021)"
)
class FedYogi(AdaptiveServerOptimizer):
    """FedYogi (Reddi et al. 2021; Yogi of Zaheer et al. 2018):
    ``v <- v - (1 - beta2) delta^2 sign(v - delta^2)``: ``v`` moves towards ``delta^2`` by a
    step that does not depend on ``v``, so it grows and shrinks more slowly than Adam's."""

    def update_second_moment(self, squared: torch.Tensor) -> None:
        direction = torch.sign(self.second_moment - squared)
        self.second_moment.sub_(squared * direction, alpha=1 - self.beta2)


def make_server_optimizer(config: Any, num_params: int, device: torch.device | str) -> ServerOptimizer:
    cls = SERVER_OPTIMIZERS.get(config.server_optimizer)
    return cls(
        lr=config.server_lr,
        momentum=config.server_momentum,
        beta1=config.server_beta1,
        beta2=config.server_beta2,
        tau=config.server_tau,
        num_params=num_params,
        device=device,
    )
