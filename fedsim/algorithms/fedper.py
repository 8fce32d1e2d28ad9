"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary 2019, "Federated learning with personalization
layers"): a shared body, averaged by the server, and a personal head kept by each client."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..core.checks import Checks
from ..core.errors import did_you_mean
from . import ALGORITHMS
from .base import Algorithm, Clients, LocalResult

CHECKS = Checks("algorithm_options", options=True)


@ALGORITHMS.register(
    "fedper",
    "a personal head per client (personal_layers, default the last layer), a shared "
    "body averaged by the server (Arivazhagan et al. 2019)",
)
class FedPer(Algorithm):
    """A sampled client trains the whole model by local SGD from the global body and its own head
    (the layers named in ``personal_layers``, by module or parameter name as in
    ``named_parameters``; None: the model's last layer), keeps the head it trained, and sends the
    body: the head's part of its update is zero, so the server averages the bodies alone and the
    global model's head stays where it started. A client's head starts as the global one (the same initialization for
    every client, as in the paper); ``eval_per_client`` scores the global body with the client's
    head.
    """

    personal_state = ("head",)

    def __init__(self, personal_layers: list[str] | None = None):
        if personal_layers is not None and not (
            isinstance(personal_layers, (list, tuple))
            and personal_layers
            and all(isinstance(x, str) for x in personal_layers)
        ):
            CHECKS.fail(
                "personal_layers",
                f"must be a list of layer names (or null: the model's last layer), got {personal_layers!r}",
            )
        twice = [name for i, name in enumerate(personal_layers or ()) if name in personal_layers[:i]]
        if twice:
            CHECKS.fail("personal_layers", f"names {twice[0]!r} twice; name each layer once")
        self.personal_layers = personal_layers
        self.head: torch.Tensor | None = None  # [n] bool: the personal coordinates of the trainable weights

    def bind(self, module: torch.nn.Module) -> None:
        # the trained parameters, in the order of the flat weights (a frozen LoRA base is not there)
        trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        names = [name for name, _ in trained]
        layers = sorted({name.rpartition(".")[0] for name in names})
        chosen = self.personal_layers or [names[-1].rpartition(".")[0]]

        def within(name, layer):  # a layer's own parameters, or those of the modules it holds ("": the model)
            return layer == "" or name == layer or name.startswith(layer + ".")

        for layer in chosen:
            if not any(within(name, layer) for name in names):
                CHECKS.fail(
                    "personal_layers",
                    f"names {layer!r}, which is no layer of the model"
                    f"{did_you_mean(layer, layers)}; its layers: {', '.join(layers)}",
                )
        self.head = torch.cat(
            [torch.full((p.numel(),), any(within(name, layer) for layer in chosen)) for name, p in trained]
        )
        if self.head.all():
            CHECKS.fail(
                "personal_layers",
                f"names {', '.join(map(repr, chosen))}, which would leave nothing of the "
                f"model to share; name fewer layers (or parameters, such as a layer's bias)",
            )

    def kept_locally(self) -> torch.Tensor | None:
        return self.head

    def mask(self, like: torch.Tensor) -> torch.Tensor:
        return self.head.to(like.device)

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return {"head": (int(self.head.sum()) if self.head is not None else num_params,)}

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        return self.client_state(num_params)

    def new_client_state(self, global_weights: torch.Tensor, num_params: int) -> dict[str, torch.Tensor]:
        return {"head": global_weights[:num_params][self.mask(global_weights)].clone()}

    def personal_weights(
        self, global_weights: torch.Tensor, rows: dict[str, torch.Tensor], server: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        weights = global_weights.clone()
        weights[: len(self.head)][self.mask(weights)] = rows["head"]
        return weights

    def start_client(self, clients: Clients) -> SimpleNamespace:
        return SimpleNamespace(head=clients.state["head"][0], trained=None)

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: SimpleNamespace) -> Any:
        return self.keep_head(fit(self.personal_weights(start, {"head": local.head})), start, local)

    def keep_head(self, trained: Any, start: torch.Tensor, local: SimpleNamespace) -> Any:
        """Keep the head the client trained, and send the global head back unchanged."""
        weights, mask = trained.weights[: len(self.head)], self.mask(start)
        local.trained = weights[mask].clone()
        weights[mask] = start[: len(self.head)][mask]
        return trained

    def client_report(self, result: LocalResult, local: SimpleNamespace) -> dict[str, torch.Tensor]:
        return {"head": local.trained[None]}
