"""HetLoRA (Cho, Liu, Xu, Fahrezi, Joshi 2024, "Heterogeneous LoRA for Federated Fine-tuning of
On-Device Foundation Models"): clients of different LoRA ranks, zero-padding and
sparsity-weighted aggregation, and rank self-pruning."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.checks import Checks
from ..models.lora import Adapter, adapters, client_ranks, rank_mask
from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult, Round

CHECKS = Checks("algorithm_options", options=True)


@ALGORITHMS.register(
    "hetlora",
    "LoRA clients of different ranks (lora.client_ranks): the global adapters truncated to each, "
    "rank self-pruning, zero-padding and sparsity-weighted aggregation (Cho et al. 2024)",
)
class HetLoRA(Algorithm):
    """The global adapters have rank r_max = lora.rank. Client k, of rank r_k (lora.client_ranks),
    starts from them truncated to their first r_k components (A's rows, B's columns) and trains
    those alone, on its loss plus the self-pruning penalty lam * sum over the adapted layers of
    ||A_k[c:r_k]||_F ||B_k[:, c:r_k]||_F, c = floor(gamma r_k): it pushes the last components
    toward zero. Where that sum at the end of the client's training is below the one it reached
    at the end of its previous round (in its first round, the one it started from), the client
    prunes them: it sends them as zeros and has rank c from then on. No tail is penalised or pruned
    at rank 1 or with gamma 1. clients.csv records the rank each client trained at
    (``trained_rank``) and its rank after the round (``lora_rank``), and summary.json counts the
    prunes (``prunes``).

    The pruning rule is §3.2 of the paper (arXiv 2401.06432, "Local Training with Rank
    Self-Pruning") as read here: the regularisation term is compared with its value in the
    client's previous round, which the client keeps (its ``tail``). A reading that compares it
    with its value on the adapters the client received this round prunes less often.

    The server zero-pads every client's adapters to r_max (they are zeros beyond r_k in the flat
    weights) and aggregates them with weights proportional to ||Delta W_k||_F, the norm of the
    client's whole adapter product (the square root of the sum over layers of ||s B_k A_k||_F^2),
    in place of the sample counts the run's rule would use (sparsity-weighted aggregation).
    """

    personal_state = ("lora_rank", "tail")  # the client's own rank and the tail it last reached
    reads = ("lora.client_ranks",)  # each client's own rank
    recorded_reports = ("trained_rank", "lora_rank")  # clients.csv: the rank it trained at, and its rank after

    def __init__(self, lam: float = 0.01, gamma: float = 0.9):
        self.lam = CHECKS.non_negative("lam", lam)
        self.gamma = CHECKS.within("gamma", CHECKS.number("gamma", gamma, "must be a number in (0, 1]"), 0, 1, "(]")
        self.layout: list[Adapter] = []

    def setup(self, config: Any) -> None:
        super().setup(config)
        self.ranks = client_ranks(config.lora, config.data.num_clients, config.seed)

    def bind(self, module: torch.nn.Module) -> None:
        self.layout = adapters(module, "hetlora")
        self.num_params = sum(p.numel() for p in module.parameters() if p.requires_grad)

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"lora_rank": (1,), "tail": (1,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {**self.client_state(num_params), "trained_rank": (1,)}

    def new_client_state(self, global_weights: torch.Tensor, num_params: int) -> dict[str, torch.Tensor]:
        # rank 0: the federation's (lora.client_ranks); tail -1: no round trained yet
        return {"lora_rank": global_weights.new_zeros(1), "tail": global_weights.new_full((1,), -1.0)}

    def start_client(self, clients: Clients) -> SimpleNamespace:
        kept = int(clients.state["lora_rank"][0, 0])
        rank = kept or int(self.ranks[int(clients.ids[0])])
        return SimpleNamespace(rank=rank, trained=rank, tail=float(clients.state["tail"][0, 0]))

    def tail(self, rank: int) -> int:
        """Where the penalised components of a client of rank ``rank`` start (``rank``: none)."""
        cut = int(self.gamma * rank)
        return cut if cut >= 1 else rank

    def tail_norm(self, weights: torch.Tensor, rank: int) -> float:
        cut = self.tail(rank)
        return sum(float(a.a(weights)[cut:rank].norm() * a.b(weights)[:, cut:rank].norm()) for a in self.layout)

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> Any:
        n = self.num_params
        mask = rank_mask(self.layout, n, local.rank, start.device)
        truncated = start.clone()
        truncated[:n] *= mask
        before = local.tail if local.tail >= 0 else self.tail_norm(truncated, local.rank)
        trained = fit(truncated, trainable=mask)
        weights = trained.weights[:n]
        reached = self.tail_norm(weights, local.rank)
        cut = self.tail(local.rank)
        if cut < local.rank and reached < before:  # self-pruning: the tail is sent as zeros
            local.rank = cut
            weights.mul_(rank_mask(self.layout, n, cut, weights.device))
            reached = self.tail_norm(weights, cut)
        local.tail = reached
        return trained

    def adjust_gradient(self, grad: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, local: Any) -> None:
        cut = self.tail(local.rank)
        if self.lam == 0 or cut == local.rank:
            return
        for adapter in self.layout:  # d/dA ||A|| ||B|| = ||B|| A / ||A||, and likewise for B (0 at 0)
            a, b = adapter.a(weights)[..., cut : local.rank, :], adapter.b(weights)[..., cut : local.rank]
            norm_a, norm_b = a.norm(), b.norm()
            if norm_a > 0:
                adapter.a(grad)[..., cut : local.rank, :] += self.lam * norm_b / norm_a * a
            if norm_b > 0:
                adapter.b(grad)[..., cut : local.rank] += self.lam * norm_a / norm_b * b

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        like = result.weights
        return {
            "lora_rank": like.new_full((1, 1), float(local.rank)),
            "tail": like.new_full((1, 1), local.tail),
            "trained_rank": like.new_full((1, 1), float(local.trained)),
        }

    def aggregation(self, rule: str) -> str:
        weighed = "" if rule == "fedavg" else f" {rule}"  # the rule, given the norms in place of the sample counts
        return f"sparsity-weighted{weighed} zero-padding (HetLoRA)"

    def summary(self, client_rows: list[dict]) -> dict:
        """``prunes``: the client rounds that ended at a lower rank than they trained at."""
        ranks = [(r["trained_rank"], r["lora_rank"]) for r in client_rows if r.get("trained_rank") is not None]
        return {"prunes": sum(after < trained for trained, after in ranks)}

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        n = round.num_params
        sent = round.global_weights[:n] + round.updates[:, :n]  # zero beyond each client's rank: zero-padded
        norms = sum(adapter.product(sent).square().sum(dim=(1, 2)) for adapter in self.layout).sqrt()
        weights = norms if norms.sum() > 0 else round.weights  # every product zero: nothing to weigh by
        return round.aggregate(round.updates, weights)
