"""CFL (Sattler, Müller & Samek 2020, "Clustered federated learning: model-agnostic distributed
multitask optimization under privacy constraints"): one cluster at the start; a cluster whose
clients have reached a stationary point of their joint loss but not of their own is split in two
by the cosine similarity of their updates."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.blocks import cosine_similarities, gram
from ..core.clustering import two_clusters
from . import ALGORITHMS
from .base import Round
from .clustered import CHECKS, Clustered

logger = logging.getLogger("fedsim")


@ALGORITHMS.register(
    "cfl",
    "clusters split in two by the cosine similarity of their clients' updates once the mean update is small "
    "and the largest large (Sattler et al. 2020)",
)
class CFL(Clustered):
    """A client trains its cluster's model by local SGD and sends its update Δθ_i (its trainable
    parameters' part counts below). After each round, from round ``start_round`` on, a cluster
    whose round clients' mean update has a norm below ``eps1`` while the largest of their updates
    has a norm above ``eps2`` (the paper's criterion, with FL-bench's defaults 0.4 and 1.6 and its
    ``start_clustering_round`` 20) is split in two: complete-linkage agglomerative clustering of
    its clients on the distance -cos(Δθ_i, Δθ_j), stopped at two clusters, which is how the
    paper's code and FL-bench (src/server/cfl.py, ``cluster_clients``) compute the paper's
    bipartition. A split is kept only when each part holds at least ``min_cluster_size`` of the
    round's clients, and while the run holds fewer than ``max_clusters`` clusters (a cluster
    model is a [P] tensor of the server). The part that holds the lowest client id keeps the
    cluster's number, the other takes the next free one and starts from the cluster's model;
    then every cluster's model moves by the sample-weighted mean of its clients' updates. The
    mean update of the criterion is the unweighted mean, as in both codes.

    A cluster's clients not in the round (not sampled, or lost) stay with the part that keeps its
    number: the paper has every client in every round, where this never happens.
    """

    echoed_reports = ("cluster",)  # the server assigns a client's cluster

    def __init__(
        self,
        eps1: float = 0.4,
        eps2: float = 1.6,
        min_cluster_size: int = 2,
        start_round: int = 20,
        max_clusters: int = 10,
    ):
        self.eps1 = CHECKS.non_negative("eps1", eps1)
        self.eps2 = CHECKS.non_negative("eps2", eps2)
        self.min_cluster_size = CHECKS.count("min_cluster_size", min_cluster_size, 1)
        self.start_round = CHECKS.count("start_round", start_round, 1)
        self.max_clusters = self.slots = CHECKS.count("max_clusters", max_clusters, 1)
        self.warned = False  # whether a split refused for max_clusters was said (once per run)

    def choose(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> int:
        return local.row

    def assign(self, round: Round, server: dict[str, torch.Tensor], trained: torch.Tensor) -> torch.Tensor:
        if round.number < self.start_round:
            return trained
        now, used = trained.clone(), int((server["sizes"] > 0).sum())
        updates = round.updates[: len(trained), : round.num_params]
        for cluster in trained.unique().tolist():
            rows = (trained == cluster).nonzero().flatten()
            cluster_updates = updates[rows]
            if not splits(cluster_updates, self.eps1, self.eps2):
                continue
            second = bipartition(cosine_similarities(cluster_updates)).to(rows.device)
            smaller = min(int(second.sum()), len(rows) - int(second.sum()))
            if smaller < self.min_cluster_size:
                continue
            if used >= self.max_clusters:
                if not self.warned:
                    logger.warning(
                        f"round {round.number}: cluster {cluster} meets CFL's criterion but the run holds "
                        f"max_clusters ({self.max_clusters}) clusters already, so it stays whole (said once per run)"
                    )
                    self.warned = True
                continue
            ids = round.clients[rows]
            if bool(second[ids.argmin()]):  # the part with the lowest client id keeps the number
                second = ~second
            server["models"][used - 1].copy_(self.model_of(cluster, round.global_weights, server))
            now[rows[second]] = used
            used += 1
        return now


def splits(updates: torch.Tensor, eps1: float, eps2: float) -> bool:
    """The paper's criterion on a cluster's updates ([m, n]): the norm of their mean below ``eps1``
    (near a stationary point of the cluster's joint loss), the largest norm above ``eps2`` (far
    from some client's own); a cluster of one client cannot split. Both from the updates' Gram
    matrix, in float64 (``core.blocks``: no float64 copy of the updates): the squared norm of
    the mean is the sum of its entries over m squared."""
    if len(updates) < 2:
        return False
    inner = gram(updates)
    mean_norm = inner.sum().clamp_min(0).sqrt() / len(updates)
    return bool(mean_norm < eps1) and bool(inner.diagonal().max().sqrt() > eps2)


def bipartition(similarity: torch.Tensor) -> torch.Tensor:
    """[m] bool, True for the second of two parts: complete-linkage agglomerative clustering on the
    distances -similarity (``core.clustering.two_clusters``), merging the closest two clusters
    (ties: the first pair in row order) until two are left, the part holding row 0 first. Complete
    linkage: the distance of two clusters is the largest of their members' pairs, so that the two
    parts left are those whose most similar pair across them is least similar among the merges'
    candidates."""
    return two_clusters(-similarity, "complete")[1]
