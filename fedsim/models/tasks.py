"""What a model is trained and scored on: one class label a sample ([N] targets), or the next
token at each position of a sequence ([N, T] targets, IGNORE_INDEX where nothing is scored).

One loss serves both: the mean cross-entropy over the scored targets. A model's scores are
[B, classes] or [B, T, vocabulary]; flattened to one row per target, they are the same sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.tensors import IGNORE_INDEX


def loss(scores: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the scored targets, in float32 whatever the model computes in (a
    language model's bf16 scores); the mean is over the scored targets, not the samples."""
    if scores.ndim == 2 and scores.dtype == torch.float32:  # a classifier's: as it is, three calls fewer a step
        return F.cross_entropy(scores, targets, reduction=reduction)
    return F.cross_entropy(scores.flatten(0, -2).float(), targets.flatten(), reduction=reduction)


def hits(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """int64 [B]: each sample's targets its top score gets right (0 or 1 for a class label)."""
    right = (scores.argmax(dim=-1) == targets).to(torch.int64)  # IGNORE_INDEX is no score's index
    return right if right.ndim == 1 else right.sum(dim=1)


def counted(targets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float, the shape of ``targets``: 1 where a target is scored in a sample of ``weight`` 1 (a
    sample of weight 0 pads a batch), else 0; ``weight`` has the targets' leading dimensions."""
    weight = weight.reshape(*weight.shape, *[1] * (targets.ndim - weight.ndim))
    return (targets != IGNORE_INDEX).to(weight.dtype) * weight


def scored(targets: torch.Tensor) -> torch.Tensor:
    """int64 [B]: each sample's scored targets (1 for a class label)."""
    if targets.ndim == 1:
        return torch.ones_like(targets)
    return (targets != IGNORE_INDEX).sum(dim=1)


def perplexity(mean_loss: float) -> float:
    """exp of the mean loss per token, as language-model papers report it; inf past float range."""
    return float(torch.tensor(mean_loss, dtype=torch.float64).exp())
