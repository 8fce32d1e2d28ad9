"""IFCA (Ghosh, Chung, Yin & Ramchandran 2020, "An efficient framework for clustered federated
learning"): k cluster models; each client trains the one with the lowest loss on its data."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.flat import FlatModel, flat_layout
from ..core.streams import CLUSTER_INIT, torch_seed
from . import ALGORITHMS
from .base import Round
from .clustered import CHECKS, Clustered


@ALGORITHMS.register(
    "ifca",
    "k cluster models; a client trains the one of lowest loss on its data, each cluster's model the "
    "mean of its clients' (Ghosh et al. 2020)",
)
class IFCA(Clustered):
    """The paper's Algorithm 2 (model averaging). Each sampled client computes every cluster
    model's mean loss on its training samples (eval mode), takes the lowest (ties: the lowest
    cluster number), trains that model by local SGD and reports its cluster with its update; the
    server moves each cluster's model by the sample-weighted mean of its clients' updates (the
    paper's plain mean where clients hold as many samples). A cluster no client chose keeps its
    model. ``shared_layers``: the model's first that many layers (modules that hold parameters,
    in the order of its parameters) are one for every cluster, moved by the mean update of every
    client of the round (the paper's weight sharing).

    The k models are initialized as the paper's, at random and apart: cluster 0's is the run's
    initial model, cluster j's the same model with every layer's ``reset_parameters`` drawn from
    the seed's stream of cluster j (the shared layers copied from cluster 0's). A client not yet
    sampled is counted, and scored by ``eval_per_client``, in cluster 0.
    """

    sent_to_clients = ("models",)  # every client is sent all k models: those of clusters 1..k-1 beside the global

    def __init__(self, k: int = 2, shared_layers: int = 0):
        self.k = CHECKS.count("k", k, 1)
        self.shared_layers = CHECKS.count("shared_layers", shared_layers, 0)
        self.slots = self.k
        self.shared: torch.Tensor | None = None  # [P] bool: the coordinates every cluster shares

    def bind(self, module: torch.nn.Module) -> None:
        super().bind(module)
        params = list(module.named_parameters())
        layers = list(dict.fromkeys(name.rpartition(".")[0] for name, _ in params))
        if self.shared_layers >= len(layers):
            CHECKS.fail(
                "shared_layers",
                f"must leave the clusters a layer of their own: the model has {len(layers)} layers "
                f"({', '.join(layers)}), got {self.shared_layers}",
            )
        shared = set(layers[: self.shared_layers])

        def within(name: str) -> bool:  # a shared layer's parameters and buffers (a batch norm's statistics)
            return name.rpartition(".")[0] in shared

        self.shared = torch.cat([torch.full((t.numel(),), within(name)) for name, t in flat_layout(module)])

    def start_server(self, server: dict[str, torch.Tensor], model: FlatModel) -> None:
        super().start_server(server, model)
        shared = self.shared.to(model.flat.device)
        for j in range(1, self.k):
            module = copy.deepcopy(model.module).cpu()  # drawn on the CPU: the same models on any device
            with torch.random.fork_rng(devices=[]):  # the run's own stream of torch draws is left as it was
                torch.manual_seed(torch_seed(CLUSTER_INIT, self.config.seed, j))
                for layer in module.modules():
                    if hasattr(layer, "reset_parameters"):
                        layer.reset_parameters()
            weights = FlatModel(module, model.flat.device).flat
            server["models"][j - 1] = torch.where(shared, model.flat, weights)

    def choose(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> int:
        losses = [fit.loss(self.model_of(j, start, local.server)) for j in range(self.k)]
        return min(range(self.k), key=lambda j: (losses[j], j))

    def adjust_steps(self, round: Round, steps: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        if not self.shared_layers:
            return steps
        shared = self.shared.to(round.updates.device)
        everyone = round.aggregate(round.updates, round.weights)
        return [torch.where(shared, everyone, step if step is not None else 0.0) for step in steps]

    def aggregation(self, rule: str) -> str:
        shared = f"; its first {self.shared_layers} layers over every client" if self.shared_layers else ""
        return f"{rule} within each of {self.k} clusters{shared}"
