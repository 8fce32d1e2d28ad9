"""FLoRA (Wang, Shen, He, Sun, Wang, Lyu, Li 2024, "FLoRA: Federated Fine-Tuning Large Language
Models with Heterogeneous Low-Rank Adaptations", NeurIPS 2024, arXiv 2409.05976): the clients'
adapters stacked, not averaged, and merged into the base every round."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.errors import ConfigError
from ..core.streams import LORA_INIT, torch_seed
from ..models.lora import Adapter, adapters, client_ranks
from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult, Round


@ALGORITHMS.register(
    "flora",
    "LoRA clients of any ranks (lora.client_ranks) train fresh adapters each round; the server stacks "
    "them and merges sum_k p_k B_k A_k into the shared base (Wang et al. 2024)",
)
class FLoRA(Algorithm):
    """Every round, client k trains fresh adapters of its own rank r_k (lora.client_ranks), drawn
    as peft draws them: A uniform in +-1/sqrt(fan_in) from the client's own stream (rows beyond
    r_k zero), B zero. The server stacks the clients' adapters, A_k scaled by p_k = n_k / sum n
    (sample counts), so that the stacked product is exactly sum_k p_k s B_k A_k, and merges it
    into the frozen base: W <- W + sum_k p_k s B_k A_k in every adapted layer. The global
    adapters keep B at zero, so the global model is the merged base.

    The base is the one every worker reads (``lora.share_base``), changed by the server between
    rounds. The server state keeps the adapted layers' frozen weights as the merges left them
    (``base``) and how many rounds merged into them (``merges``; 0: the base as built): a
    checkpoint holds them and a resumed run (or ``fedsim.load_model``) copies them back. Adding
    the sum of the merges once would not do: float32 rounds that sum otherwise than the merges
    added one by one, and the resumed run would drift from the uninterrupted one. The stacking
    takes the place of an aggregation rule, DP-FedAvg and a server optimizer, which are refused.
    """

    reads = ("lora.client_ranks",)  # each client's own rank
    recorded_reports = ("lora_rank",)  # clients.csv's column of each client's rank

    def __init__(self) -> None:
        self.layout: list[Adapter] = []

    def setup(self, config: Any) -> None:
        super().setup(config)
        refused = [
            (not config.lora.share_base, "lora.share_base: false gives each worker a base of its own"),
            (config.aggregator not in (None, "fedavg"), f"aggregator: {config.aggregator} is not applied"),
            (bool(config.pre_aggregators), "pre_aggregators: they are not applied"),
            (config.privacy is not None, "privacy: DP-FedAvg's clipping and noise are not applied"),
            (config.server_optimizer != "none", f"server_optimizer: {config.server_optimizer} is not applied"),
            # stacking multiplies each client's own B and A; a compressed update keeps neither whole
            (config.compression.type != "none", f"compression.type: {config.compression.type} would part them"),
            # each rank builds its own base, which only the first rank's server would merge into
            (os.environ.get("WORLD_SIZE", "1").strip() != "1", "several ranks hold a base each"),
        ]
        for refuse, why in refused:
            if refuse:
                raise ConfigError(
                    f"algorithm: flora stacks the clients' adapters and merges them into the one base the "
                    f"workers share, in place of an aggregation rule: {why}; remove it"
                )
        self.ranks = client_ranks(config.lora, config.data.num_clients, config.seed)

    def bind(self, module: torch.nn.Module) -> None:
        self.layout = adapters(module, "flora")
        self.module = module  # in the server, its frozen base is the shared one the merges go into

    def server_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"base": (sum(a.fan_out * a.fan_in for a in self.layout),), "merges": (1,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"lora_rank": (1,)}  # its rank, for clients.csv (the shapes of its adapters tell the server)

    def aggregation(self, rule: str) -> str:
        return "stacking merged into the base (FLoRA)"  # setup refused any other rule

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        return {"lora_rank": result.weights.new_full((1, 1), float(local.rank))}

    def start_client(self, clients: Clients) -> SimpleNamespace:
        client = int(clients.ids[0])
        seed = torch_seed(LORA_INIT, self.config.seed, clients.round, client)
        return SimpleNamespace(rank=int(self.ranks[client]), seed=seed)

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> Any:
        fresh = start.clone()
        generator = torch.Generator().manual_seed(local.seed)
        for adapter in self.layout:
            bound = 1 / math.sqrt(adapter.fan_in)  # peft's kaiming_uniform_(a=sqrt(5))
            a = torch.empty(adapter.rank, adapter.fan_in).uniform_(-bound, bound, generator=generator)
            a[local.rank :] = 0
            adapter.a(fresh).copy_(a)
            adapter.b(fresh).zero_()
        return fit(fresh)  # a zero row of A meets a zero column of B: both stay zero

    def merges(self, round: Round) -> list[torch.Tensor]:
        """Each adapted layer's sum_k p_k s B_k A_k ([fan_out, fan_in]), from the stacked adapters."""
        n = round.num_params
        sent = round.global_weights[:n] + round.updates[:, :n]
        p = round.weights / round.weights.sum()
        out = []
        for adapter in self.layout:
            b = adapter.b(sent).transpose(0, 1).flatten(1)  # [fan_out, k r]: the B_k side by side
            a = (p[:, None, None] * adapter.a(sent)).flatten(0, 1)  # [k r, fan_in]: the p_k A_k stacked
            out.append(adapter.scaling * (b @ a))
        return out

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        self.merge(self.merges(round))
        server["base"].copy_(torch.cat([weight.flatten() for weight in self.base_weights()]))
        server["merges"] += 1
        return torch.zeros_like(round.global_weights)  # B stays zero: the global model is the merged base

    def resume(self, server: dict[str, torch.Tensor]) -> None:
        if not server["merges"].any():
            return  # no round merged anything: the base is the one built
        parts = server["base"].split([weight.numel() for weight in self.base_weights()])  # as server_update cat'd
        with torch.no_grad():
            for weight, part in zip(self.base_weights(), parts):
                weight.copy_(part.view_as(weight))

    def base_weights(self) -> list[torch.Tensor]:
        """The adapted layers' frozen weights, in the order of ``layout``, as the layers store them."""
        return [self.module.get_submodule(adapter.layer).base_layer.weight for adapter in self.layout]

    def merge(self, merges: list[torch.Tensor]) -> None:
        """Add each layer's merge to its frozen weight, in place (a Conv1D's is stored transposed)."""
        for adapter, weight, merge in zip(self.layout, self.base_weights(), merges):
            merge = merge.T if getattr(self.module.get_submodule(adapter.layer), "fan_in_fan_out", False) else merge
            with torch.no_grad():
                weight.add_(merge.to(weight.device, weight.dtype))
