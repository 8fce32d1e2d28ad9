"""What the server keeps between rounds: the global model, the server optimizer's state, the
algorithm's server state, privacy's (the adaptive clip), the memory of a rule that remembers
earlier rounds (centered clipping's last aggregate), every client's own state (the
algorithm's rows and compression's residuals, see client_state.py) and the bytes sent so far.
All of it, and nothing else, is what a checkpoint holds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.checks import is_integer
from ..core.errors import FedsimError
from ..core.flat import FlatModel, check_same_base
from ..fl.client_state import ClientStates
from ..results.keys import flatten_config

if TYPE_CHECKING:
    from ..algorithms import Algorithm
    from ..fl.server_opt import ServerOptimizer


def _fits(key: str, value: object, like: torch.Tensor) -> bool:
    """Whether the checkpoint's ``value`` for ``key`` can stand for this run's ``like``: a tensor of its
    shape and dtype; a rule's memory may grow from round to round, so there all but the first size."""
    if not isinstance(value, torch.Tensor) or value.dtype != like.dtype or value.dim() != like.dim():
        return False
    return value.shape == like.shape or (key.startswith("aggregator.") and value.shape[1:] == like.shape[1:])


class GlobalState:
    """``description`` names the run's model, algorithm and server optimizer for the message
    that refuses another run's checkpoint. The algorithm's server state is allocated here and
    shared with the workers through the round's buffers (they read it, the server changes it);
    ``clients`` holds every client's rows, which reach the workers as the round's rows."""

    def __init__(
        self,
        model: FlatModel,
        server_optimizer: ServerOptimizer,
        algorithm: Algorithm,
        clients: ClientStates,
        description: str,
        privacy_state: dict[str, torch.Tensor] | None = None,
        base_source: str = "the model",
    ):
        n, device = model.num_params, model.flat.device
        self.model, self.server_optimizer, self.description = model, server_optimizer, description
        self.algorithm, self.clients = algorithm, clients
        self.privacy_state = privacy_state or {}  # privacy's own tensors, changed in place by it
        # the rule's memory (fl/aggregation/__init__.py's Memory), replaced after each round kept
        self.aggregator_state: dict[str, torch.Tensor] = {}
        # bytes up and down since round 1; None where nothing is counted (nothing travels, or a resumed
        # checkpoint of an earlier version, which did not count them)
        self.bytes_sent: int | None = 0
        self.simulated_time: float | None = 0.0  # simulated seconds since round 1 (None: as bytes_sent)
        self.rounds_left_out = 0  # rounds whose updates were too few for the rule (engine/update.py)
        self.schedule = None  # an async run's clients in flight (engine/async_loop.py's Schedule)
        self.server_state = {
            name: torch.zeros(*shape, device=device) for name, shape in algorithm.server_state(n).items()
        }
        algorithm.start_server(self.server_state, model)
        self.algorithm_rows = tuple(algorithm.client_state(n))  # the names of the algorithm's rows in clients
        self.saved_round = 0  # the round of the last state saved (or resumed from); 0: none
        # the frozen base (LoRA's) as built, before any round merges into it (FLoRA), and what gave it
        self.base_digest, self.base_source = model.base_digest(), base_source

    def step(self, delta: torch.Tensor) -> None:
        """Move the global model by ``delta``, the round's aggregated update: the server
        optimizer's step on the parameters; buffers (batch-norm statistics) are averaged as they are."""
        n = self.model.num_params
        self.server_optimizer.step(self.model.params, delta[:n])
        self.model.flat[n:].add_(delta[n:])

    def tensors(self) -> list[torch.Tensor]:
        return [self.model.flat, *self.server_state.values()]

    def client_rows(self, clients: list[int]) -> dict[str, torch.Tensor]:
        """The algorithm's rows of ``clients`` ([k, ...] each, on the model's device); a client
        without one gets what the algorithm starts a client from."""
        start = self.algorithm.new_client_state(self.model.flat, self.model.num_params)
        return {name: self.clients.gather(name, clients, start[name]) for name in self.algorithm_rows}

    def trained_clients(self) -> set[int]:
        """The clients holding a row of the algorithm's state, those trained at least once; the
        others use the model they would start from."""
        return {c for name in self.algorithm_rows for c in self.clients.rows[name]}

    def personal_weights_of(self, clients: list[int]) -> torch.Tensor:
        """The weights ([c, P]) the ``clients`` use as their own models (an algorithm with personal
        models); a client not trained yet has the model it would start from."""
        rows = self.client_rows(clients)
        own = self.algorithm.personal_weights
        server = self.server_state
        return torch.stack(
            [own(self.model.flat, {k: v[i] for k, v in rows.items()}, server) for i in range(len(clients))]
        )

    def state_dict(self, rnd: int) -> dict:
        return {
            "round": rnd,
            "global": self.model.flat.cpu(),
            "server_optimizer": {k: v.cpu() for k, v in self.server_optimizer.state_dict().items()},
            "algorithm": {"server": {k: v.cpu() for k, v in self.server_state.items()}},
            "privacy": {k: v.cpu() for k, v in self.privacy_state.items()},
            **({"aggregator": {k: v.cpu() for k, v in self.aggregator_state.items()}} if self.aggregator_state else {}),
            "client_state": self.clients.state_dict(),
            "bytes_sent": self.bytes_sent,
            "simulated_time": self.simulated_time,
            "rounds_left_out": self.rounds_left_out,
            **({"schedule": self.schedule.state_dict()} if self.schedule is not None else {}),
            "torch_rng": torch.get_rng_state(),
            **({"base_digest": self.base_digest} if self.base_digest else {}),
        }

    def load_state_dict(self, state: dict, source: Path) -> None:
        """Continue from ``state``, the checkpoint read from the file ``source``."""
        self._check(state, source)
        self.clients.load_state_dict(state.get("client_state", {}), source)
        self.model.flat.copy_(state["global"])
        self.server_optimizer.load_state_dict(state["server_optimizer"])
        for name, value in state["algorithm"]["server"].items():
            self.server_state[name].copy_(value)
        self.algorithm.resume(self.server_state)
        for name, value in state.get("privacy", {}).items():
            self.privacy_state[name].copy_(value)
        for name, like in self.aggregator_state.items():  # what it remembers may grow (every norm seen)
            self.aggregator_state[name] = state["aggregator"][name].to(like.device)
        self.bytes_sent = state.get("bytes_sent")  # a checkpoint of an earlier version did not count them
        self.simulated_time = state.get("simulated_time")
        self.rounds_left_out = state.get("rounds_left_out", 0)  # an earlier version's checkpoint: it left none out
        if self.schedule is not None:
            self.schedule.load_state_dict(state.get("schedule"), source, self.model.flat)
        torch.set_rng_state(state["torch_rng"])
        self.saved_round = state["round"]

    def _check(self, state: dict, source: Path) -> None:
        """Every tensor the run restores must be there with this run's shape, finite, and nothing
        else: a checkpoint copied from another run (or torn by hand) is refused in one line."""
        expected = {
            "global": self.model.flat,
            "torch_rng": torch.get_rng_state(),
            **{f"server_optimizer.{k}": v for k, v in self.server_optimizer.state_dict().items()},
            **{f"algorithm.server.{k}": v for k, v in self.server_state.items()},
            **{f"privacy.{k}": v for k, v in self.privacy_state.items()},
            **{f"aggregator.{k}": v for k, v in self.aggregator_state.items()},
        }
        sections = ("server_optimizer", "algorithm", "privacy", "aggregator")
        saved = dict(flatten_config({key: state.get(key) for key in sections}))
        unexpected = sorted(k for k, v in saved.items() if isinstance(v, torch.Tensor) and k not in expected)
        if unexpected:
            raise FedsimError(
                f"{source}: holds {unexpected[0]}, which this run does not keep; it is not this run's checkpoint"
            )
        for key, like in expected.items():
            value = state
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if not _fits(key, value, like):
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "nothing"
                raise FedsimError(
                    f"{source}: holds {got} for {key} where this run ({self.description}) needs "
                    f"{tuple(like.shape)}; it is not this run's checkpoint"
                )
            if value.is_floating_point() and not torch.isfinite(value).all():  # a run never saves one
                raise FedsimError(
                    f"{source}: {key} holds NaN or Inf; the checkpoint is damaged and cannot be resumed from"
                )
        check_same_base(state, self.base_digest, source, self.base_source)
        if (self.schedule is not None) != ("schedule" in state):
            has = "lacks" if self.schedule is not None else "holds"
            raise FedsimError(
                f"{source}: {has} the clients in flight of an async run (mode: async); it is not this run's checkpoint"
            )
        clock = state.get("simulated_time")
        if clock is not None and not (isinstance(clock, float) and clock >= 0):
            raise FedsimError(
                f"{source}: holds {clock!r} for simulated_time where simulated seconds belong; it is "
                f"not this run's checkpoint"
            )
        sent = state.get("bytes_sent")
        if sent is not None and not (is_integer(sent) and sent >= 0):
            raise FedsimError(
                f"{source}: holds {sent!r} for bytes_sent where a count of bytes belongs; it is not "
                f"this run's checkpoint"
            )

    def kept(self) -> str:
        """What a run that stops now still has on disk, for its error message."""
        return (
            f"the checkpoint of round {self.saved_round} is kept" if self.saved_round else "no checkpoint was written"
        )
