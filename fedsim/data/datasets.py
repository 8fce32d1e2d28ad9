"""Datasets as whole tensors: images normalized once, labels as int64.

Each loader returns a :class:`Dataset` of CPU tensors; the server moves it to the device
once and shares it with every worker, so no sample passes through Python on the hot path.
"""

from __future__ import annotations

import contextlib
import gzip
import inspect
import math
import pickle
import zlib
from pathlib import Path

import numpy as np
import torch

from ..core.errors import ConfigError, DataError, user_code
from ..core.registry import Registry, is_import_path, load_attr, registered
from .hub import PREFIX as HUB
from .hub import load_hub
from .leaf_plays import TRAIN_FRACTION, plays_folder
from .tensors import Dataset, checked
from .text import BYTES, Tokenizer, load_hub_text, load_tokenizer, plays_text

DATASETS = Registry("dataset")

# Every class is at least one coordinate of the model (a row or a bias of its output layer), and a
# run's messages index the model's coordinates by int32 (top-k's, fl/compression.py). Real counts
# lie far below: ImageNet-21k's 21,841 classes, language models' vocabularies of 50k to 262k.
MAX_CLASSES = 2**31 - 1
_WHY = "each class is a coordinate of the model, and messages index coordinates by int32"


def from_tensors(
    train_x: torch.Tensor | np.ndarray,
    train_y: torch.Tensor | np.ndarray,
    test_x: torch.Tensor | np.ndarray,
    test_y: torch.Tensor | np.ndarray,
    num_classes: object = None,
    name: str = "tensors",
) -> Dataset:
    """A dataset of your own, from tensors or numpy arrays: inputs ``[N, ...]`` (made float32,
    used as they are: normalize them first) and integer labels ``[N]``. ``num_classes``
    defaults to the largest label plus one. Refused in one line if the shapes, the labels or
    the values do not fit."""
    where = f"data.dataset ({name})"
    parts = {}
    for key, value in (("train_x", train_x), ("train_y", train_y), ("test_x", test_x), ("test_y", test_y)):
        try:
            parts[key] = torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"{where}: {key} is not an array ({e})") from None
    for split in ("train", "test"):
        x = parts[f"{split}_x"]
        if not (x.is_floating_point() or x.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)):
            raise DataError(f"{where}: {split}_x must hold numbers, got {x.dtype}")
    labels = (parts["train_y"], parts["test_y"])
    if num_classes is None and all(y.numel() and not (y.is_floating_point() or y.is_complex()) for y in labels):
        num_classes = int(max(y.max() for y in labels)) + 1
    # shapes, label types and ranges: the one check every dataset passes (an unknown count here
    # is only left where those checks refuse the labels first)
    data = checked(
        Dataset(*(parts[key] for key in _TENSOR_KEYS), num_classes if num_classes is not None else 0, name), where
    )
    if data.num_classes > MAX_CLASSES:  # before a model or a per-class table is sized by it
        raise DataError(f"{where}: num_classes is {data.num_classes:,}; at most {MAX_CLASSES:,} (2**31 - 1: {_WHY})")
    train_x, test_x = data.train_x.to(torch.float32), data.test_x.to(torch.float32)
    if not (torch.isfinite(train_x).all() and torch.isfinite(test_x).all()):
        raise DataError(f"{where}: the inputs hold NaN or Inf")
    train_y, test_y = data.train_y.to(torch.int64), data.test_y.to(torch.int64)
    return Dataset(train_x.contiguous(), train_y, test_x.contiguous(), test_y, data.num_classes, name)


_TENSOR_KEYS = ("train_x", "train_y", "test_x", "test_y")


