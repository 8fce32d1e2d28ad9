"""CIFAR-100 from the python pickles torchvision reads, with its fine and coarse labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..core.errors import DataError, cut
from .datasets import DATASETS, _ArraysOnly, _download
from .tensors import Dataset

CIFAR100_FOLDER = "cifar-100-python"  # torchvision's layout: the python-version archive, extracted
CIFAR100_SPLITS = ("train", "test")
CIFAR100_META = "meta"
# channel means and standard deviations of the 50,000 training images (pixels scaled to [0, 1]),
# as weiaicunzai/pytorch-cifar100 computes them (utils.compute_mean_std, conf/global_settings.py)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


@DATASETS.register(
    "cifar100", "CIFAR-100 colour images: 50,000 train / 10,000 test, 3x32x32, 100 classes in 20 coarse labels"
)
def cifar100(root: Path, download: bool = True) -> Dataset:
    """Read ``root/cifar-100-python`` (train, test, meta) directly, so a read-only copy works;
    download there if a file is missing. The labels are the fine ones; the training samples'
    coarse labels (superclasses) come as the ``coarse_labels`` column, for ``pachinko``."""
    folder = root / CIFAR100_FOLDER
    names = (*CIFAR100_SPLITS, CIFAR100_META)
    if not all((folder / name).is_file() for name in names):
        _download(root, folder, "CIFAR100", download)
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise DataError(f"data.root: {root} has no {missing[0]} in {folder} after download")
    fine_names, coarse_names = _label_names(folder / CIFAR100_META)
    classes = (len(fine_names), len(coarse_names))
    splits = {split: _read_split(folder / split, *classes) for split in CIFAR100_SPLITS}
    _check_one_coarse_label_each(folder, fine_names, splits)
    (train_x, train_y, train_coarse), (test_x, test_y, _) = splits["train"], splits["test"]
    return Dataset(
        train_x=_images(train_x),
        train_y=torch.from_numpy(train_y),
        test_x=_images(test_x),
        test_y=torch.from_numpy(test_y),
        num_classes=len(fine_names),
        coarse_labels=torch.from_numpy(train_coarse),
    )


def _read(path: Path, entries: tuple[str, ...]) -> dict:
    """The dict a CIFAR-100 file holds, unpickled as torchvision does (Python 2's strings as
    latin-1) but refusing any callable but numpy's array rebuilders; refused unless it has ``entries``."""
    try:
        with open(path, "rb") as f:
            entry = _ArraysOnly(f, encoding="latin1").load()
    except Exception as e:  # a damaged pickle: the unpickler and numpy each raise their own
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"{path}: cannot read this CIFAR-100 file ({type(e).__name__}: {first_line})") from None
    if not isinstance(entry, dict):
        raise DataError(f"{path}: not a CIFAR-100 file (holds a {type(entry).__name__}, expected a dict)")
    missing = [key for key in entries if key not in entry]
    if missing:
        raise DataError(f"{path}: not a CIFAR-100 file (no {missing[0]!r} entry; expected {', '.join(entries)})")
    return entry


def _label_names(path: Path) -> list[list[str]]:
    """The fine and the coarse label names of ``meta``."""
    meta = _read(path, ("fine_label_names", "coarse_label_names"))
    for key in ("fine_label_names", "coarse_label_names"):
        names = meta[key]
        if not (isinstance(names, list) and names and all(isinstance(name, str) for name in names)):
            raise DataError(f"{path}: expected {key} to be a list of names; got {cut(repr(names))}")
    return [meta["fine_label_names"], meta["coarse_label_names"]]


def _read_split(path: Path, fine_classes: int, coarse_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 images [N, 3, 32, 32], int64 fine labels [N] and int64 coarse labels [N]."""
    entry = _read(path, ("data", "fine_labels", "coarse_labels"))
    data = entry["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: expected 'data' of uint8 [N, 3072] (rows of 32x32 red, green, blue); got {got}")
    if not len(data):
        raise DataError(
            f"{path}: holds no images ('data' is uint8 [0, 3072]); CIFAR-100's train has 50,000, its test 10,000"
        )
    labels = []
    for key, classes in (("fine_labels", fine_classes), ("coarse_labels", coarse_classes)):
        try:
            values = np.asarray(entry[key])
        except ValueError:  # a ragged list
            values = np.asarray(None)
        if values.shape != (len(data),) or values.dtype.kind not in "iu":
            raise DataError(
                f"{path}: expected {len(data)} integer {key}, one per image; got {values.dtype} {values.shape}"
            )
        if values.size and not 0 <= values.min() <= values.max() < classes:
            raise DataError(
                f"{path}: {key} outside 0..{classes - 1}, the {classes} names of {CIFAR100_META} "
                f"(they span {values.min()}..{values.max()})"
            )
        labels.append(values.astype(np.int64))
    return data.reshape(-1, 3, 32, 32), labels[0], labels[1]


def _check_one_coarse_label_each(folder: Path, fine_names: list, splits: dict) -> None:
    fine = np.concatenate([fine for _, fine, _ in splits.values()])
    coarse = np.concatenate([coarse for _, _, coarse in splits.values()])
    pairs = np.unique(np.stack([fine, coarse]), axis=1)  # the distinct (fine, coarse) pairs, by fine label
    twice = np.flatnonzero(np.diff(pairs[0]) == 0)
    if len(twice):
        label, (first, second) = pairs[0, twice[0]], pairs[1, twice[0] : twice[0] + 2]
        raise DataError(
            f"{folder}: fine label {label} ({fine_names[label]}) has samples under coarse labels {first} and "
            f"{second}; each fine label belongs to one superclass"
        )


def _images(pixels: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(pixels).to(torch.float32).div_(255.0)
    mean, std = torch.tensor(CIFAR100_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR100_STD).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std)
