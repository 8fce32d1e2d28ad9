"""Figures of per-round metrics, with matplotlib's object API (no global pyplot state).

``plot_runs`` overlays runs (History objects, run directories or glob patterns); runs that
share a label and differ only in seed become one line, their mean, with a shaded band.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from statistics import fmean, stdev

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

from ..core.errors import FedsimError, write_error
from ..core.files import write_atomically
from .history import DESCRIBED_KEYS, History, as_histories, describe_run, group_repeats, telling_apart
from .keys import RUN_SPECIFIC_KEYS, defining, flatten_config
from .rundir import COLUMNS, check_output_path

logger = logging.getLogger("fedsim")

# Okabe & Ito's palette, which stays distinct under the common colour-vision deficiencies;
# yellow comes last because it is faint on white.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#F0E442")
LINESTYLES = ("-", "--", ":", "-.")  # after the eight colours, lines differ by dash too
WIDTHS = {"single": 3.5, "double": 7.0}  # inches: one and two columns of a two-column paper
BANDS = {"minmax": "min–max", "std": "± 1 s.d."}
X_AXES = {
    "round": "round",
    "seconds": "wall time (s)",
    "epsilon": "ε (privacy spent, at privacy.delta)",
    "bytes": "MB sent, up and down, since round 1",
    "simulated_seconds": "simulated time (s)",
}
# the column of an x axis, by name
_X_COLUMNS = {"seconds": "elapsed_seconds", "bytes": "cumulative_bytes", "simulated_seconds": "simulated_time"}
_X_SCALES = {"bytes": 1e-6}  # the bytes axis reads in MB
METRICS = tuple(c for c in COLUMNS if c != "round")
SPREAD = ("client_accuracy_mean", "client_accuracy_std", "client_accuracy_p10")  # what spread=True draws
# spread=True's y axis: each client is scored with the model it uses, which the legend names per line
SPREAD_AXIS = "accuracy on each client's own test split (%)"
_HAS = {
    "epsilon": "a run with a privacy section has it",
    "cumulative_bytes": "every run counts them except in mode: hogwild, where nothing travels",
    "simulated_time": "every run keeps the simulated clock (runs resumed from an older version's checkpoint do not)",
    "test_perplexity": "a language model's run (token-level data) has it",
    **dict.fromkeys(SPREAD, "a run with eval_per_client: true and data.test_partition: true has it"),
    "clusters": "a run of a clustered algorithm (ifca, cfl) has it",
}


def plot_runs(
    runs: History | str | os.PathLike | Iterable[History | str | os.PathLike],
    *,
    metric: str | None = None,
    x: str = "round",
    label: str | None = None,
    loss: bool = False,
    band: str = "minmax",
    width: str | float = "double",
    title: str | None = None,
    spread: bool = False,
    facet: str | None = None,
) -> Figure:
    """A figure of ``metric`` per round for each run, overlaid: by default test accuracy; for language
    models' runs (History.tokens) test loss, with the perplexity (its exp) on a right-hand log axis.

    ``runs``: History objects, run directories or glob patterns (mixed freely). ``label``: a
    config key (dotted for sections, e.g. ``"data.alpha"``) whose value names each line in
    the legend; by default the run name. Runs with the same label whose configs differ only
    in seed (and other run-specific keys such as workers and device) are drawn as their mean
    with a band: ``"minmax"`` shades min to max, ``"std"`` mean ± one sample standard
    deviation. ``x``: ``"round"``, ``"seconds"`` (wall time since the start of the run),
    ``"epsilon"`` (the privacy spent, for runs with a privacy section), ``"bytes"`` (the
    megabytes sent up and down since round 1, ``cumulative_bytes``) or ``"simulated_seconds"``
    (the simulated clock of system.py and mode: async, ``simulated_time``). ``loss``: add a panel of
    test loss below (language models' runs drawn by loss: of token accuracy). ``width``:
    ``"single"`` (3.5 in), ``"double"`` (7 in) or inches.

    ``spread``: draw each client's accuracy on its own test split with the model it uses (runs with
    eval_per_client): the global model for FedAvg and every algorithm without a model of the
    client's own, the client's own model for a personal algorithm (Ditto, FedPer, FedProto, IFCA,
    ...), which the legend says beside each line's name; the mean over the clients as the line, ±
    one standard deviation over the clients as a band, and their 10th percentile (the worst tenth)
    dashed; runs that differ only in seed are averaged.

    ``facet``: a config key (e.g. ``"attack.type"``): one panel per value, side by side (three to a
    row), sharing the y axis; a line keeps its colour in every panel. The bands grow lighter as more
    lines share a panel.
    """
    histories = as_histories(runs, "to plot")
    metrics, inches, tokens = _checked_options(histories, metric, x, band, spread, width, loss)
    for option, key in (("label", label), ("facet", facet)):
        for history in histories if key is not None else ():
            try:
                history.config_value(key)
            except FedsimError as unknown:  # "KEY: not a config key of run ...", said of the option
                raise FedsimError(f"{option} {unknown}") from None
    distinguish = ("name",) if label is None else (label,)
    panels = _facets(histories, facet)
    groups = group_repeats(histories, (*distinguish, *([facet] if facet else [])))
    # each panel's lines, named within the panel; a name keeps its colour in every panel
    lines = []
    for _, members in panels:
        inside = [g for g in groups if any(g[0] is m for m in members)]
        labels = _labels(inside, label)
        if spread:  # a FedAvg line and a personal one scored different models on the same splits
            labels = [text + _scored_with(group) for group, text in zip(inside, labels)]
        lines.append(list(zip(inside, labels)))
    names = list(dict.fromkeys(name for panel in lines for _, name in panel))
    repeated = [g for panel in lines for g, _ in panel]
    legend = _legend_texts(repeated, names, band, spread, _ends(repeated, x))
    columns = _legend_columns(legend, inches)
    shading = _shading(max(len(panel) for panel in lines))
    with matplotlib.rc_context(_style(inches)):
        across = min(len(panels), 3 if inches >= 5 else 2)
        down = math.ceil(len(panels) / across)
        panel_height = 2.0 + 0.18 * inches / across  # wide panels get flatter, as in a paper's full-width figures
        height = (
            down * panel_height * (1.55 if loss else 1)
            + _legend_height(legend, columns, label)
            + 0.3 * (facet is not None)
        )
        fig = Figure(figsize=(inches, height), layout="constrained")
        grid = fig.subplots(down * len(metrics), across, sharex=True, sharey="row", squeeze=False)
        handles: dict[str, object] = {}  # by hand: matplotlib leaves out labels that start with "_" (__main__:my_rule)
        for index, ((value, _), panel_lines) in enumerate(zip(panels, lines)):
            row, column = divmod(index, across)
            axes = grid[row * len(metrics) : (row + 1) * len(metrics), column]
            for group, name in panel_lines:
                i = names.index(name)
                style = {
                    "color": PALETTE[i % len(PALETTE)],
                    "linestyle": LINESTYLES[i // len(PALETTE) % len(LINESTYLES)],
                }
                drawn = [
                    _draw_spread(ax, group, x, style, name)
                    if spread and col == SPREAD[0]
                    else _draw(ax, group, col, x, band, style, name, shading)
                    for ax, col in zip(axes, metrics)
                ]
                handles.setdefault(name, drawn[0])
            _label_axes(axes, metrics, x, spread, tokens, ylabels=column == 0)
            if facet is not None:
                axes[0].set_title(f"{facet}={_format(value)}")
        for index in range(len(panels), down * across):  # the empty places of the last row
            row, column = divmod(index, across)
            for ax in grid[row * len(metrics) : (row + 1) * len(metrics), column]:
                ax.set_visible(False)
        text = title if title is not None else _default_title(histories, metrics[0], x, tokens)
        if facet is None:
            grid[0, 0].set_title(text)
        else:
            fig.suptitle(text, fontsize=_font_size(inches) + 1)
        if legend:
            _add_legend(fig, [handles[name] for name in names], legend, label, columns, shading)
    return fig


def _facets(histories: list[History], facet: str | None) -> list[tuple[object, list[History]]]:
    """``(value, runs)`` for each value of the config key ``facet``: numbers in order, other values
    in the order of their first run; one panel of every run without a facet."""
    if facet is None:
        return [(None, histories)]
    values = [h.config_value(facet) for h in histories]
    distinct = list(dict.fromkeys(repr(v) for v in values))
    first = {repr(v): v for v in reversed(values)}
    if all(isinstance(first[d], (int, float)) and not isinstance(first[d], bool) for d in distinct):
        distinct.sort(key=lambda d: first[d])
    return [(first[d], [h for h, v in zip(histories, values) if repr(v) == d]) for d in distinct]


def _shading(lines: int) -> float:
    """The bands' opacity: lighter as more lines share a panel, so that the lines stay readable."""
    return max(0.06, 0.2 * min(1.0, 4 / max(lines, 1)))


