"""A model whose float state lives in one flat tensor.

Parameters (and floating-point buffers such as batch-norm statistics) become views into
``flat``, and their gradients views into ``grad``. Loading the global weights, storing a
client's weights and taking an SGD step are then a handful of whole-tensor operations,
whatever the number of layers.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class FlatModel:
    def __init__(self, module: nn.Module, device: torch.device | str, flat: torch.Tensor | None = None):
        """``flat``: a tensor to hold the state in, as it is (the module's own values are dropped);
        Hogwild's workers pass the shared global weights, so that every step lands there."""
        self.module = module.to(device)
        params = list(module.parameters())
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.num_params = sum(p.numel() for p in params)  # flat[:num_params] are trainable
        if flat is None:
            flat = torch.cat([t.detach().reshape(-1) for t in params + buffers])
        elif flat.numel() != sum(t.numel() for t in params + buffers):
            raise ValueError(f"a flat state of {flat.numel()} values cannot hold this model's state")
        self.flat = flat
        self.grad = torch.zeros(self.num_params, device=self.flat.device)
        offset = 0
        for t in params + buffers:
            n = t.numel()
            t.data = self.flat[offset : offset + n].view_as(t)
            if offset < self.num_params:
                t.grad = self.grad[offset : offset + n].view_as(t)
            offset += n

    @property
    def params(self) -> torch.Tensor:
        """The trainable part of ``flat`` (buffers excluded)."""
        return self.flat[: self.num_params]

    def __len__(self) -> int:
        return self.flat.numel()
