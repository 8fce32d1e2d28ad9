"""Agglomerative clustering of a few rows into two: the clipped-clustering rule (fl/aggregation)
and CFL's bipartition (algorithms/cfl.py) both split a round's updates so."""

from __future__ import annotations

import math

import torch


def two_clusters(distances: torch.Tensor, linkage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two clusters that agglomerative clustering of ``distances`` (``[k, k]``) leaves, as
    ``[k]`` bool masks: the one holding row 0, then the other (empty for k < 2). Each step merges
    the two closest clusters, their distance to the others updated by Lance and Williams' formula
    (``average``: the mean over pairs of members, weighted by size; ``single``: the nearest pair;
    ``complete``: the farthest pair). A cluster is named by its lowest row; equal distances merge
    the pair of lowest names first. The work is in float64."""
    k = len(distances)
    members = torch.eye(k, dtype=torch.bool, device=distances.device)
    sizes = torch.ones(k, dtype=torch.float64, device=distances.device)
    d = distances.to(torch.float64, copy=True).fill_diagonal_(math.inf)
    for _ in range(k - 2):
        a, b = divmod(int(d.flatten().sort(stable=True).indices[0]), k)  # a < b: the upper triangle comes first
        if linkage == "average":
            merged = (sizes[a] * d[a] + sizes[b] * d[b]) / (sizes[a] + sizes[b])
        elif linkage == "single":
            merged = torch.minimum(d[a], d[b])
        else:
            merged = torch.maximum(d[a], d[b])
        d[a], d[:, a] = merged, merged
        d[b], d[:, b] = math.inf, math.inf
        d[a, a] = math.inf
        members[a] |= members[b]
        sizes[a] += sizes[b]
        sizes[b] = 0
    if k < 2:
        return members.any(dim=0), torch.zeros(k, dtype=torch.bool, device=distances.device)
    first, second = sizes.nonzero().flatten()[:2].tolist()
    return members[first], members[second]
