"""The tensors a round is trained through, allocated once by the server and handed to the
workers once at start-up (CUDA IPC on a GPU, shared memory on a CPU): nothing is pickled per
round but a few-byte message."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..fl.attacks import attacker_mask
from ..fl.sampling import poisson_capacity

if TYPE_CHECKING:
    from ..algorithms import Algorithm
    from ..data.datasets import Dataset
    from ..data.partition import Parts
    from ..experiment.config import Config
    from .state import GlobalState


@dataclass
class RoundBuffers:
    """Everything the workers read or write."""

    train_x: torch.Tensor  # [N, ...] the training inputs (on the device, or in host memory)
    train_y: torch.Tensor  # [N]
    client_indices: torch.Tensor  # every client's sample indices, concatenated
    client_offsets: torch.Tensor  # CPU [num_clients + 1]: client c owns indices[off[c]:off[c+1]]
    num_classes: int
    global_flat: torch.Tensor  # [P] device: the weights clients start from
    client_weights: torch.Tensor  # [k, P] device: one row per client slot of the round ([0, P]: none kept)
    slot_starts: torch.Tensor  # [k, P] device: the weights each slot starts from in an async run ([0, P]: global_flat)
    stats: torch.Tensor  # [k, 3] device: (sample count, mean train loss, local steps taken) per slot
    assignment: torch.Tensor  # CPU [k]: client id per slot
    step_limits: torch.Tensor  # CPU [k]: the most local steps each slot's client may take; -1: all
    slot_keys: torch.Tensor  # CPU [k]: the key of each slot's training stream: the round (an async run's start)
    progress: torch.Tensor  # CPU [W]: client each worker is training (or IDLE / STARTING)
    attackers: torch.Tensor  # CPU bool [num_clients]
    server_state: dict[str, torch.Tensor]  # the algorithm's state (see algorithms/base.py)
    client_state: dict[str, torch.Tensor]  # [k, ...] each: the algorithm's rows of each slot's client
    reports: dict[str, torch.Tensor]  # [k, ...] each: what each slot's client reported
    base: dict[str, torch.Tensor]  # the model's frozen base, one flat tensor per dtype ({}: none; see flat.py)

    @classmethod
    def allocate(
        cls,
        cfg: Config,
        state: GlobalState,
        data: Dataset,
        parts: Parts,
        data_device: torch.device,
        algorithm: Algorithm,
        keeps_copies: bool,
        workers: int,
    ) -> RoundBuffers:
        """The buffers of a run (``state``: its GlobalState): the data where it lives, the rest on the
        state's device; the algorithm's state is the global state's own tensors. A row per client
        a round can hold: clients_per_round, or the largest sample of the run's rounds under
        poisson sampling."""
        k = (
            poisson_capacity(cfg.seed, cfg.rounds, cfg.data.num_clients, cfg.clients_per_round)
            if cfg.client_sampling == "poisson"
            else cfg.clients_per_round
        )
        n, dev = state.model.num_params, state.model.flat.device
        return cls(
            train_x=data.train_x.to(data_device),
            train_y=data.train_y.to(data_device),
            client_indices=parts.indices.to(data_device, copy=True),  # the buffers' own, shared with the workers
            client_offsets=parts.offsets.clone(),
            num_classes=data.num_classes,
            global_flat=torch.zeros(len(state.model), device=dev),
            client_weights=torch.zeros(k if keeps_copies else 0, len(state.model), device=dev),
            slot_starts=torch.zeros(k if cfg.mode == "async" else 0, len(state.model), device=dev),
            stats=torch.zeros(k, 3, device=dev),
            assignment=torch.zeros(k, dtype=torch.int64),
            step_limits=torch.full((k,), -1, dtype=torch.int64),
            slot_keys=torch.zeros(k, dtype=torch.int64),
            progress=torch.zeros(max(workers, 1), dtype=torch.int64),
            attackers=attacker_mask(cfg.seed, cfg.data.num_clients, cfg.attack),
            server_state=state.server_state,
            client_state={
                name: torch.zeros(k, *shape, device=dev) for name, shape in algorithm.client_state(n).items()
            },
            reports={name: torch.zeros(k, *shape, device=dev) for name, shape in algorithm.report_shapes(n).items()},
            base=state.model.base,  # the server's own tensors, shared in place
        ).share_cpu_tensors()

    def tensors(self) -> Iterator[torch.Tensor]:
        for value in vars(self).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, dict):
                yield from value.values()

    def share_cpu_tensors(self) -> RoundBuffers:
        for tensor in self.tensors():
            if tensor.device.type == "cpu":
                tensor.share_memory_()
        return self

    def client_samples(self, client: int) -> torch.Tensor:
        """The indices into train_x of one client's samples."""
        return self.client_indices[int(self.client_offsets[client]) : int(self.client_offsets[client + 1])]
