"""Runs side by side: ``fedsim.results_table``, one row per experiment, and the figures of the
features a run had on (privacy spent, bytes sent, staleness, the accuracy on the clients' own test
splits) that this table and a sweep's show where some run has them."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
from statistics import fmean

from ..core.errors import FedsimError
from .history import (
    History,
    as_histories,
    check_target,
    finished,
    format_rounds_to_target,
    group_repeats,
    mean_and_sd,
    target_stats,
    telling_apart,
)

# summary.json's figures a table reports where some run has them: (key, the table's title, format);
# a figure without a title goes to sweep.csv only. The personal models' accuracy is shown as every
# run's accuracy on the clients' own test splits (client_scores), FedAvg's included.
FIGURES = (
    ("final_personal_accuracy", None, ".4f"),
    ("best_personal_accuracy", None, ".4f"),
    ("personal_untrained_clients", None, "g"),
    ("megabytes_sent", "MB sent", ".3g"),
    ("compression_ratio", "ratio", ".3g"),
    ("delta", None, ".3g"),
    ("staleness_mean", "staleness", ".3g"),
    ("staleness_max", None, "g"),
    ("clients_lost", "lost", "g"),
)
# the mean accuracy on the clients' own test splits (eval_per_client), in percent beside the global model's
CLIENT = ("final_client_accuracy", "best_client_accuracy")
# every run that sends anything has these: they are columns only where some run compresses
TRAFFIC = ("megabytes_sent", "compression_ratio")


def figure(history: History, key: str) -> float | None:
    value = history.summary.get(key)
    return value if isinstance(value, (int, float)) else None


def shown_figures(histories: list[History], compressed: bool | None = None) -> list[tuple]:
    """The FIGURES some of ``histories`` has (personal models, compression, async, ...); the
    traffic's where some run compresses (``compressed``; None: as their configs say)."""
    if compressed is None:
        compressed = any(((h.config.get("compression") or {}).get("type") or "none") != "none" for h in histories)
    return [
        f
        for f in FIGURES
        if (compressed or f[0] not in TRAFFIC) and any(figure(h, f[0]) is not None for h in histories)
    ]


def client_scores(histories: Iterable[History]) -> str | None:
    """How tables name the runs' mean accuracy on the clients' own test splits: None where no run
    scored its clients (eval_per_client); "personal" where each run that did scored the clients'
    own models; else "client", beside a column ``clients use`` saying which model each run's
    clients were scored with (global for FedAvg), so that FedAvg's row and the personal
    algorithms' compare on the same test data."""
    models = {h.client_eval_model for h in histories} - {None}
    if not models:
        return None
    return "personal" if models == {"personal"} else "client"


def untrained_note(histories: Iterable[History]) -> str:
    """What a global model's accuracy cell says where that model never trained (FedProto's): its
    accuracy is the initial model's, no result of the run."""
    return "" if all(h.global_model_trained for h in histories) else " (never trained)"


def epsilon(history: History) -> float | None:
    """The privacy a run spent (its last row's epsilon); None without a privacy section."""
    return history.rows[-1].get("epsilon") if history.rows and history.config.get("privacy") else None


def mean_of(values: Iterable[float | None]) -> float | None:
    """The mean, or None where a value is missing (a run without the feature)."""
    values = list(values)
    return None if not values or None in values else fmean(values)


# ----------------------------------------------------------------------------- fedsim.results_table


class ResultsTable(list):
    """Rows (dicts) of a results table. It prints as markdown, and Jupyter shows it as a table."""

    def __init__(self, rows: Iterable[dict], columns: Iterable[str]):
        super().__init__(rows)
        self.columns = list(columns)

    def markdown(self) -> str:
        repeated = any(row["runs"] > 1 for row in self)
        columns = [c for c in self.columns if c != "runs" or repeated]
        headers = [_header(c, self) for c in columns]
        lines = [
            "| " + " | ".join(headers) + " |",
            "|" + "|".join("---:" if c in _HEADERS and c != "clients_use" else "---" for c in columns) + "|",
        ]
        for row in self:
            lines.append("| " + " | ".join(_cell(row, c) for c in columns) + " |")
        return "\n".join(lines)

    __str__ = __repr__ = _repr_markdown_ = markdown  # Jupyter renders _repr_markdown_


