"""Datasets of the Hugging Face hub, or local files the ``datasets`` library reads (``hf:``).

``data.dataset: hf:flwrlabs/femnist`` loads a hub dataset (Lhoest et al. 2021, "Datasets: A
Community Library for Natural Language Processing"); ``hf:/path/data.parquet`` or ``hf:./folder``
a local file or folder of parquet, arrow, csv or json. ``data.hf`` names the columns: ``input``
(an image column, a column of numbers or of arrays of numbers, or a list of number columns),
``label`` (integers or a ClassLabel), ``client`` (optional: each sample's own client, for
``data.partition: natural``, as Flower Datasets' NaturalIdPartitioner reads it), and the splits:
``train`` (default "train") and ``test`` (default "test"; where the data has no such split, or
with ``test: null``, ``test_fraction`` (default 0.1) of each client's samples is held out, the
same samples every time). Text data names ``text`` instead of ``input`` and ``label``: a text column,
or a template over columns, each row a document to predict token by token (text.py). The ``datasets``
package is imported only when such a dataset loads: validation stays cheap without it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import socket
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from ..core.checks import Checks, is_number
from ..core.errors import ConfigError, DataError, cut, install, shown
from .tensors import Dataset

PREFIX = "hf:"
OPTIONS = ("input", "label", "text", "client", "train", "test", "test_fraction")  # text: see text.py
DEFAULTS = {"client": None, "train": "train", "test": "test", "test_fraction": 0.1}
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
INSTALL = install("hf")
PROBE_SECONDS = 3.0  # how long the hub may take to accept a connection before it counts as out of reach
HOLDOUT_SEED = 0x6866  # the held-out test split is the data's own, the same for every run seed
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


# ----------------------------------------------------------------------------- checks before loading


def check_hub_spec(spec: str) -> None:
    """What can be checked of ``data.dataset: hf:<name or path>`` without loading it."""
    target = spec[len(PREFIX) :]
    if not target:
        raise ConfigError(f"data.dataset: {PREFIX} needs a hub name or a local path after it (hf:flwrlabs/femnist)")
    path = Path(target).expanduser()
    if path.is_file() and path.suffix not in FILE_BUILDERS:
        raise ConfigError(f"data.dataset: {spec}: a file must be one of {', '.join(FILE_BUILDERS)}")
    looks_like_path = target.startswith(("/", ".", "~")) or path.suffix in FILE_BUILDERS
    if not path.exists() and (looks_like_path or not _HUB_NAME.fullmatch(target)):
        raise ConfigError(f"data.dataset: {spec}: no such file or folder, and not a hub name (owner/name)")


def check_hub_options(spec: object, options: dict | None) -> None:
    """What can be checked of ``data.dataset: hf:...`` and ``data.hf`` before loading (called by
    the experiment's validation for every config): the name or path, the keys and the types of
    their values."""
    hub = isinstance(spec, str) and spec.startswith(PREFIX)
    if options is not None and not hub:
        raise ConfigError("data.hf: applies to data.dataset hf:<name or path> only")
    if hub:
        check_hub_spec(spec)
        parse_options(options)


def parse_options(options: object) -> dict:
    """``data.hf`` with its defaults, or one line naming the key that is wrong."""
    if options is None:
        raise ConfigError(
            "data.hf: an hf: dataset needs data.hf with at least input and label, the columns of the "
            "inputs and of the labels (e.g. {input: image, label: label}), or text, a text column or a template"
        )
    checks = Checks("data.hf")
    given = checks.mapping(options, OPTIONS)
    opts, text = {**DEFAULTS, **given}, "text" in given  # text: the inputs and the targets (text.py)
    for key in ("input", "label"):
        if (key in given) == text:
            missing = "missing: name the column of the inputs (input) and of the labels (label), or the text (text)"
            checks.fail(key, "is not taken with text (the text is the inputs and the targets)" if text else missing)
    inputs = opts.get("input")
    if not (text or _name(inputs) or (isinstance(inputs, list) and inputs and all(_name(c) for c in inputs))):
        checks.fail("input", f"must be a column name, or a list of names of number columns, got {shown(inputs)}")
    for key, optional in (("text" if text else "label", False), ("client", True), ("train", False), ("test", True)):
        if not (_name(opts[key]) or (optional and opts[key] is None)):
            checks.fail(
                key, f"must be a {'split' if key in ('train', 'test') else 'column'} name, got {shown(opts[key])}"
            )
    fraction = opts["test_fraction"]
    if not (is_number(fraction) and 0 < fraction < 1):
        checks.fail("test_fraction", f"must be a fraction in (0, 1), got {shown(fraction)}")
    return opts


def _name(value: object) -> bool:
    return isinstance(value, str) and bool(value)


# ----------------------------------------------------------------------------- reading


def load_hub(spec: str, options: dict | None, root: Path) -> Dataset:
    """The dataset ``spec`` (``hf:<name or path>``) names, with the columns of ``options``.

    ``root`` is not used: hub datasets live in the ``datasets`` library's own cache (HF_HOME,
    HF_DATASETS_CACHE), where a copy downloaded by any Hugging Face tool is found again."""
    opts = parse_options(options)
    splits = read_splits(spec, import_datasets(spec))
    train, test = pick_splits(splits, opts, spec)
    tables = [train.with_format("arrow")[:]] + ([test.with_format("arrow")[:]] if test is not None else [])
    for table, where in zip(tables, ("", f"split {opts['test']!r} of ")):
        _check_columns(table, opts, spec, where)
    column = opts["input"]
    image = isinstance(column, str) and _is_image(train.features[column], tables[0].schema.field(column).type)
    names = getattr(train.features.get(opts["label"]), "names", None)  # a ClassLabel's
    xs = _images(tables, opts["input"]) if image else [_numbers(t, opts["input"]) for t in tables]
    ys = [_labels(t, opts["label"]) for t in tables]
    owners = [column_values(t, opts["client"], "client") for t in tables] if opts["client"] else None
    if test is None:
        held = hold_out(len(ys[0]), owners[0] if owners else None, opts["test_fraction"])
        if not held.any():
            fail("test_fraction", f"holds out none of the {len(held)} samples; raise it, or give a test split")
        xs, ys = [xs[0][~held], xs[0][held]], [ys[0][~held], ys[0][held]]
        owners = [owners[0][~held], owners[0][held]] if owners else None
    if len(ys[0]) == 0 or len(ys[1]) == 0:
        fail("train" if len(ys[0]) == 0 else "test", f"the split of {spec} has no samples")
    if xs[0].shape[1:] != xs[1].shape[1:]:
        fail("input", f"train inputs have shape {xs[0].shape[1:]} and test inputs {xs[1].shape[1:]}")
    classes = _classes(ys, names, opts["label"])
    train_x, test_x = _normalize(*xs) if image else (torch.from_numpy(x.astype(np.float32)) for x in xs)
    data = Dataset(train_x, torch.from_numpy(ys[0]), test_x, torch.from_numpy(ys[1]), classes, name=spec)
    if owners:
        ids, data.client_names = client_ids(owners)
        data.train_clients, data.test_clients = (torch.from_numpy(i) for i in ids)
    return data


def import_datasets(spec: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.dataset: {spec} needs the datasets package: {INSTALL}") from None
    return datasets


def read_splits(spec: str, datasets: Any) -> Mapping[str, Any]:
    """The splits of a local file or folder, or of a hub dataset."""
    check_hub_spec(spec)
    target = spec[len(PREFIX) :]
    path = Path(target).expanduser()
    if not path.exists():
        return _read_hub(target, spec, datasets)
    try:
        with _without_progress_bars(datasets):
            if path.is_file():
                return datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path))
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # Dataset.save_to_disk
                saved = datasets.load_from_disk(str(path))
                return saved if isinstance(saved, Mapping) else {"train": saved}
            return datasets.load_dataset(str(path))
    except Exception as e:  # the library raises its own errors, pyarrow's and the parsers' for a bad file
        raise DataError(f"data.dataset: {spec}: cannot read ({failure_reason(e)})") from None


def _read_hub(name: str, spec: str, datasets: Any) -> Mapping[str, Any]:
    """A hub dataset; without network, its cached copy or one line at once, not after the
    library's retries (23 s measured). Not ``missing=True``: the command line's suggestion of
    generated data would keep data.hf, which only an hf: dataset takes."""
    offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))  # set from HF_HUB_OFFLINE or HF_DATASETS_OFFLINE
    unreachable = None if offline else hub_unreachable(datasets.config.HF_ENDPOINT)
    try:
        with _cache_only(datasets) if unreachable else contextlib.nullcontext():
            return datasets.load_dataset(name)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        if not (offline or unreachable):
            raise DataError(f"data.dataset: {spec}: cannot load it from the hub ({failure_reason(e)})") from None
        why = "HF_HUB_OFFLINE is set" if offline else f"the hub is out of reach ({unreachable})"
        raise DataError(
            f"data.dataset: {spec}: not in the Hugging Face cache and {why}; download it first "
            f"(datasets.load_dataset({name!r}) with network) or give a local path (hf:/path/to/files)"
        ) from None
    except Exception as e:
        raise DataError(f"data.dataset: {spec}: cannot load ({failure_reason(e)})") from None


def hub_unreachable(endpoint: str) -> str | None:
    """Why the hub cannot be reached, or None where it answers (or a proxy stands between)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # only the library knows how to go through the proxy
    url = urllib.parse.urlsplit(endpoint)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), timeout=PROBE_SECONDS).close()
    except (OSError, ValueError) as e:
        return f"{url.hostname}: {getattr(e, 'strerror', None) or e}"
    return None


