"""The tensors a round is trained through, allocated once by the server and handed to the
workers once at start-up (CUDA IPC on a GPU, shared memory on a CPU): nothing is pickled per
round but a few-byte message."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    stats: torch.Tensor  # [k, 3] device: (sample count, mean train loss, local steps taken) per slot
    assignment: torch.Tensor  # CPU [k]: client id per slot
    step_limits: torch.Tensor  # CPU [k]: the most local steps each slot's client may take; -1: all
    progress: torch.Tensor  # CPU [W]: client each worker is training (or IDLE / STARTING)
    attackers: torch.Tensor  # CPU bool [num_clients]
    server_state: dict[str, torch.Tensor]  # the algorithm's state (see algorithms/base.py)
    client_state: dict[str, torch.Tensor]  # [k, ...] each: the algorithm's rows of each slot's client
    reports: dict[str, torch.Tensor]  # [k, ...] each: what each slot's client reported

    def tensors(self):
        for value in vars(self).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, dict):
                yield from value.values()

    def share_cpu_tensors(self) -> "RoundBuffers":
        for tensor in self.tensors():
            if tensor.device.type == "cpu":
                tensor.share_memory_()
        return self

    def client_samples(self, client: int) -> torch.Tensor:
        """The indices into train_x of one client's samples."""
        return self.client_indices[int(self.client_offsets[client]): int(self.client_offsets[client + 1])]