def _add_legend(
    fig: Figure, handles: list, legend: list[str], label: str | None, columns: int, shading: float = 0.2
) -> None:
    """The lines' entries, then the band's and the spread's dashes where the legend names them."""
    keys = [
        Patch(color="0.5", alpha=min(1.0, 1.75 * shading), linewidth=0),
        Line2D([], [], color="0.4", linestyle="--", linewidth=1),
    ]
    handles = handles + keys[: len(legend) - len(handles)]
    fig.legend(handles, legend, title=label, loc="outside lower center", ncols=columns, frameon=False)


def _label_axes(axes, metrics: list[str], x: str, spread: bool, tokens: bool, ylabels: bool = True) -> None:
    for ax, column in zip(axes, metrics):
        if ylabels:
            ax.set_ylabel(SPREAD_AXIS if spread and column == SPREAD[0] else _axis_label(column, tokens))
        ax.grid(True, alpha=0.3, linewidth=0.6)
        if column == "clusters":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if column == "test_perplexity":  # it grows exponentially with the loss
            ax.set_yscale("log")
        elif column == "test_loss" and tokens:  # perplexity = exp(loss): the same curve, read on the right
            side = ax.secondary_yaxis("right", functions=(_exp, _log))
            side.set_ylabel("test perplexity (log scale)")
            low, high = _exp(np.array(ax.get_ylim()))  # a narrow span may hold no 1-2-5 decade tick
            side.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)) if high > 4 * low else MaxNLocator(5))
            side.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes[-1].set_xlabel(X_AXES[x])
    if x == "round":
        # min_n_ticks=1: a run evaluated in one or two rounds still gets whole rounds, not 2.85 ... 3.15
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10], min_n_ticks=1))


