"""Seeing a split: per-client counts, a client x class heat map (text data: sequences and scored
tokens per client), a one-paragraph summary.

``write_report`` loads the data and splits it exactly as a run does, so what it shows is what
the clients of that experiment train on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..core.errors import write_error
from ..core.files import atomic_write_text, write_atomically
from .partition import options_for
from .tensors import IGNORE_INDEX

_ANNOTATE_UP_TO = 200  # cells; beyond this, numbers in the cells become unreadable


def partition_stats(
    parts: Sequence[torch.Tensor | np.ndarray], labels: torch.Tensor | np.ndarray, num_classes: int
) -> dict:
    """Per-client sample counts and per-class counts (``class_counts[client][class]``)."""
    labels = np.asarray(labels.cpu() if hasattr(labels, "cpu") else labels)
    counts = np.stack(
        [np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=num_classes) for p in parts]
    ).astype(np.int64)
    return {
        "num_clients": len(parts),
        "num_classes": num_classes,
        "samples": counts.sum(axis=1).tolist(),
        "class_counts": counts.tolist(),
    }


def summary_text(stats: dict) -> str:
    """One paragraph: client sizes (min / median / max) and how many classes a client holds."""
    counts = np.asarray(stats["class_counts"]).reshape(stats["num_clients"], stats["num_classes"])
    sizes, held = counts.sum(axis=1), (counts > 0).sum(axis=1)
    text = (
        f"{stats['num_clients']} clients hold {sizes.sum():,} samples of {stats['num_classes']} classes; "
        f"client sizes: {_spread(sizes)}; "
        f"a client holds {held.mean():.2f} classes on average (min {held.min()}, max {held.max()})."
    )
    return text + _refused(sizes, "samples")


def token_stats(parts: Sequence[torch.Tensor | np.ndarray], targets: torch.Tensor) -> dict:
    """Text data's counts: per-client sequences (``samples``) and scored tokens (``tokens``: the
    targets that are not IGNORE_INDEX), where classification data has a label mix."""
    scored = np.asarray((targets != IGNORE_INDEX).sum(dim=1).cpu())  # of each sequence
    return {
        "num_clients": len(parts),
        "samples": [len(p) for p in parts],
        "tokens": [int(scored[np.asarray(p, dtype=np.int64)].sum()) for p in parts],
    }


def token_summary(stats: dict) -> str:
    """One paragraph for text data: sequences and scored tokens, with their spread over clients."""
    sizes, tokens = np.asarray(stats["samples"]), np.asarray(stats["tokens"])
    text = (
        f"{stats['num_clients']} clients hold {sizes.sum():,} sequences with {tokens.sum():,} scored tokens; "
        f"sequences a client: {_spread(sizes)}; scored tokens a client: {_spread(tokens)}."
    )
    return text + _refused(sizes, "sequences")


def _spread(values: np.ndarray) -> str:
    return f"min {values.min():,}, median {np.median(values):,.0f}, max {values.max():,}"


def _refused(sizes: np.ndarray, what: str) -> str:
    """The sentence on clients left without data, which a run refuses ('' when there are none)."""
    empty = int((sizes == 0).sum())
    return f" {empty} client{' gets' if empty == 1 else 's get'} no {what}, which a run refuses." if empty else ""


def token_figure(stats: dict, title: str) -> Figure:
    """The scored tokens of each client, a bar each (text data has no classes to map)."""
    num_clients = stats["num_clients"]
    fig = Figure(figsize=(float(np.clip(3.0 + 0.12 * num_clients, 6.4, 16.0)), 4.0), layout="constrained")
    ax = fig.subplots()
    ax.bar(np.arange(num_clients), stats["tokens"], width=0.9 if num_clients <= 50 else 1.0, color="0.55")
    ax.set(title=title, xlabel="client", ylabel="scored tokens", xlim=(-0.5, num_clients - 0.5))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=min(num_clients, 25), integer=True))
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def partition_figure(stats: dict, title: str) -> Figure:
    """Client x class heat map of sample counts, with a bar of client sizes above it.

    Clients run along the x axis, so a federation of hundreds stays readable in a wide figure;
    empty cells stay white, and a logarithmic colour scale keeps small counts visible next to
    large ones when many of them are under a hundredth of the largest.
    """
    counts = np.asarray(stats["class_counts"]).reshape(stats["num_clients"], stats["num_classes"]).T
    num_classes, num_clients = counts.shape
    width = float(np.clip(3.0 + 0.12 * num_clients, 6.4, 16.0))
    height = float(np.clip(2.2 + 0.25 * num_classes, 4.0, 10.0))
    fig = Figure(figsize=(width, height), layout="constrained")
    bar_ax, heat_ax = fig.subplots(2, 1, sharex=True, height_ratios=(1, 3))

    bar_ax.bar(np.arange(num_clients), counts.sum(axis=0), width=0.9 if num_clients <= 50 else 1.0, color="0.55")
    bar_ax.set_ylabel("samples")
    bar_ax.set_title(title)
    bar_ax.grid(True, axis="y", alpha=0.3)

    nonzero = counts[counts > 0]
    # log scale only when many cells (a tenth or more) would vanish on a linear one
    wide_range = bool(nonzero.size) and nonzero.max() > 100 * np.percentile(nonzero, 10)
    norm = LogNorm(vmin=nonzero.min(), vmax=nonzero.max()) if wide_range else None
    shown = np.ma.masked_equal(counts, 0)  # masked cells show the axes' white background
    image = heat_ax.imshow(
        shown, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm, vmin=None if wide_range else 0
    )
    heat_ax.set_xlabel("client")
    heat_ax.set_ylabel("class")
    heat_ax.xaxis.set_major_locator(MaxNLocator(nbins=min(num_clients, 25), integer=True))
    heat_ax.yaxis.set_major_locator(MaxNLocator(nbins=min(num_classes, 20), integer=True))
    heat_ax.set_xlim(-0.5, num_clients - 0.5)
    if counts.size <= _ANNOTATE_UP_TO:
        _annotate(heat_ax, counts, image)
    colorbar = fig.colorbar(image, ax=[bar_ax, heat_ax], shrink=0.75, pad=0.01)
    colorbar.set_label("samples of the class (white: none)" + (", log scale" if wide_range else ""))
    return fig


def _annotate(ax, counts: np.ndarray, image) -> None:
    """Write each non-zero count in its cell, dark on light cells and light on dark ones."""
    for row, col in zip(*np.nonzero(counts)):
        red, green, blue, _ = image.cmap(image.norm(counts[row, col]))
        colour = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"
        ax.text(col, row, f"{counts[row, col]}", ha="center", va="center", fontsize=7, color=colour)


def _json_text(report: dict) -> str:
    """JSON with one key per line and one client per line of each matrix, to read by eye."""

    def value(v):
        if isinstance(v, list) and v and isinstance(v[0], list):
            return "[\n  " + ",\n  ".join(json.dumps(row) for row in v) + "\n ]"
        return json.dumps(v)

    return "{\n" + ",\n".join(f" {json.dumps(key)}: {value(v)}" for key, v in report.items()) + "\n}\n"


def write_report(config: Any, federation: Any, out_dir: str | os.PathLike) -> dict:
    """Write ``partition.json`` and ``partition.png`` into ``out_dir`` for ``federation``, the
    data split as a run of ``config`` splits it (``experiment.federation.load_federation``).
    Returns the statistics (see :func:`partition_stats`), with the local test split's counts
    added when ``data.test_partition`` is on."""
    d = config.data
    options = options_for(d.partition, d)
    data, parts = federation.data, federation.parts
    if data.tokens:  # text: sequences and scored tokens per client, as there are no labels to count
        stats = token_stats(parts, data.train_y)
    else:
        stats = partition_stats(parts, data.train_y, data.num_classes)
    report = {
        "name": config.name,
        "dataset": data.name,
        "partition": d.partition,
        "options": options,
        "seed": federation.seed,
        "summary": token_summary(stats) if data.tokens else summary_text(stats),
        **stats,
    }
    names = federation.client_names()
    if names is not None:  # the data's own ids of the clients (which writers or roles the seed drew)
        report["client_names"] = list(names)
    if d.test_partition:
        test_parts = federation.test_parts()
        if data.tokens:
            test_stats = token_stats(test_parts, data.test_y)
            report["test_samples"], report["test_tokens"] = test_stats["samples"], test_stats["tokens"]
        else:
            test_stats = partition_stats(test_parts, data.test_y, data.num_classes)
            report["test_samples"], report["test_class_counts"] = test_stats["samples"], test_stats["class_counts"]
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(out, e) from None
    atomic_write_text(out / "partition.json", _json_text(report))
    described = ", ".join(f"{key}={value}" for key, value in sorted(options.items()))
    title = f"{config.name}: {data.name}, {d.partition}" + (f" ({described})" if described else "")
    figure = token_figure(stats, title) if data.tokens else partition_figure(stats, title)
    write_atomically(out / "partition.png", lambda tmp: figure.savefig(tmp, dpi=120, format="png"))
    return report
