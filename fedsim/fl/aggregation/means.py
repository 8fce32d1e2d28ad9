"""Means: FedAvg's weighted mean, the plain mean, and the mean of norm-clipped updates."""

from __future__ import annotations

import torch

from ...core.blocks import row_norms
from . import AGGREGATORS, OPTIONS, Rule, combine, equivariant, mean_of, middle, normalized


@AGGREGATORS.register("fedavg", "mean weighted by client sample counts (McMahan et al. 2017)")
def fedavg() -> Rule:
    def rule(updates, weights):
        return combine(normalized(weights, updates), updates)

    return equivariant(rule)


@AGGREGATORS.register("mean", "unweighted mean of the client updates")
def mean() -> Rule:
    def rule(updates, weights):
        return mean_of(updates)

    return equivariant(rule)


@AGGREGATORS.register(
    "norm_clip",
    "clip each update's L2 norm to max_norm (default: the round's median norm), then the sample-weighted mean",
)
def norm_clip(max_norm: float | None = None) -> Rule:
    """Norm bounding (Sun et al. 2019, "Can you really backdoor federated learning?").

    Each update ``u_i`` becomes ``u_i * min(1, max_norm / ||u_i||)``; the result is their mean
    weighted by sample counts. ``max_norm: null`` clips to the median norm of the round's
    updates, a bound that adapts as updates shrink during training.
    """
    if max_norm is not None:
        max_norm = OPTIONS.positive("max_norm", max_norm)

    def rule(updates, weights):
        norms = row_norms(updates)  # float64: finite for any float32 update
        bound = middle(norms) if max_norm is None else max_norm
        # updates within the bound keep their scale of 1, a zero update too (even for a bound of 0)
        scale = torch.where(norms > bound, bound / norms, 1.0)
        # scaling the weights instead of the rows avoids a second [k, P] tensor
        return combine(normalized(weights, updates) * scale, updates)

    return equivariant(rule)