def _exp(loss):
    return np.exp(np.minimum(loss, 700.0))  # beyond it a float64 overflows


def _log(perplexity):
    return np.log(np.maximum(perplexity, 1e-300))


def _checked_options(
    histories, metric: str | None, x: str, band: str, spread: bool, width, loss: bool
) -> tuple[list[str], float, bool]:
    """plot_runs' options checked against each other and the runs: the metrics of its panels (with
    ``spread``, the clients' mean accuracy; by default, test loss for language models' runs), the
    figure's width in inches, and whether every run is a language model's."""
    tokens = all(h.tokens for h in histories)
    metric = metric or ("test_loss" if tokens and not spread else "test_accuracy")
    _check_choice("metric", metric, METRICS)
    _check_choice("x", x, X_AXES)
    _check_choice("band", band, BANDS)
    if spread:
        if metric not in ("test_accuracy", SPREAD[0]):
            raise FedsimError(f"spread: draws the clients' accuracy; it does not combine with metric {metric}")
        metric = SPREAD[0]
    axis = [_X_COLUMNS.get(x, x)] if x in ("epsilon", "bytes", "simulated_seconds") else []
    _check_has(histories, [*(SPREAD if spread else [metric]), *axis])
    inches = WIDTHS.get(width, width)
    if not isinstance(inches, (int, float)) or not 0.5 <= inches <= 50:
        raise FedsimError(f"width: {width!r} is not 'single', 'double' or a width from 0.5 to 50 inches")
    below = "test_accuracy" if tokens and metric in ("test_loss", "test_perplexity") else "test_loss"
    return [metric, below] if loss else [metric], inches, tokens


