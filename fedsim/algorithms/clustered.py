"""What the clustered algorithms (ifca.py, cfl.py) share: K cluster models, each client's cluster,
and each cluster's model moved by the mean update of its clients.

Cluster 0's model is the global model: the weights the engine keeps and scores on the global test
set. Clusters 1 .. K-1 are the server state
``models`` ([K-1, P]), so a run with one cluster is FedAvg, number for number. A client's cluster is
its row ``cluster`` (0 until it is assigned one); ``sizes`` ([K]) counts the clients each cluster
holds, for metrics.csv's ``clusters``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.checks import Checks
from ..core.errors import ConfigError
from ..core.flat import FlatModel, flat_size
from .base import Algorithm, Clients, LocalResult, Round

CHECKS = Checks("algorithm_options", options=True)


class Clustered(Algorithm):
    """A client trains its cluster's model (``choose`` says which: IFCA's lowest loss, CFL's
    assignment) by plain local SGD, and sends its update from that model; the server moves each
    cluster's model by the sample-weighted mean (the ``fedavg`` rule) of its clients' updates.
    ``eval_per_client`` scores each client with its cluster's model. ``clients.csv`` records the
    cluster each client trained (``cluster``), ``metrics.csv`` the clusters that hold a client."""

    recorded_reports = ("cluster",)
    paper_aggregator = "fedavg"
    slots = 1  # K: the most clusters a run holds (set by the subclass's options)

    def setup(self, config: Any) -> None:
        super().setup(config)
        # the cluster models take each cluster's plain mean: a second step on cluster 0 alone, a
        # rule's memory or privacy's accounting, each made for one aggregate a round, would be wrong
        refused = [
            ("server_optimizer", config.server_optimizer != "none", "server_optimizer: none"),
            ("aggregator", config.aggregator != "fedavg", "aggregator: fedavg"),
            ("pre_aggregators", bool(config.pre_aggregators), "no pre_aggregators"),
            ("privacy", config.privacy is not None, "no privacy section"),
        ]
        for key, bad, allowed in refused:
            if bad:
                raise ConfigError(
                    f"{key}: algorithm {config.algorithm} moves each cluster's model by the sample-weighted mean "
                    f"of its clients' updates, one mean per cluster a round; use {allowed}"
                )
        self.num_clients = config.data.num_clients

    def bind(self, module: torch.nn.Module) -> None:
        if any(not p.requires_grad for p in module.parameters()):
            raise ConfigError(
                "algorithm: a clustered algorithm keeps whole models per cluster, which a model with frozen "
                "weights (LoRA) holds in the base all clusters would share; use it without lora.rank"
            )
        self.length = flat_size(module)  # the flat weights: the parameters, then the floating-point buffers

    def server_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"models": (self.slots - 1, self.length), "sizes": (self.slots,)}

    def start_server(self, server: dict[str, torch.Tensor], model: FlatModel) -> None:
        server["sizes"][0] = self.num_clients  # every client starts in cluster 0

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"cluster": (1,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"cluster": (1,)}

    @staticmethod
    def model_of(cluster: int, global_weights: torch.Tensor, server: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cluster ``cluster``'s model ([P]): the global weights for cluster 0."""
        return global_weights if cluster == 0 else server["models"][cluster - 1]

    def personal_weights(
        self, global_weights: torch.Tensor, rows: dict[str, torch.Tensor], server: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return self.model_of(int(rows["cluster"][0]), global_weights, server)

    def round_figures(self, server: dict[str, torch.Tensor]) -> dict[str, int | float]:
        return {"clusters": int((server["sizes"] > 0).sum())}

    def aggregation(self, rule: str) -> str:
        return f"{rule} within each cluster"

    # ----------------------------------------------------------------- a client

    def choose(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> int:
        """The cluster whose model the client trains this round."""
        raise NotImplementedError

    def start_client(self, clients: Clients) -> SimpleNamespace:
        return SimpleNamespace(server=clients.server, row=int(clients.state["cluster"][0, 0]), cluster=None)

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> Any:
        local.cluster = self.choose(fit, start, local)
        model = self.model_of(local.cluster, start, local.server)
        trained = fit(model)
        if local.cluster:  # the server reads weights minus the global ones: this sends weights minus the cluster's
            trained.weights.sub_(model).add_(start)
        return trained

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        return {"cluster": result.weights.new_full((1, 1), float(local.cluster))}

    # ----------------------------------------------------------------- the server

    def assign(self, round: Round, server: dict[str, torch.Tensor], trained: torch.Tensor) -> torch.Tensor:
        """The clusters ([k] int64) of the round's reporting clients after the round, given those
        they trained (``trained``); CFL's splits change them (and fill the new clusters' models)."""
        return trained

    def adjust_steps(self, round: Round, steps: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each cluster's step ([P], None: no client of it reported), from its own clients' mean:
        as they are by default (IFCA's shared layers take every client's mean)."""
        return steps

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        trained = round.reports["cluster"][:, 0].long()
        now = self.assign(round, server, trained)
        before, sizes = clients["cluster"][:, 0].long(), server["sizes"]
        sizes.index_add_(0, before, torch.ones_like(before, dtype=sizes.dtype).neg())
        sizes.index_add_(0, now, torch.ones_like(now, dtype=sizes.dtype))
        clients["cluster"][:, 0] = now.to(clients["cluster"].dtype)
        steps = []  # (no Byzantine rows: an algorithm with a server_update of its own is refused with attack.count)
        for cluster in range(self.slots):
            rows = (now == cluster).nonzero().flatten()
            steps.append(round.aggregate(round.updates[rows], round.weights[rows]) if len(rows) else None)
        steps = self.adjust_steps(round, steps)
        for cluster, step in enumerate(steps[1:], 1):
            if step is not None:
                server["models"][cluster - 1].add_(step)
        return steps[0] if steps[0] is not None else torch.zeros_like(round.global_weights)
