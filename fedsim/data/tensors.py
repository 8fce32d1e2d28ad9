"""A dataset as whole tensors, the form every loader gives and every run uses."""

from __future__ import annotations

import dataclasses
import operator

import torch

from ..core.errors import DataError, cut

# a token-level target that is not scored (padding): cross-entropy's default ignore_index
IGNORE_INDEX = -100


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

    @property
    def tokens(self) -> bool:
        """A token-level task: targets [N, T] (the next token at each position, IGNORE_INDEX where
        none is scored) rather than one class label a sample; num_classes is the vocabulary."""
        return self.train_y.ndim == 2

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


def class_count(value: object, where: str) -> int:
    """``num_classes`` as an int: an int, a numpy integer or a one-value integer array or tensor;
    a float (even 10.0), a bool or text is refused, since a count of classes read from a file is
    never rounded silently."""
    try:
        if isinstance(value, bool) or getattr(value, "dtype", None) in (bool, torch.bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        shown = value.tolist() if getattr(value, "ndim", None) == 0 else value  # a file's 0-d array, by its value
        kind = getattr(value, "dtype", type(value).__name__)
        raise DataError(f"{where}: num_classes is {cut(repr(shown), 40)} ({kind}); expected an integer") from None


def checked(data: Dataset, where: str) -> Dataset:
    """``data`` with ``num_classes`` as an int, if its own metadata is possible: tensors of [N, ...]
    inputs and [N] integer labels with N > 0, labels in 0 .. num_classes - 1, at least 2 classes,
    and per-sample columns (client ids, coarse labels) of as many rows as the samples; refused in
    one line naming ``where`` otherwise, before anything is allocated for it. Token data (targets
    [N, T], see ``Dataset.tokens``) is checked as such (``_check_tokens``)."""
    tokens = isinstance(data.train_y, torch.Tensor) and data.train_y.ndim == 2
    for split in ("train", "test"):
        x, y = getattr(data, f"{split}_x"), getattr(data, f"{split}_y")
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            raise DataError(
                f"{where}: {split}_x and {split}_y are {type(x).__name__} and {type(y).__name__}; expected tensors"
            )
        if tokens:
            _check_token_shapes(x, y, split, where)
            continue
        if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(y) == 0:
            raise DataError(
                f"{where}: {split}_x has shape {tuple(x.shape)} and {split}_y {tuple(y.shape)}; "
                f"expected [N, ...] inputs and [N] labels, N > 0"
            )
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise DataError(f"{where}: {split}_y must hold integer class labels, got {y.dtype}")
    classes = class_count(data.num_classes, where)
    for split in ("train", "test"):
        y = getattr(data, f"{split}_y")
        if tokens:
            _check_token_ids(getattr(data, f"{split}_x"), y, split, where, classes)
            continue
        low, high = int(y.min()), int(y.max())
        if classes < 2 or low < 0 or high >= classes:
            raise DataError(
                f"{where}: labels must lie in 0 .. num_classes - 1 with at least 2 classes; the {split} "
                f"labels span {low} .. {high} for num_classes {classes}"
            )
    if data.train_x.shape[1:] != data.test_x.shape[1:]:
        raise DataError(
            f"{where}: train inputs {tuple(data.train_x.shape[1:])} and test inputs "
            f"{tuple(data.test_x.shape[1:])} differ in shape"
        )
    samples = {"train_clients": len(data.train_y), "test_clients": len(data.test_y), "coarse_labels": len(data.train_y)}
    for name, count in samples.items():
        column = getattr(data, name)
        if column is not None and (not isinstance(column, torch.Tensor) or column.shape != (count,)):
            got = tuple(column.shape) if isinstance(column, torch.Tensor) else type(column).__name__
            raise DataError(f"{where}: {name} has shape {got}; expected one value per sample, ({count},)")
    return data if type(data.num_classes) is int else dataclasses.replace(data, num_classes=classes)


def _check_token_shapes(x: torch.Tensor, y: torch.Tensor, split: str, where: str) -> None:
    if x.ndim != 2 or x.shape != y.shape or x.numel() == 0:
        raise DataError(
            f"{where}: {split}_x has shape {tuple(x.shape)} and {split}_y {tuple(y.shape)}; token data needs "
            f"inputs and targets of one shape [N, T], N > 0 and T > 0"
        )
    if x.dtype != torch.int64 or y.dtype != torch.int64:
        raise DataError(f"{where}: {split}_x and {split}_y are {x.dtype} and {y.dtype}; token data needs int64 ids")


def _check_token_ids(x: torch.Tensor, y: torch.Tensor, split: str, where: str, vocabulary: int) -> None:
    """Inputs in the vocabulary, targets too where scored (not IGNORE_INDEX), one scored at least."""
    scored = y[y != IGNORE_INDEX]
    if len(scored) == 0:
        raise DataError(
            f"{where}: no {split} target is scored (all are IGNORE_INDEX, {IGNORE_INDEX}); nothing to learn"
        )
    for what, ids in (("inputs", x), ("targets", scored)):
        low, high = int(ids.min()), int(ids.max())
        if vocabulary < 2 or low < 0 or high >= vocabulary:
            unscored = f", or IGNORE_INDEX ({IGNORE_INDEX}) where none is scored" if what == "targets" else ""
            raise DataError(
                f"{where}: token ids must lie in 0 .. num_classes - 1 (a vocabulary of at least 2){unscored}; the "
                f"{split} {what} span {low} .. {high} for num_classes {vocabulary}"
            )