def save_figure(fig: Figure, path: str | os.PathLike, pdf: bool = False) -> list[Path]:
    """Save as PNG or PDF by the suffix of ``path``; ``pdf=True`` also writes a PDF beside a PNG."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".png", ".pdf"):
        raise FedsimError(f"{path}: the file name must end in .png or .pdf")
    paths = [path, path.with_suffix(".pdf")] if pdf and suffix == ".png" else [path]
    check_output_path(path.parent, "-o")
    for target in paths:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(target.parent, e, "choose another file with -o") from None
        # 300 dpi is print resolution; a PDF keeps lines and text as vectors
        save = functools.partial(fig.savefig, dpi=300, format=target.suffix[1:].lower())
        write_atomically(target, save, "choose another file with -o")
    return paths


def save_accuracy_plot(history: History, path: Path) -> None:
    """The accuracy.png of a run directory (see accuracy_figure), at 300 dpi as ``fedsim plot``."""
    figure = accuracy_figure(history)
    write_atomically(path, lambda tmp: figure.savefig(tmp, dpi=300, format="png"))


def accuracy_figure(history: History) -> Figure:
    """A run's test accuracy per round. The title says what ran (see _default_title), and the y
    axis reaches down to chance, 1 / num_classes (from summary.json), marked by a dotted line,
    and spans at least 20 points: a run that learns nothing reads as flat, not as a zoomed-in
    wiggle. A run that scored personal models (see History.personal_accuracy) also has their
    mean accuracy over the clients' own test splits, as a second line: global, personal.

    A language model's run (History.tokens) shows its test loss, with the perplexity on the right, and
    its token accuracy below (see plot_runs), without a chance line."""
    figure = plot_runs([history], width=5.0, loss=history.tokens)
    values = [100 * v for v in history.test_accuracy]
    personal = history.personal_accuracy
    if personal is not None:
        ax = figure.axes[-1]
        (line,) = ax.plot(
            history.round, [100 * v for v in personal], color=PALETTE[1], marker="o" if len(personal) <= 12 else None
        )
        line.set_markersize(2.5)
        ax.legend([ax.lines[0], line], ["global", "personal"], loc="lower right", frameon=False, fontsize="small")
        values += [100 * v for v in personal if not math.isnan(v)]
    if any(count is not None for count in history.clusters):
        _draw_clusters(figure.axes[0], history)
    classes = history.summary.get("num_classes")
    if classes and not history.tokens:
        ax, chance = figure.axes[0], 100.0 / classes
        ax.axhline(chance, color="0.45", linestyle=":", linewidth=1)
        ax.annotate(
            f"chance ({chance:.3g} %)",
            (0, chance),
            xycoords=("axes fraction", "data"),
            xytext=(3, 2),
            textcoords="offset points",
            fontsize="x-small",
            color="0.45",
        )
        low = min(chance, *values)
        high = max(max(values), low + 20)  # at least 20 points high: a flat line stays flat
        margin = 0.04 * (high - low)
        ax.set_ylim(max(0.0, low - margin), high + margin)
    return figure


# ----------------------------------------------------------------------------- drawing


def _draw_clusters(ax, history: History) -> None:
    """A clustered run's number of clusters (metrics.csv's ``clusters``) at its evaluated rounds, as
    grey steps read on a right-hand axis of whole numbers, behind the accuracy."""
    rounds = [r for r, count in zip(history.round, history.clusters) if count is not None]
    counts = [count for count in history.clusters if count is not None]
    side = ax.twinx()
    side.step(rounds, counts, where="post", color="0.55", linewidth=1, linestyle="--")
    side.set_ylabel("clusters (dashed)")
    side.set_ylim(0, max(counts) + 1)
    side.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_zorder(side.get_zorder() + 1)  # the accuracy lines over the steps
    ax.patch.set_visible(False)


def _draw(ax, group: list[History], column: str, x: str, band: str, style: dict, name: str, shading: float = 0.2):
    xs, runs = _aligned(group, column, x)
    scale = 100.0 if column.endswith("accuracy") else 1.0
    means = [scale * fmean(v) for v in runs]
    marker = "o" if len(xs) <= 12 else None  # markers help on short runs and clutter long ones
    (line,) = ax.plot(xs, means, marker=marker, markersize=2.5, label=name, **style)
    if len(group) > 1:
        if band == "minmax":
            low, high = [scale * min(v) for v in runs], [scale * max(v) for v in runs]
        else:
            spread = [scale * stdev(v) if len(v) > 1 else 0.0 for v in runs]
            low, high = [m - s for m, s in zip(means, spread)], [m + s for m, s in zip(means, spread)]
        ax.fill_between(xs, low, high, color=style["color"], alpha=shading, linewidth=0)
    return line


def _scored_with(group: list[History]) -> str:
    """What the legend adds to a spread line's name: the model its clients were scored with."""
    model = group[0].client_eval_model
    return {"global": " (global model)", "personal": " (own models)"}.get(model, "")


