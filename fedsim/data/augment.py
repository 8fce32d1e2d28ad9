"""Training-time augmentation of whole batches on the device (no per-sample Python)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

AUGMENT_BY_DEFAULT = {"cifar10", "cifar100"}  # datasets whose usual recipe augments; others opt in


def augmentation_for(data_config: Any, input_shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The batch transform for this dataset, or None when augmentation is off."""
    enabled = data_config.augment
    if enabled is None:
        enabled = isinstance(data_config.dataset, str) and data_config.dataset in AUGMENT_BY_DEFAULT
    return random_crop_flip if enabled else None


def random_crop_flip(x: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Random crop of the zero-padded image back to its size, then a random horizontal flip.

    Draws from the default generator, which each client seeds from (seed, round, client).
    """
    n, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    shift = torch.randint(0, 2 * padding + 1, (2, n, 1), device=x.device)
    rows = (shift[0] + torch.arange(h, device=x.device))[:, None, :, None]  # [n, 1, h, 1]
    cols = (shift[1] + torch.arange(w, device=x.device))[:, None, None, :]  # [n, 1, 1, w]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    out = padded[batch, channel, rows, cols]
    flip = torch.rand(n, device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)