def _from_file(path: Path) -> Dataset:
    """A .pt (torch.save of a dict) or .npz file holding train_x, train_y, test_x, test_y and
    optionally num_classes. Read without unpickling code (weights_only, allow_pickle=False)."""
    if not path.is_file():
        raise DataError(f"data.dataset: {path}: no such file")
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
        else:
            arrays = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # a damaged file: zipfile, pickle and numpy each raise their own
        raise DataError(
            f"{path}: cannot read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not isinstance(arrays, dict) or not set(_TENSOR_KEYS) <= set(arrays):
        found = ", ".join(sorted(map(str, arrays))) if isinstance(arrays, dict) else type(arrays).__name__
        raise DataError(f"{path}: expected the arrays {', '.join(_TENSOR_KEYS)}; found {found}")
    classes = arrays.get("num_classes")  # checked by from_tensors: int() would round 10.5 silently
    return from_tensors(*(arrays[key] for key in _TENSOR_KEYS), num_classes=classes, name=str(path))


def check_dataset_spec(spec: object) -> None:
    """What can be checked of ``data.dataset`` before loading: a known name, a .pt / .npz file
    that exists, an importable path, a Hugging Face dataset (``hf:<name or path>``), or a Dataset."""

    if isinstance(spec, Dataset):
        return
    if not isinstance(spec, str):
        raise ConfigError(
            f"data.dataset: {type(spec).__name__} is not a dataset; from Python give "
            f"fedsim.data.from_tensors(train_x, train_y, test_x, test_y)"
        )
    if spec.startswith(HUB):  # before the import paths, whose colon "hf:name" has
        return  # checked with data.hf, by hub.check_hub_options
    if spec.endswith((".pt", ".npz")):
        if not Path(spec).is_file():
            raise ConfigError(f"data.dataset: {spec}: no such file")
    elif is_import_path(spec):
        if not callable(load_attr("data.dataset", spec)):
            raise ConfigError(f"data.dataset: {spec} is not a function returning a Dataset")
    else:
        registered("data.dataset", DATASETS, spec)


def load_dataset(
    spec: str | Dataset,
    root: str | Path,
    limit: int | None = None,
    download: bool = True,
    hf: dict | None = None,
    tokenizer: str = BYTES,
    sequence_length: int = 128,
) -> Dataset:
    """The dataset ``spec`` names: a registered name (read from ``root``, downloaded there
    unless ``download`` is False), a .pt / .npz file, an import path of a function that returns
    a Dataset, a Hugging Face dataset (``hf:<name or path>``, with the columns and splits of
    ``hf``), or a Dataset. ``limit`` keeps only the first N training samples. Text datasets
    (see :func:`_text_options`, and ``hf`` with a ``text`` column) are tokenized by
    ``tokenizer`` (``data.tokenizer``) into sequences of ``sequence_length`` tokens."""

    if isinstance(spec, Dataset):
        data = spec
    elif spec.startswith(HUB) and isinstance(hf, dict) and "text" in hf:
        data = load_hub_text(spec, hf, load_tokenizer(tokenizer), sequence_length)
    elif spec.startswith(HUB):
        data = load_hub(spec, hf, Path(root))
    elif spec.endswith((".pt", ".npz")):
        data = _from_file(Path(spec))
    elif is_import_path(spec):
        load = load_attr("data.dataset", spec)
        text = _text_options(load, tokenizer, sequence_length)
        with user_code(f"data.dataset: {spec} failed", DataError):
            data = load(**text)
        if not isinstance(data, Dataset):
            raise DataError(
                f"data.dataset: {spec} returned a {type(data).__name__}, not a Dataset "
                f"(build one with fedsim.data.from_tensors)"
            )
    else:
        load = DATASETS.get(spec)
        data = load(Path(root), download, **_text_options(load, tokenizer, sequence_length))
        data.name = spec
    # every dataset passes here: metadata it cannot have is refused now, before a model or worker exists
    data = checked(data, f"data.dataset ({data.name if isinstance(spec, Dataset) else spec})")
    if limit is not None:
        if limit > len(data.train_y):
            raise DataError(
                f"data.limit: {limit} is more than the {len(data.train_y)} training samples of "
                f"{data.name if isinstance(spec, Dataset) else spec}"
            )
        data = data.head(limit)
    return data


def _text_options(load: object, tokenizer: str, sequence_length: int) -> dict:
    """What a text dataset is given: a dataset function that declares the keywords ``tokenizer``
    and ``sequence_length`` gets the Tokenizer ``data.tokenizer`` names (text.py) and the
    sequences' length; any other is called as before, without them."""
    try:
        parameters = inspect.signature(load).parameters
    except (TypeError, ValueError):  # a callable without a signature to read: no text dataset
        return {}
    if "tokenizer" not in parameters:
        return {}
    return {"tokenizer": load_tokenizer(tokenizer), "sequence_length": sequence_length}


# ----------------------------------------------------------------------------- MNIST family

_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt archive
        raise _corrupt(path, f"{type(e).__name__}: {e}") from None
    magic = int.from_bytes(raw[:4], "big")
    if len(raw) < 4 or magic >> 8 != 0x08:  # 0x08 = unsigned byte, the only type these datasets use
        raise _corrupt(path, f"not an IDX file of unsigned bytes (magic {magic:#x})")
    ndim = magic & 0xFF
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) != 4 + 4 * ndim + math.prod(shape):
        raise _corrupt(path, f"{len(raw):,} bytes where its header promises {4 + 4 * ndim + math.prod(shape):,}")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _corrupt(path: Path, reason: str) -> DataError:
    return DataError(
        f"{path}: truncated or corrupt ({reason}); delete it to download it again, or set "
        f"data.root (FEDSIM_DATA) to a folder with a good copy"
    )


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _mnist_like(root: Path, download: bool, folder: str, torchvision_name: str, mean: float, std: float) -> Dataset:
    """Read the torchvision layout ``root/<folder>/raw``; download there if it is missing.

    The archives are parsed directly, so a read-only copy of the verified ``.gz`` files works.
    """
    raw = root / folder / "raw"
    paths = {key: _find_idx(raw, stem) for key, stem in _IDX_FILES.items()}
    if None in paths.values():
        _download(root, raw, torchvision_name, download)
        paths = {key: _find_idx(raw, stem) for key, stem in _IDX_FILES.items()}
        if None in paths.values():
            raise DataError(f"data.root: {root} has no {folder} files in {raw} after download")
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise _corrupt(
                paths[f"{split}_x"], f"{images.shape} images for {labels.shape} labels of {paths[f'{split}_y'].name}"
            )
        if labels.size and labels.max() > 9:
            raise _corrupt(paths[f"{split}_y"], f"label {labels.max()} outside the 10 classes")

    def images(a):  # in place: one float copy of the images, not four (the same numbers, bit for bit)
        return torch.from_numpy(a.astype(np.float32)).unsqueeze(1).div_(255.0).sub_(mean).div_(std)

    return Dataset(
        train_x=images(arrays["train_x"]),
        train_y=torch.from_numpy(arrays["train_y"].astype(np.int64)),
        test_x=images(arrays["test_x"]),
        test_y=torch.from_numpy(arrays["test_y"].astype(np.int64)),
        num_classes=10,
    )