def _draw_spread(ax, group: list[History], x: str, style: dict, name: str):
    """The clients' accuracy: their mean, a band of ± one standard deviation over the clients
    (within 0 and 100 %), their 10th percentile dashed; each the mean over the group's seeds."""
    xs, means = _aligned(group, SPREAD[0], x)
    means = [100 * fmean(v) for v in means]
    sds = [100 * fmean(v) for v in _aligned(group, SPREAD[1], x)[1]]
    p10 = [100 * fmean(v) for v in _aligned(group, SPREAD[2], x)[1]]
    marker = "o" if len(xs) <= 12 else None
    (line,) = ax.plot(xs, means, marker=marker, markersize=2.5, label=name, **style)
    ax.fill_between(
        xs,
        [max(m - s, 0.0) for m, s in zip(means, sds)],
        [min(m + s, 100.0) for m, s in zip(means, sds)],
        color=style["color"],
        alpha=0.2,
        linewidth=0,
    )
    ax.plot(xs, p10, color=style["color"], linestyle="--", linewidth=1)
    return line


def _aligned(group: list[History], column: str, x: str) -> tuple[list, list[list[float]]]:
    """The rounds to draw of a group, the x value of each (rounds, or the mean of the runs' elapsed
    seconds, epsilons or megabytes sent) and the runs' values of ``column`` there.

    A round is drawn where every run evaluated it or had ended before it (different eval_every
    schedules leave out the rounds that not all evaluated). Past a run's end, on the round axis, a
    finished run (one stopped by stop_at_accuracy) counts with its last row: its model no longer
    changes. An unfinished run, or any run on another x axis (it spent no more time, privacy or
    bytes), is not counted there: those rounds are the mean of the runs that reached them (see _ends)."""
    by_round = [{row["round"]: row for row in h.rows} for h in group]
    ends = [max(rows) for rows in by_round]
    rounds = sorted(r for r in set().union(*by_round) if all(r in rows or r > end for rows, end in zip(by_round, ends)))
    held = [x == "round" and not h.unfinished for h in group]
    at = [[rows.get(r, rows[end]) for rows, end, h in zip(by_round, ends, held) if r in rows or h] for r in rounds]
    values = [[row[column] for row in rows] for rows in at]
    if x == "round":
        return rounds, values
    key, scale = _X_COLUMNS.get(x, x), _X_SCALES.get(x, 1)
    return [scale * fmean([row[key] for row in rows]) for rows in at], values


