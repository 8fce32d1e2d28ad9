"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang & Zhang 2022, "FedProto: Federated prototype learning
across heterogeneous clients"): clients keep their own models and share class prototypes."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ..core.checks import Checks
from ..core.flat import flat_size
from ..models import tasks
from ..models.zoo import Represents
from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult, Round

_CHECKS = Checks("algorithm_options", options=True)


def aggregate_prototypes(
    prototypes: torch.Tensor, counts: torch.Tensor, weighted: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global prototype of each class from the clients' ([k, C, d] prototypes, [k, C] counts of
    the representations each averaged): C_j = sum_i n_ij C_ij / sum_i n_ij, or with ``weighted``
    False the plain mean over the clients that hold class j (the authors' code); and the totals
    sum_i n_ij ([C, d], [C]). A class no client reports gets 0 and a total of 0."""
    weights = counts if weighted else (counts > 0).to(counts.dtype)
    summed = (weights.unsqueeze(-1) * prototypes).sum(0)
    return summed / weights.sum(0).clamp_min(1).unsqueeze(-1), counts.sum(0)


def prototype_scores(z: torch.Tensor, prototypes: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B, C]: minus the squared distance of each representation to each class's prototype, -inf for a
    class without one: the argmax is the nearest prototype's class."""
    distance = (z.float().unsqueeze(1) - prototypes.unsqueeze(0)).pow(2).sum(-1)
    return (-distance).masked_fill(counts <= 0, -torch.inf)


class NearestPrototype(torch.nn.Module):
    """A client's model that predicts the class of the global prototype nearest its representation."""

    def __init__(self, model: Represents, prototypes: torch.Tensor, counts: torch.Tensor):
        super().__init__()
        self.model, self.prototypes, self.counts = model, prototypes, counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return prototype_scores(self.model.represent(x), self.prototypes, self.counts)


@ALGORITHMS.register(
    "fedproto",
    "each client keeps its own model, trained on CE + lam * MSE(representation, its class's global "
    "prototype); the server averages class prototypes; inference by the nearest prototype (Tan et al. 2022)",
)
class FedProto(Algorithm):
    """Each client keeps its whole model (weights and buffers), which starts as the run's initial
    model and is never averaged. A sampled client trains it for local.epochs on the loss
    CE + lam * MSE(z, C[y]) (the paper's objective with the authors' code's distance, torch's mean
    squared error over the batch and the representation's width), z the representation of each sample
    (``represent``, models.zoo.Represents) and C[y] the global prototype of its class; a sample
    whose class has no global prototype yet (all of them in round 1) adds nothing to the term. It
    sends, for each class, the mean representation of its samples seen in training (every epoch's,
    as the authors' code and PFLlib take them) and their count. The server's prototype of a class is
    the mean of the round's reported ones, weighted by those counts (``aggregate_prototypes``;
    ``weighted: false``: the plain mean over the clients that hold the class, as the authors' code,
    PFLlib and FL-bench take it); a class no client of the round holds keeps its prototype.
    ``eval_per_client`` scores each client's model by the nearest global prototype
    (``prototype_scores``); the global model stays the initial one, so ``test_accuracy`` says
    nothing of FedProto. Only prototypes and their counts travel (``exchanges_weights``). Client
    state: 4 bytes per value of the model per client that has taken part. Only the process backend
    runs it."""

    personal_state = ("model",)  # the client keeps its model: only the prototypes travel
    sent_to_clients = ("prototypes", "prototype_counts")
    exchanges_weights = False

    def __init__(self, lam: float = 1.0, weighted: bool = True):
        self.lam = _CHECKS.non_negative("lam", lam)
        if not isinstance(weighted, bool):
            _CHECKS.fail("weighted", f"must be true or false, got {weighted!r}")
        self.weighted = weighted
        self.size: int | None = None  # the flat weights' length, buffers included
        self.classes, self.width = 1, 1  # the prototypes' shape, from the model (bind)

    def bind(self, module: torch.nn.Module) -> None:
        model = Represents.of(module, "fedproto")
        self.size = flat_size(module)
        self.classes, self.width = model.num_classes, model.representation_size

    def server_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"prototypes": (self.classes, self.width), "prototype_counts": (self.classes,)}

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"model": (self.size or num_params,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {**self.client_state(num_params), **self.server_state(num_params)}

    def new_client_state(self, global_weights: torch.Tensor, num_params: int) -> dict[str, torch.Tensor]:
        return {"model": global_weights.clone()}

    def personal_weights(
        self, global_weights: torch.Tensor, rows: dict[str, torch.Tensor], server: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        return rows["model"].clone()

    def personal_scorer(self, module: torch.nn.Module, server: dict[str, torch.Tensor]) -> torch.nn.Module:
        return NearestPrototype(module, server["prototypes"], server["prototype_counts"])

    def start_client(self, clients: Clients) -> SimpleNamespace:
        return SimpleNamespace(
            model=clients.state["model"][0],
            prototypes=clients.server["prototypes"],
            known=clients.server["prototype_counts"] > 0,
        )

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> Any:
        sums = torch.zeros(self.classes, self.width, device=start.device)
        seen = torch.zeros(self.classes, device=start.device)

        def loss(module: Represents, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = module.represent(x)
            sums.index_add_(0, y, z.detach().float())
            seen.index_add_(0, y, torch.ones(len(y), device=seen.device))
            # a sample whose class has no global prototype is its own target: no term
            target = torch.where(local.known[y].unsqueeze(1), local.prototypes[y], z.detach().float())
            return tasks.loss(module.classify(z), y) + self.lam * F.mse_loss(z.float(), target)

        trained = fit(local.model, objective=loss)
        local.trained = trained.weights.clone()
        local.sums, local.seen = sums, seen
        trained.weights.copy_(start)  # nothing of the model goes to the server: the update is zero
        return trained

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        prototypes = local.sums / local.seen.clamp_min(1).unsqueeze(1)
        return {"model": local.trained[None], "prototypes": prototypes[None], "prototype_counts": local.seen[None]}

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        reports = round.reports
        prototypes, total = aggregate_prototypes(reports["prototypes"], reports["prototype_counts"], self.weighted)
        reported = total > 0
        server["prototypes"][reported] = prototypes[reported]
        server["prototype_counts"][reported] = total[reported]
        return torch.zeros_like(round.global_weights)

    def aggregation(self, rule: str) -> str:
        mean = "by count" if self.weighted else "over the clients holding each class"
        return f"none: each client keeps its model; class prototypes averaged {mean}"