@contextlib.contextmanager
def _cache_only(datasets: Any) -> Iterator[None]:
    """The library's offline mode for one load: both packages read these flags at each call
    (they are set from HF_HUB_OFFLINE when imported), so the cached copy loads without a request."""
    import huggingface_hub.constants as hub

    flags = [(m, f) for m, f in ((datasets.config, "HF_HUB_OFFLINE"), (hub, "HF_HUB_OFFLINE")) if hasattr(m, f)]
    saved = [getattr(m, f) for m, f in flags]
    for module, flag in flags:
        setattr(module, flag, True)
    try:
        yield
    finally:
        for (module, flag), value in zip(flags, saved):
            setattr(module, flag, value)


@contextlib.contextmanager
def _without_progress_bars(datasets: Any) -> Iterator[None]:
    """Local files are copied into the cache in a blink: their bars would only break the run's lines."""
    shown = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def failure_reason(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {cut(lines[0], 200)}" if lines else type(e).__name__


def pick_splits(splits: Mapping[str, Any], opts: dict, spec: str) -> tuple[Any, Any | None]:
    """The training split, and the test split (None: hold one out of the training split)."""
    have = ", ".join(splits) or "none"
    if opts["train"] not in splits:
        fail("train", f"{spec} has no split {opts['train']!r}; its splits: {have}")
    test = opts["test"]
    if test is not None and test not in splits and test != DEFAULTS["test"]:
        fail("test", f"{spec} has no split {test!r}; its splits: {have} (null: hold out data.hf.test_fraction)")
    if test == opts["train"]:
        fail("test", f"is the training split {test!r}; name another, or null to hold out data.hf.test_fraction")
    return splits[opts["train"]], splits.get(test)


def fail(key: str, message: str) -> NoReturn:
    raise DataError(f"data.hf.{key}: {message}")


# ----------------------------------------------------------------------------- columns


def _check_columns(table: Any, opts: dict, spec: str, where: str = "") -> None:
    inputs = opts["input"] if isinstance(opts["input"], list) else [opts["input"]]
    wanted = [("input", c) for c in inputs] + [("label", opts["label"]), ("client", opts["client"])]
    for key, column in wanted:
        if column is not None and column not in table.column_names:
            fail(key, f"no column {column!r} in {where}{spec}; its columns: {', '.join(table.column_names)}")


def _leaf_type(arrow_type: Any) -> Any:
    """The type of the numbers (or strings) inside a column's lists and arrays."""
    import pyarrow as pa

    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    while True:
        if isinstance(arrow_type, pa.ExtensionType):  # the library's Array2D .. Array5D
            arrow_type = arrow_type.storage_type
        elif any(is_list(arrow_type) for is_list in lists):
            arrow_type = arrow_type.value_type
        else:
            return arrow_type


def _is_image(feature: object, arrow_type: Any) -> bool:
    """An Image feature, or the {"bytes", "path"} struct the library stores one as."""
    import pyarrow as pa

    stored = pa.types.is_struct(arrow_type) and {"bytes", "path"} <= {field.name for field in arrow_type}
    return type(feature).__name__ == "Image" or stored


def column_values(table: Any, column: str, key: str) -> np.ndarray:
    values = table.column(column)
    if values.null_count:
        fail(key, f"column {column!r} has {values.null_count} empty values (null)")
    return values.to_numpy()


def _labels(table: Any, column: str) -> np.ndarray:
    import pyarrow as pa

    arrow_type = table.schema.field(column).type
    if not pa.types.is_integer(arrow_type):
        fail("label", f"column {column!r} holds {arrow_type}, not integer class labels")
    return column_values(table, column, "label").astype(np.int64)


def _classes(ys: list[np.ndarray], names: list | None, column: str) -> int:
    """The number of classes: a ClassLabel's names, else the largest label plus one."""
    low, high = min(int(y.min(initial=0)) for y in ys), max(int(y.max(initial=0)) for y in ys)
    classes = len(names) if names is not None else high + 1
    if low < 0 or high >= classes:
        fail("label", f"column {column!r} holds labels {low} .. {high}, outside 0 .. {classes - 1}")
    if classes < 2:
        fail("label", f"column {column!r} has {classes} class; a classifier needs at least 2")
    return classes


def _numbers(table: Any, columns: str | list[str]) -> np.ndarray:
    """A column of numbers or of same-shaped arrays of numbers ([N, ...]), or a list of number
    columns side by side ([N, k])."""
    import pyarrow as pa

    parts = []
    for column in columns if isinstance(columns, list) else [columns]:
        leaf = _leaf_type(table.schema.field(column).type)
        if pa.types.is_string(leaf) or pa.types.is_large_string(leaf):
            fail("input", f"column {column!r} holds text; for text data give data.hf.text instead of input and label")
        if not (pa.types.is_integer(leaf) or pa.types.is_floating(leaf) or pa.types.is_boolean(leaf)):
            fail("input", f"column {column!r} holds {table.schema.field(column).type}; use images or numbers")
        if isinstance(columns, list) and leaf != table.schema.field(column).type:
            fail("input", f"column {column!r} holds arrays; a list of input columns takes numbers only")
        parts.append(_stack(table.column(column), column))
    x = parts[0] if not isinstance(columns, list) else np.stack(parts, axis=1)
    x = x.reshape(len(x), -1) if x.ndim == 1 else x
    if not np.isfinite(x).all():
        fail("input", f"{', '.join(columns) if isinstance(columns, list) else columns!r} holds NaN or Inf")
    return x


def _stack(chunks: Any, column: str) -> np.ndarray:
    """An arrow column of (nested) lists as one array, its lists of one length at each depth."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = chunks.combine_chunks()
    shape = [len(array)]
    while True:
        if isinstance(array, pa.ExtensionArray):
            array = array.storage
        if array.null_count:
            fail("input", f"column {column!r} has {array.null_count} empty values (null)")
        if not isinstance(array, (pa.ListArray, pa.LargeListArray, pa.FixedSizeListArray)):
            return array.to_numpy(zero_copy_only=False).reshape(shape)
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            other = lengths[np.flatnonzero(lengths != lengths[0])[0]]
            sizes = f"{lengths[0]} and {other} values at depth {len(shape)}"
            fail("input", f"column {column!r} holds arrays of mixed shapes ({sizes}); give all samples one shape")
        shape.append(int(lengths[0]) if len(lengths) else 0)
        array = array.flatten()


# ----------------------------------------------------------------------------- images, splits, clients


def _images(tables: list[Any], column: str) -> list[np.ndarray]:
    """The images of each table as one array [N, C, H, W] of their pixel type. One mode for all:
    the images' own where they share one, else "L" for black and white and grey, else "RGB"."""
    from PIL import Image

    stored = []
    for table in tables:
        structs = table.column(column).combine_chunks()
        if structs.null_count:
            fail("input", f"column {column!r} has {structs.null_count} empty images (null)")
        stored.append(list(zip(structs.field("bytes").to_pylist(), structs.field("path").to_pylist())))
    sizes, modes = set(), set()
    for blob, path in (entry for entries in stored for entry in entries):
        with _open_image(Image, blob, path, column) as image:  # the header only: no pixels decoded yet
            sizes.add(image.size)
            modes.add(image.mode)
    if len(sizes) > 1:
        shown_sizes = " and ".join(f"{w}x{h}" for w, h in sorted(sizes)[:2]) + (", ..." if len(sizes) > 2 else "")
        fail("input", f"column {column!r} holds images of mixed sizes ({shown_sizes}); resize them to one size")
    common = next(iter(modes)) if len(modes) == 1 and modes != {"P"} else None
    target = common or ("L" if modes <= {"1", "L"} else "RGB")
    arrays = []
    for entries in stored:
        out = None
        for i, (blob, path) in enumerate(entries):
            with _open_image(Image, blob, path, column) as image:
                pixels = np.asarray(image if image.mode == target else image.convert(target))
            if out is None:
                out = np.empty((len(entries), *pixels.shape), dtype=pixels.dtype)
            out[i] = pixels
        out = np.zeros((0, 0, 0), np.uint8) if out is None else out  # no images: refused as an empty split
        out = out[..., None] if out.ndim == 3 else out  # one channel: [N, H, W] -> [N, H, W, 1]
        arrays.append(np.ascontiguousarray(out.transpose(0, 3, 1, 2)))
    return arrays


def _open_image(image_module: Any, blob: bytes | None, path: str | None, column: str) -> Any:
    if blob is None and path is None:
        fail("input", f"column {column!r} holds an empty image (neither bytes nor a path)")
    try:
        return image_module.open(io.BytesIO(blob) if blob is not None else path)
    except (OSError, ValueError, TypeError, image_module.DecompressionBombError) as e:
        fail("input", f"column {column!r} holds an image that cannot be read ({failure_reason(e)})")


def _normalize(train: np.ndarray, test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Both splits as float32, normalized by the training images' channel mean and standard
    deviation (of all their pixels, in float64, two passes; a constant channel is only centred)."""
    chunks = [train[i : i + 4096] for i in range(0, len(train), 4096)]  # views: float64 a chunk at a time
    count = train.size // train.shape[1]  # > 0: an empty split is refused before
    mean = sum(chunk.sum(axis=(0, 2, 3), dtype=np.float64) for chunk in chunks) / count
    std = np.sqrt(sum(((chunk - mean[:, None, None]) ** 2).sum(axis=(0, 2, 3)) for chunk in chunks) / count)
    std[std == 0] = 1.0
    shift = torch.from_numpy(mean).float().view(1, -1, 1, 1)
    scale = torch.from_numpy(std).float().view(1, -1, 1, 1)
    return tuple(torch.from_numpy(x).to(torch.float32).sub_(shift).div_(scale) for x in (train, test))


def hold_out(count: int, owners: np.ndarray | None, fraction: float) -> np.ndarray:
    """Which training samples become test samples: round(fraction x n) of each client's n (of
    all n without clients), at most n - 1 so that every client keeps one, drawn without
    replacement from a stream of the client's place among the sorted client names."""
    held = np.zeros(count, dtype=bool)
    if owners is None:
        groups = [np.arange(count)]
    else:
        _, inverse = np.unique(owners, return_inverse=True)
        order = np.argsort(inverse.reshape(-1), kind="stable")
        groups = np.split(order, np.cumsum(np.bincount(inverse.reshape(-1)))[:-1])
    for place, members in enumerate(groups):
        size = min(len(members) - 1, math.floor(fraction * len(members) + 0.5))
        if size > 0:
            rng = np.random.default_rng([HOLDOUT_SEED, place])
            held[rng.choice(members, size, replace=False)] = True
    return held


def client_ids(owners: list[np.ndarray]) -> tuple[list[np.ndarray], tuple[str, ...]]:
    """Each sample's client as an id into the sorted names of the clients of both splits."""
    names, inverse = np.unique(np.concatenate(owners), return_inverse=True)
    ids = inverse.reshape(-1).astype(np.int64)
    return [ids[: len(owners[0])], ids[len(owners[0]) :]], tuple(str(name) for name in names)
