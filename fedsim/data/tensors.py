"""A dataset as whole tensors, the form every loader gives and every run uses."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Dataset:
    train_x: torch.Tensor  # float32 [N, ...] (images [N, C, H, W]), normalized
    train_y: torch.Tensor  # int64 [N], in 0 .. num_classes - 1
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    name: str = "tensors"  # how config.yaml names a dataset given as an object
    # a federated dataset's own clients (a writer, a role, a user): int64 [N] ids into client_names,
    # of the training samples and of the test samples; None where the data has no clients of its own
    train_clients: torch.Tensor | None = None
    test_clients: torch.Tensor | None = None
    client_names: tuple[str, ...] | None = None
    coarse_labels: torch.Tensor | None = None  # int64 [N]: a superclass of each training sample (CIFAR-100)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def columns(self) -> dict[str, torch.Tensor]:
        """The per-sample columns of the training set that a partition may ask for by name."""
        named = {"clients": self.train_clients, "coarse_labels": self.coarse_labels}
        return {name: column for name, column in named.items() if column is not None}

    def head(self, limit: int) -> Dataset:
        """The first ``limit`` training samples (and their columns), the whole test set."""

        def cut(column: torch.Tensor | None) -> torch.Tensor | None:
            return None if column is None else column[:limit]

        return dataclasses.replace(
            self,
            train_x=self.train_x[:limit],
            train_y=self.train_y[:limit],
            train_clients=cut(self.train_clients),
            coarse_labels=cut(self.coarse_labels),
        )