def _ends(groups: list[list[History]], x: str) -> str:
    """What the legend says where runs of one line ended at different rounds (see _aligned): held
    at their last value, or left out of the rounds they did not reach; "" where they ended alike."""
    apart = [g for g in groups if len({h.last_round for h in g}) > 1]
    if not apart:
        return ""
    if x == "round" and not any(h.unfinished for g in apart for h in g):
        return "a seed stopped early (stop_at_accuracy) held at its last value"
    return "past a seed's last round, the mean of the seeds that got there"


def _check_has(histories: list[History], columns) -> None:
    """Every run must have finite values of the columns it is to draw: a column of an optional
    feature is None where the run had it off, and epsilon is infinite without noise."""
    for history in histories:
        for column in columns:
            values = [row.get(column) for row in history.rows]
            if any(v is None for v in values):
                why = f"; {_HAS[column]}" if column in _HAS else ""
                raise FedsimError(f"{history.run_dir or history.name}: has no {column} values to plot{why}")
            if column == "epsilon" and not all(math.isfinite(v) for v in values):
                raise FedsimError(
                    f"{history.run_dir or history.name}: its epsilon is infinite "
                    f"(privacy.noise_multiplier 0: no noise, no guarantee); it has no place on an "
                    f"epsilon axis"
                )


def _labels(groups: list[list[History]], key: str | None) -> list[str]:
    """The legend text of each group: its run name or the value of ``key``; where two groups
    would read the same, the config keys that tell them apart are added (see telling_apart). A line
    of runs that did not finish says so, "(interrupted at round 1 of 3)"."""
    labels = [_format(group[0].name if key is None else group[0].config_value(key)) for group in groups]
    for text in {t for t in labels if labels.count(t) > 1}:
        alike = [i for i, t in enumerate(labels) if t == text]
        keys = telling_apart([groups[i][0] for i in alike])
        for i in alike:
            config = dict(flatten_config(groups[i][0].config))
            if keys:
                labels[i] += " (" + ", ".join(f"{k}={_format(config.get(k))}" for k in keys) + ")"
    for i, group in enumerate(groups):
        ended = list(dict.fromkeys(h.unfinished for h in group if h.unfinished))
        if ended:
            labels[i] += f" ({'; '.join(ended)})"
    return labels