_HEADERS = {
    "runs": "runs",
    "final_test_loss": "final test loss",
    "final_test_perplexity": "final ppl",
    "final_accuracy": "final acc. (%)",
    "best_accuracy": "best acc. (%)",
    "test_samples": "scored on",  # where some run scored rounds on eval_subset: the set of final, best and target
    "epsilon": "epsilon",
    "final_client_accuracy": "final client acc. (%)",
    "best_client_accuracy": "best client acc. (%)",
    "clients_use": "clients use",
    **{key: title for key, title, _ in FIGURES if title},
    "target": "target (%)",
    "rounds_to_target": "rounds to target",
    "rounds": "rounds",
    "wall_seconds": "wall (s)",
}
_FORMATS = {"final_test_loss": ".4f", "final_test_perplexity": ".2f", "epsilon": ".3g", **{k: f for k, _, f in FIGURES}}


def _header(column: str, rows) -> str:
    if column == "rounds_to_target":
        targets = {row["target"] for row in rows if row["target"] is not None}
        if len(targets) == 1:  # one target for every row: it goes in the header, no column of its own
            return f"rounds to {_percent(targets.pop())} %"
    if column in ("final_accuracy", "best_accuracy") and "final_test_perplexity" in rows.columns:
        return _HEADERS[column].replace("acc.", "tok. acc.")  # a language model's accuracy is its tokens'
    if column in ("final_accuracy", "best_accuracy") and "final_client_accuracy" in rows.columns:
        return _HEADERS[column].replace("acc.", "global acc.")  # beside the accuracy on the clients' splits
    if column in CLIENT and "clients_use" not in rows.columns:  # every run scored its clients' own models
        return _HEADERS[column].replace("client", "personal")
    return _HEADERS.get(column, column)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.4g}"


def _cell(row: dict, column: str) -> str:
    """A table cell, with markdown's own characters escaped (``__main__:my_rule`` stays as it is)."""
    return re.sub(r"([\\`*_{}\[\]<>|])", r"\\\1", _text(row, column))


def _text(row: dict, column: str) -> str:
    value = row[column]
    if column == "final_accuracy":
        spread = f" ± {100 * row['final_accuracy_std']:.1f}" if row["runs"] > 1 else ""
        return f"{100 * value:.1f}{spread}{row['untrained']}"
    if column == "best_accuracy":
        return f"{100 * value:.1f}{row['untrained']}"
    if column in CLIENT:
        return "–" if value is None else f"{100 * value:.1f}"
    if column == "clients_use":
        return value or "–"
    if column == "target":
        return "–" if value is None else _percent(value)
    if column == "test_samples":
        return "–" if value is None else f"{value:,} samples"
    if column == "rounds_to_target":
        return "–" if row["target"] is None else format_rounds_to_target(row)
    if column == "rounds":
        rounds = f"{row['rounds_min']}–{value}" if row["rounds_min"] != value else str(value)
        return f"{rounds} ({row['unfinished']})" if row["unfinished"] else rounds
    if column == "wall_seconds":
        return f"{value:.1f}"
    if column in _FORMATS:
        return "–" if value is None else format(value, _FORMATS[column])
    return str(value)


