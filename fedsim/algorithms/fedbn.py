"""FedBN (Li, Jiang, Zhang, Kamp & Dou 2021, "FedBN: Federated learning on non-IID features via
local batch normalization"): each client keeps its batch-norm layers, their weights and running
statistics; the server averages everything else."""

from __future__ import annotations

import torch
from torch import nn

from ..core.errors import ConfigError
from ..core.flat import flat_layout
from . import ALGORITHMS
from .fedper import FedPer


@ALGORITHMS.register(
    "fedbn",
    "each client keeps its batch-norm layers (weights and running statistics), the rest averaged (Li et al. 2021)",
)
class FedBN(FedPer):
    """FedPer with the batch-norm layers as each client's own part, running statistics included (the
    paper's Algorithm 1: the server averages every parameter but the BN layers'). A client starts
    from the global weights, its first round from the global BN layers too, trains them all with
    local SGD (its BN statistics moving with its batches), keeps its BN layers and sends the rest:
    the BN part of its update is zero, so the global model keeps the BN layers it started with.
    ``eval_per_client`` scores each client's own model, the global weights with its BN layers; the
    global model on the global test set has no client's statistics, which is why FedBN's figure is
    the personal one. A model without batch norm is refused: FedBN would be FedAvg."""

    def __init__(self):
        super().__init__(None)

    def bind(self, module: torch.nn.Module) -> None:
        norms = [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms:
            raise ConfigError(
                "algorithm: fedbn keeps each client's batch-norm layers (their weights and running statistics) "
                "and averages the rest; this model has no batch norm, so fedbn would be fedavg: use a model with "
                "batch norm (cifar_cnn_bn, resnet20) or algorithm: fedavg"
            )
        if any(not p.requires_grad for p in module.parameters()):
            raise ConfigError(
                "algorithm: fedbn keeps the batch-norm statistics of each client, which a model with frozen "
                "weights (LoRA) holds in the base all clients share; use fedbn without lora.rank"
            )

        def within(name: str) -> bool:
            return any(name.startswith(layer + ".") for layer in norms)

        self.head = torch.cat([torch.full((t.numel(),), within(name)) for name, t in flat_layout(module)])
        self.personal_layers = norms

    def new_client_state(self, global_weights: torch.Tensor, num_params: int) -> dict[str, torch.Tensor]:
        return {"head": global_weights[self.mask(global_weights)].clone()}