def _format(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _legend_texts(
    groups: list[list[History]], names: list[str], band: str, spread: bool = False, ends: str = ""
) -> list[str]:
    """The legend's entries, below the axes where they hide no curve: one per line and one
    for the bands (with ``ends``, how seeds that ended apart are drawn, see _ends); none for a
    single run. ``spread`` always names its band and dashes."""
    if spread:
        return [*names, "± 1 s.d. over clients", "10th percentile of clients"]
    repeated = [len(g) for g in groups if len(g) > 1]
    if len(groups) == 1 and not repeated:
        return []
    if not repeated:
        return names
    seeds = f"{repeated[0]} seeds" if len(set(repeated)) == 1 else "seeds"
    return [*names, f"{BANDS[band]} over {seeds}" + (f"; {ends}" if ends else "")]


def _legend_columns(texts: list[str], inches: float) -> int:
    """As many columns as the widest entry allows, with rows as even as the entries allow."""
    if not texts:
        return 1
    em = (_font_size(inches) - 1) / 72  # inches
    widest = (0.55 * max(len(t) for t in texts) + 3.5) * em  # text, plus the line sample and gaps
    rows = math.ceil(len(texts) / max(1, min(int(inches / widest), 4)))
    return math.ceil(len(texts) / rows)


def _legend_height(texts: list[str], columns: int, title: str | None) -> float:
    """Inches the legend takes, so that the axes keep their size."""
    if not texts:
        return 0.0
    rows = math.ceil(len(texts) / columns) + (title is not None)
    return 0.17 * rows + 0.1


def _default_title(histories: list[History], metric: str, x: str, tokens: bool = False) -> str:
    """The runs' name (runs of several names: the metric), and below it what they ran (dataset,
    split, model, rule, algorithm and the keys set on top of the experiment, see describe_run):
    where the runs differ (a sweep), what they share, the keys in which they differ said to vary."""
    names = {h.name for h in histories}
    what = (SPREAD_AXIS if metric == SPREAD[0] else _axis_label(metric, tokens)).split(" (")[0].capitalize()
    first = (
        names.pop()
        if len(names) == 1
        else {
            "round": f"{what} per round",
            "seconds": f"{what} over wall time",
            "epsilon": f"{what} against ε",
            "bytes": f"{what} against bytes sent",
            "simulated_seconds": f"{what} over simulated time",
        }[x]
    )
    ended = list(dict.fromkeys(h.unfinished for h in histories if h.unfinished))
    if len(ended) == len(histories) == 1:  # a run on its own has no legend to say it
        first += f" ({ended[0]})"
    shared = _shared_description([h for h in histories if h.config])
    return "\n".join([first, *_wrapped(shared, 60, TITLE_LINES)]) if shared else first


def _shared_description(histories: list[History]) -> str | None:
    """describe_run of what ``histories`` share: the keys whose values differ among them read
    "varies" (the seed is left out), and of the keys set on top of the experiment, those set
    alike in every run. None without a config."""
    if not histories:
        return None
    flat = [dict(flatten_config(h.config)) for h in histories]
    varying = {k for k in set().union(*flat) - {"seed"} if len({repr(f.get(k)) for f in flat}) > 1}
    config = copy.deepcopy(histories[0].config)
    for key in varying:
        *sections, last = key.split(".")
        place = config
        for part in sections:
            place = place.setdefault(part, {}) if isinstance(place.get(part), dict) else None
            if place is None:
                break
        if place is not None:
            place[last] = "varies"
    overrides = [defining(h.summary.get("overrides") or {}) for h in histories]
    common = {
        key: value
        for key, value in overrides[0].items()
        if key != "seed" and key not in varying and all(o.get(key, value) == value and key in o for o in overrides)
    }
    # runs whose algorithms combine the updates each its own way (FedAvg's rule, IFCA's clusters,
    # FedProto's prototypes) share no aggregation, though their configs may share the rule's key
    aggregations = {h.summary.get("aggregation") for h in histories}
    if len(aggregations - {None}) > 1:
        aggregations = {"varies"}
    # the keys that vary which describe_run does not name (a sweep's attack.type) are said to vary
    others = sorted(varying - DESCRIBED_KEYS - RUN_SPECIFIC_KEYS)
    # an options section empty in some runs is a key of its own there: its keys say what varies
    others = [k for k in others if not any(o.startswith(f"{k}.") for o in others)]
    return describe_run(config, common, aggregations.pop() if len(aggregations) == 1 else None, others)


TITLE_LINES = 3  # the lines of a title's description: the axes keep most of the figure's height


def _wrapped(text: str, width: int, lines: int) -> list[str]:
    """``text`` in lines of ``width`` characters, at most ``lines`` of them, the last ending in "..."
    where there was more (whole words only)."""
    import textwrap

    return textwrap.wrap(text, width, break_on_hyphens=False, max_lines=lines, placeholder=" ...")


def _axis_label(column: str, tokens: bool = False) -> str:
    text = column.replace("_", " ")
    if tokens and column == "test_accuracy":  # a language model's: correct next tokens over scored ones
        text = "test token accuracy"
    if column.endswith("accuracy"):
        return f"{text} (%)"
    if column.endswith("seconds"):
        return f"{text} (s)"
    return text


def _font_size(inches: float) -> int:
    return 8 if inches < 5 else 9  # 8 pt suits a single column, 9 pt a full page width


def _style(inches: float) -> dict:
    size = _font_size(inches)
    return {
        "font.size": size,
        "axes.titlesize": size + 1,
        "axes.labelsize": size,
        "xtick.labelsize": size - 1,
        "ytick.labelsize": size - 1,
        "legend.fontsize": size - 1,
        "legend.title_fontsize": size - 1,
        "lines.linewidth": 1.4,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.linewidth": 0.7,
        "xtick.major.width": 0.7,
        "ytick.major.width": 0.7,
    }


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise FedsimError(f"{name}: {value!r} is not one of {', '.join(allowed)}")