def results_table(
    histories: Iterable[History] | str | os.PathLike, keys: str | Sequence[str] = ("name",), target: float | None = None
) -> ResultsTable:
    """One row per experiment of ``histories`` (History objects, a sweep's runs, run directories
    or patterns such as ``"runs/sweep/*"``; repeats over seeds pooled; runs that failed or have no evaluated
    round left out, with a warning, and so are interrupted runs beside finished ones, see
    ``finished``): the ``keys``' config values (a string is one key; where they leave two rows
    alike, the keys that tell them apart are added, see ``telling_apart``), the
    number of runs, final accuracy (mean and sample standard deviation over the runs), best
    accuracy, rounds (the last evaluated round; ``rounds_min`` to ``rounds`` where the runs stopped
    apart, as stop_at_accuracy stops them; ``unfinished`` says how a table of only unfinished runs
    ended, "interrupted at round 1 of 3") and wall seconds (mean). Accuracies are fractions; the
    markdown shows %.
    The final and best figures and the rounds to a target come from the rounds scored on the set
    the last round was, the whole test set: where some run scored rounds before the last on
    eval_subset's samples, those are left out and a column says how many samples that set holds.
    Where some run is a language model's, its final test loss and perplexity come first (means),
    and the accuracies are token accuracies; where some run had a feature on, its figure (the
    epsilon spent, MB sent, staleness, clients lost: means, empty for a run without it). Where some
    run scored its clients (eval_per_client), the final and best mean accuracy on the clients' own
    test splits, named as ``client_scores`` says (``clients_use``: which model, global or
    personal). A global model that never trained (FedProto's) has its accuracy marked so.

    Rounds to a test accuracy: ``target`` (a fraction), or where it is None each experiment's
    ``stop_at_accuracy``. A run reaches it in the first evaluated round whose test accuracy is at
    least the target; the row gets the mean and sample standard deviation of that round over the
    runs that reached it (``rounds_to_target``, ``rounds_to_target_std``), how many did
    (``reached``) and the ``target``; the markdown shows them as ``22.3 ± 1.5 (3/3)``. The
    columns are there when some row has a target.
    """
    check_target(target)
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    histories = [histories] if isinstance(histories, (str, os.PathLike, History)) else list(histories)
    if not histories:
        raise FedsimError("results_table: no runs given; pass History objects, e.g. fedsim.load_runs('runs/*')")
    kept = finished(as_histories(histories, "for the table"))
    if not kept:
        raise FedsimError("results_table: every run given failed or has no evaluated round")
    groups = group_repeats(kept, distinguish=keys)
    for key in keys:  # an unknown key named before anything else, with the run's keys
        _key_value(groups[0][0], key)
    # where the keys asked for leave two rows alike, the keys that tell them apart are added
    keys = (*keys, *telling_apart([group[0] for group in groups], keys))
    every = [h for group in groups for h in group]
    tokens = any(h.tokens for h in every)
    privacy = any(epsilon(h) is not None for h in every)
    figures = [(key, title) for key, title, _ in shown_figures(every) if title]
    rows = []
    for group in groups:
        final, final_sd = mean_and_sd(h.final_accuracy for h in group)
        goal = target if target is not None else group[0].config.get("stop_at_accuracy")
        stats = target_stats(group, goal)
        rows.append(
            {
                **{key: _key_value(group[0], key) for key in keys},
                "runs": len(group),
                "final_test_loss": mean_of(h.rows[-1]["test_loss"] if h.tokens else None for h in group),
                "final_test_perplexity": mean_of(h.final_perplexity for h in group),
                "final_accuracy": final,
                "final_accuracy_std": final_sd,
                "best_accuracy": fmean([h.best_accuracy for h in group]),
                "untrained": untrained_note(group),
                "final_client_accuracy": mean_of(h.final_client_accuracy for h in group),
                "best_client_accuracy": mean_of(h.best_client_accuracy for h in group),
                "clients_use": group[0].client_eval_model,
                "test_samples": group[0].scored_on,
                "epsilon": mean_of(epsilon(h) for h in group),
                **{key: mean_of(figure(h, key) for h in group) for key, _ in figures},
                "target": stats["target"],
                "rounds_to_target": stats["rounds_to_target"],
                "rounds_to_target_std": stats["rounds_to_target_std"],
                "reached": stats["reached"],
                # runs stopped by stop_at_accuracy end early: the table gives the range
                "rounds": max(h.last_round for h in group),
                "rounds_min": min(h.last_round for h in group),
                "unfinished": ", ".join(dict.fromkeys(h.unfinished for h in group if h.unfinished)) or None,
                "wall_seconds": fmean([h.summary.get("wall_seconds") or _last(h, "elapsed_seconds") for h in group]),
            }
        )
    titled = {key for key, _ in figures}
    shown = {"final_test_loss": tokens, "final_test_perplexity": tokens, "epsilon": privacy}
    shown["test_samples"] = any(h.scored_apart for h in every)
    shown |= {key: key in titled for key, _, _ in FIGURES}
    scores = client_scores(every)
    shown |= {"final_client_accuracy": bool(scores), "best_client_accuracy": bool(scores)}
    shown["clients_use"] = scores == "client"
    columns = [*keys, *(c for c in _HEADERS if shown.get(c, True))]
    targets = {row["target"] for row in rows}
    if targets == {None}:  # nobody asked for rounds to a target
        columns = [c for c in columns if c not in ("target", "rounds_to_target")]
    elif len(targets) == 1:  # one target: named in the header
        columns.remove("target")
    return ResultsTable(rows, columns)


def _key_value(history: History, key: str):
    """A config value as a table shows it: the aggregator as the run aggregated (summary.json's
    ``aggregation``: HetLoRA's and FLoRA's own, not the rule they replace), the others as set."""
    if key == "aggregator" and history.summary.get("aggregation"):
        return history.summary["aggregation"]
    return history.config_value(key)


def _last(history: History, column: str) -> float:
    return history.rows[-1].get(column, math.nan) if history.rows else math.nan
