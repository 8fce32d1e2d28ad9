"""FedSA-LoRA (Guo, Zeng, Wang, Fan, Wang, Qu 2025, "Selective Aggregation for Low-Rank Adaptation
in Federated Learning", ICLR 2025, arXiv 2410.01463): LoRA's A matrices shared, each client's B its own."""

from __future__ import annotations

import torch

from ..core.errors import ConfigError
from . import ALGORITHMS
from .fedper import FedPer


@ALGORITHMS.register(
    "fedsa_lora", "LoRA's A matrices shared and averaged, each client's B kept as its own (FedSA-LoRA, Guo et al. 2025)"
)
class FedSALoRA(FedPer):
    """The A matrices learn what the clients share and are averaged by the server; the B matrices
    learn what is each client's own and stay with it. FedPer with every ``lora_B`` as the personal
    layers: a client trains its A and B from the global A and its own B (the global B, zero, in its
    first round), keeps its B and sends its A; ``eval_per_client`` scores the global A with the
    client's own B."""

    def __init__(self):
        super().__init__(None)

    def bind(self, module: torch.nn.Module) -> None:
        trained = [name for name, p in module.named_parameters() if p.requires_grad]
        self.personal_layers = sorted({name.rpartition(".")[0] for name in trained if ".lora_B." in name})
        if not self.personal_layers or len(self.personal_layers) * 2 > len(trained):
            raise ConfigError(
                "algorithm: fedsa_lora shares LoRA's A matrices and keeps each client's B: it needs LoRA "
                "adapters whose A and B both train (lora.rank > 0 and lora.method: fedit)"
            )
        super().bind(module)