def _download(root: Path, files: Path, torchvision_name: str, allowed: bool) -> None:
    """Fetch a torchvision dataset into ``root``; ``files`` is where its files should then be."""
    if not allowed:
        raise DataError(
            f"data.root: no {torchvision_name} files in {files} (data.download is false); "
            f"set data.root or FEDSIM_DATA to a folder that holds them",
            missing=True,
        )
    import torchvision

    cls = getattr(torchvision.datasets, torchvision_name)
    created = [p for p in (files, *files.parents) if not p.exists()]
    try:
        root.mkdir(parents=True, exist_ok=True)
        for train in (True, False):
            cls(str(root), train=train, download=True)
    except Exception as e:  # no network, a read-only root, a failed checksum
        for folder in created:  # deepest first; leave nothing behind but what was fetched
            with contextlib.suppress(OSError):
                folder.rmdir()
        lines = [line.strip("<> ") for line in str(e).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(e).__name__  # torchvision puts the cause last
        raise DataError(
            f"data.root: no {torchvision_name} files in {files} and the download failed ({reason}); "
            f"set data.root or FEDSIM_DATA to a folder that holds them",
            missing=True,
        ) from None


@DATASETS.register("mnist", "MNIST digits: 60,000 train / 10,000 test, 1x28x28, 10 classes")
def mnist(root: Path, download: bool = True) -> Dataset:
    return _mnist_like(root, download, "MNIST", "MNIST", mean=0.1307, std=0.3081)


@DATASETS.register("fashion_mnist", "Fashion-MNIST clothing: 60,000 train / 10,000 test, 1x28x28, 10 classes")
def fashion_mnist(root: Path, download: bool = True) -> Dataset:
    return _mnist_like(root, download, "FashionMNIST", "FashionMNIST", mean=0.2860, std=0.3530)


# ----------------------------------------------------------------------------- CIFAR-10

CIFAR10_FOLDER = "cifar-10-batches-py"  # torchvision's layout: the python-version archive, extracted
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_META = "batches.meta"
# channel means and standard deviations of the 50,000 training images (pixels scaled to [0, 1])
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


class _ArraysOnly(pickle.Unpickler):
    """Unpickles dicts, lists, strings, numbers and numpy arrays, and refuses anything else: a
    pickle can name any callable to run while it loads, and a dataset file may come from anyone."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks to load {module}.{name}, which a dataset file has no need of")


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            entry = _ArraysOnly(f, encoding="latin1").load()  # the batches were pickled by Python 2
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise DataError(f"{path}: cannot read this CIFAR-10 file ({type(e).__name__}: {e})") from None
    if not isinstance(entry, dict):
        raise DataError(f"{path}: not a CIFAR-10 file (holds a {type(entry).__name__}, expected a dict)")
    return entry


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled CIFAR batch: uint8 images [N, 3, 32, 32] and int64 labels [N]."""
    entry = _unpickle(path)
    if "data" not in entry or "labels" not in entry:
        raise DataError(f"{path}: not a CIFAR-10 batch (no 'data' and 'labels' entries)")
    data, labels = np.asarray(entry["data"], dtype=np.uint8), np.asarray(entry["labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise DataError(f"{path}: expected {len(labels)} rows of 3072 pixels, got data of shape {data.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_images(pixels: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(pixels).to(torch.float32).div_(255.0)
    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std)


@DATASETS.register("cifar10", "CIFAR-10 colour images: 50,000 train / 10,000 test, 3x32x32, 10 classes")
def cifar10(root: Path, download: bool = True) -> Dataset:
    """Read the pickled batches of ``root/cifar-10-batches-py`` directly, so a read-only copy
    works; download there if a file is missing."""
    folder = root / CIFAR10_FOLDER
    names = (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH, CIFAR10_META)
    if not all((folder / name).is_file() for name in names):
        _download(root, folder, "CIFAR10", download)
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise DataError(f"data.root: {root} has no {missing[0]} in {folder} after download")
    class_names = _unpickle(folder / CIFAR10_META).get("label_names")
    if not class_names:
        raise DataError(f"{folder / CIFAR10_META}: no 'label_names' entry")
    train = [read_cifar_batch(folder / name) for name in CIFAR10_TRAIN_BATCHES]
    test_x, test_y = read_cifar_batch(folder / CIFAR10_TEST_BATCH)
    train_y = np.concatenate([labels for _, labels in train])
    for labels in (train_y, test_y):
        if labels.size and not 0 <= labels.min() <= labels.max() < len(class_names):
            raise DataError(f"{folder}: labels outside 0..{len(class_names) - 1}, the classes of {CIFAR10_META}")
    return Dataset(
        train_x=_cifar_images(np.concatenate([pixels for pixels, _ in train])),
        train_y=torch.from_numpy(train_y),
        test_x=_cifar_images(test_x),
        test_y=torch.from_numpy(test_y),
        num_classes=len(class_names),
    )


# ----------------------------------------------------------------------------- text


@DATASETS.register(
    "shakespeare_text",
    "Shakespeare's plays (root/shakespeare/texts/*.txt) as running text, one client per role: sequences of "
    "data.sequence_length tokens of data.tokenizer, each token's target the next",
)
def shakespeare_text(
    root: Path,
    download: bool = True,
    *,
    tokenizer: Tokenizer,
    sequence_length: int = 128,
    train_fraction: float = TRAIN_FRACTION,
) -> Dataset:
    """The roles of shakespeare_plays (LEAF's, read from the same texts) as a language-modelling
    task: each role's text tokenized and cut into sequences, its first 90 % of them to train and
    the rest to test, in the order spoken (text.py's ``plays_text``)."""
    return plays_text(plays_folder(root, "shakespeare_text"), tokenizer, sequence_length, train_fraction)


# ----------------------------------------------------------------------------- synthetic


@DATASETS.register("synthetic", "generated 1x28x28 images of 10 classes, stroke templates plus noise (no files needed)")
def synthetic(root: Path, download: bool = True, num_train: int = 6000, num_test: int = 1000, seed: int = 0) -> Dataset:
    """Ten class templates of three random strokes each, like digits drawn with a ruler; every
    image is its class's template moved by up to a pixel each way, plus Gaussian pixel noise.

    Shape-compatible with MNIST, so every MNIST model runs on it. The label is what the image
    shows, so a model learns it the way it learns digits: ``mnist_seed`` on it climbs from about
    30 % after its first round to over 80 % after its third. The same ``seed`` gives the same
    tensors.
    """
    g = torch.Generator().manual_seed(seed)
    starts, ends = (4 + 20 * torch.rand(10, 3, 2, generator=g) for _ in range(2))
    templates = _strokes(starts, ends, width=1.2)
    moves = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    moved = torch.stack([torch.roll(templates, move, dims=(2, 3)) for move in moves], dim=1)  # [10, 9, 1, 28, 28]

    def sample(n):
        y = torch.randint(0, 10, (n,), generator=g)
        x = moved[y, torch.randint(0, len(moves), (n,), generator=g)]
        return x + 0.1 * torch.randn(x.shape, generator=g), y

    train_x, train_y = sample(num_train)
    test_x, test_y = sample(num_test)
    mean, std = train_x.mean(), train_x.std()
    return Dataset((train_x - mean) / std, train_y, (test_x - mean) / std, test_y, num_classes=10)


def _strokes(starts: torch.Tensor, ends: torch.Tensor, width: float) -> torch.Tensor:
    """[C, 1, 28, 28] images, 1 within ``width`` pixels of one of each class's line segments
    ``starts[c, s]`` -> ``ends[c, s]`` ([C, S, 2] pixel coordinates), else 0."""
    grid = torch.stack(torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij"), -1).view(1, 1, -1, 2)
    along = (ends - starts)[:, :, None]  # [C, S, 1, 2]
    offset = grid - starts[:, :, None]  # [C, S, 784, 2]
    t = ((offset * along).sum(-1) / (along * along).sum(-1)).clamp(0, 1)  # the nearest point of each segment
    distance = (offset - t[..., None] * along).norm(dim=-1).min(dim=1).values  # [C, 784]
    return (distance < width).float().view(-1, 1, 28, 28)
