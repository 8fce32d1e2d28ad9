"""Rules that remember earlier rounds: centered clipping clips around the last aggregate, clipped
clustering clips at the median norm of every update seen so far. What each remembers is a
``Memory`` of tensors (see ``remembering``), which the run keeps in its checkpoints, so that a
resumed run goes on exactly as an uninterrupted one."""

from __future__ import annotations

import torch

from ...core.blocks import cosine_similarities, row_norms
from ...core.clustering import two_clusters
from . import AGGREGATORS, OPTIONS, Memory, Rule, combine, equivariant, mean_of, middle, remembering, tolerating


@AGGREGATORS.register(
    "centered_clipping",
    "the last aggregate moved by the mean of each update's difference from it, clipped to norm tau, "
    "iterations times (tau 100, 1 iteration; Karimireddy et al. 2021)",
)
def centered_clipping(tau: float = 100.0, iterations: int = 1) -> Rule:
    """Centered clipping (Karimireddy, He & Jaggi 2021, "Learning from history for Byzantine robust
    optimization"): from ``v_0``, the aggregate of the last round (0 before the first),
    ``v_{l+1} = v_l + (1/k) sum_i (x_i - v_l) min(1, tau / ||x_i - v_l||)`` for ``iterations``
    steps; the result is ``v_L``, which the next round starts from. The defaults are ByzFL's
    (``CenteredClipping``: tau = 100, L = 1), whose instance also starts each call from its last
    output. Sample counts are ignored. Each step is the convex combination
    ``(1 - sum c_i) v_l + sum c_i x_i`` with ``c_i = min(1, tau / ||x_i - v_l||) / k``: no
    ``[k, P]`` stack of differences is made."""
    tau = OPTIONS.positive("tau", tau)
    OPTIONS.count("iterations", iterations, 1)

    def rule(updates, weights, memory: Memory):
        k = updates.shape[0]
        centre = memory.kept["centre"]
        for _ in range(iterations):
            distances = row_norms(updates, centre)
            share = torch.where(distances > tau, tau / distances, 1.0) / k
            coefficients = torch.cat([(1 - share.sum()).clamp(min=0)[None], share])
            centre = combine(coefficients, torch.cat([centre[None], updates]))
        memory.new["centre"] = centre
        return centre.clone()

    return remembering(rule, lambda like: {"centre": torch.zeros_like(like)})


def cosine_distances(rows: torch.Tensor) -> torch.Tensor:
    """``[k, k]`` ``1 - cos(rows_i, rows_j)`` in float64, as ``torch.nn.functional.cosine_similarity``
    defines the cosine (each norm at least 1e-8, so a zero row is at distance 1 from every row)."""
    return 1 - cosine_similarities(rows, eps=1e-8)


def larger_of_two_clusters(distances: torch.Tensor, linkage: str) -> torch.Tensor:
    """The rows of the larger of the two clusters that agglomerative clustering of ``distances``
    (``[k, k]``, ``linkage`` average or single: ``core.clustering.two_clusters``) leaves; of two
    clusters of equal size, the one holding row 0. A ``[k]`` bool mask."""
    first, second = two_clusters(distances, linkage)
    return second if second.sum() > first.sum() else first


@AGGREGATORS.register(
    "clipped_clustering",
    "updates clipped to the median norm of all updates so far, then the mean of the larger of two clusters "
    "by cosine distance (Li, Ngai & Voigt 2023, as Blades ships it)",
)
def clipped_clustering(max_tau: float = 1e5, linkage: str = "average", agg: str = "mean") -> Rule:
    """Clipped clustering (Li, Ngai & Voigt 2023, "An experimental study of Byzantine-robust
    aggregation schemes in federated learning"), as Blades' ``Clippedclustering`` computes it:

    1. the norms of this round's updates join those of every earlier round; the clipping bound is
       their median (for an even count, the mean of the two middle norms), at most ``max_tau``;
    2. each update longer than the bound is scaled to it;
    3. the clipped updates are split in two by agglomerative clustering of their cosine distances
       (``linkage``: average or single); the larger cluster is kept (of two of equal size, the one
       holding the first update, where Blades takes whichever scikit-learn labels 0);
    4. the result is their unweighted mean (``agg: median``: their coordinate-wise median).

    Blades' ``signguard`` option (a second clustering by the signs' shares) is not offered. The
    memory holds every norm seen, 8 bytes per update. Sample counts are ignored."""
    max_tau = OPTIONS.positive("max_tau", max_tau)
    OPTIONS.one_of("linkage", linkage, ("average", "single"))
    OPTIONS.one_of("agg", agg, ("mean", "median"))

    def rule(updates, weights, memory: Memory):
        norms = row_norms(updates)
        seen = torch.cat([memory.kept["norms"], norms])
        memory.new["norms"] = seen
        bound = min(float(middle(seen[:, None])[0]), max_tau)
        scale = torch.where(norms > bound, bound / norms, 1.0).to(updates.dtype)
        clipped = updates * scale[:, None]
        kept = clipped[larger_of_two_clusters(cosine_distances(clipped), linkage)]
        return mean_of(kept) if agg == "mean" else middle(kept)

    rule = remembering(rule, lambda like: {"norms": like.new_zeros(0, dtype=torch.float64)})
    if agg == "mean":  # its memory holds norms alone, which a rotation keeps
        equivariant(rule)
    return tolerating(rule, lambda k: (k - 1) // 2)
