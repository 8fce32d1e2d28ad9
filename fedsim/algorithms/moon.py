"""MOON (Li, He & Song 2021, "Model-contrastive federated learning"): local training that pulls a
client's representation toward the global model's and away from its own previous model's."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core.checks import Checks
from ..core.flat import FlatModel, flat_size
from ..models import tasks
from ..models.zoo import Represents
from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult

_CHECKS = Checks("algorithm_options", options=True)


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """The model-contrastive loss l_con of the paper, averaged over the batch:
    -log(exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau))), sim
    the cosine similarity; as the cross-entropy of the logits [sim_glob, sim_prev] / tau with target
    0, which is that expression without overflow (Flower's baseline computes it so)."""
    logits = torch.stack((F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)), 1)
    return F.cross_entropy(logits.float() / tau, torch.zeros(len(z), dtype=torch.long, device=z.device))


@ALGORITHMS.register(
    "moon",
    "local loss cross-entropy + mu l_con, the model-contrastive term between the representation and "
    "those of the global and the client's previous model (Li et al. 2021)",
)
class Moon(Algorithm):
    """A sampled client trains from the global weights w on the loss CE + mu l_con (Algorithm 1 of the
    paper), where l_con (``contrastive_loss``) compares the representation z of the model being trained
    with z_glob, that of w, and z_prev, that of the model the client sent the last time it was sampled.
    Both are computed without a gradient, in eval mode (no dropout, batch-norm running statistics).
    The server averages the clients' weights as FedAvg does. A client sampled for the first time has
    no previous model: it uses w, as Flower's baseline does, which makes l_con = log 2 with zero
    gradient (the authors' code then has no negative pair, a term of 0: the same training).

    The representation is the model's ``represent`` (models.zoo.Represents): moon_cnn's is the
    paper's projection head's output. Each client's previous model, weights and buffers, is client
    state: 4 bytes per value per client that has taken part (``client_state_limit_mb`` bounds it).
    Only the process backend runs it (it trains each client its own way)."""

    personal_state = ("previous",)  # the client keeps the model it trained: no traffic

    def __init__(self, mu: float = 5.0, tau: float = 0.5):
        self.mu = _CHECKS.non_negative("mu", mu)
        self.tau = _CHECKS.positive("tau", tau)
        self.size: int | None = None  # the flat weights' length, buffers included
        self.references: list[FlatModel] = []  # a worker's copies of the model at w and at the previous weights

    def bind(self, module: torch.nn.Module) -> None:
        Represents.of(module, "moon")
        self.size = flat_size(module)

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"previous": (self.size or num_params,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return self.client_state(num_params)

    def new_client_state(self, global_weights: torch.Tensor, num_params: int) -> dict[str, torch.Tensor]:
        return {"previous": global_weights.clone()}

    def start_client(self, clients: Clients) -> torch.Tensor:
        return clients.state["previous"][0]

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, previous: torch.Tensor) -> Any:
        return fit(start, objective=self.objective(start, previous))

    def objective(
        self, start: torch.Tensor, previous: torch.Tensor
    ) -> Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The minibatch loss of a client that started from ``start`` and sent ``previous`` last."""
        first = True

        def loss(module: Represents, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            nonlocal first
            if first:  # the client's first step: the reference models take its two models' weights
                self.load_references(module, start, previous)
                first = False
            z = module.represent(x)
            with torch.no_grad():
                z_glob, z_prev = (reference.module.represent(x) for reference in self.references)
            return tasks.loss(module.classify(z), y) + self.mu * contrastive_loss(z, z_glob, z_prev, self.tau)

        return loss

    def load_references(self, module: torch.nn.Module, *weights: torch.Tensor) -> None:
        """The reference models, in eval mode, at ``weights`` (the global model's, the previous one's):
        copies of the trainer's own model, made at a worker's first client."""
        while len(self.references) < len(weights):
            reference = FlatModel(copy.deepcopy(module), weights[0].device)
            reference.module.eval()
            self.references.append(reference)
        for reference, values in zip(self.references, weights):
            reference.flat.copy_(values)

    def client_report(self, result: LocalResult, previous: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"previous": result.weights}
