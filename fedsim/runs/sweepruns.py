"""A sweep's runs and what it reports of them: the per-run and per-configuration rows of
``runs.csv`` and ``sweep.csv``, and the table it prints (under --seeds, mean ± sample standard
deviation over each configuration's seeds). A sweep of language models' runs also reports their
final and best (lowest) test perplexity."""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import FedsimError
from ..core.files import write_atomically
from ..experiment.config import Config
from ..results.history import History, format_rounds_to_target, mean_and_sd, rounds_to_target, target_stats
from ..results.table import client_scores, epsilon, figure, mean_of, shown_figures, untrained_note


@dataclass
class SweepRun:
    label: str  # the run's directory name (and, without seeds, its name)
    point: list[tuple[str, str]]  # (key, value text) of this grid point, not counting the seed of --seeds
    config: Config
    history: History | None = None
    seed: int | None = None  # the repeat's seed under --seeds, else None
    configuration: str = ""  # the grid point's label, which the seeds of a point share as their name
    todo: str = "start"  # what is left to do of it: start, resume (an interrupted run) or finished
    blame: Callable[[FedsimError, list, int | None], FedsimError] | None = None  # names its errors by the grid

    def __post_init__(self):
        self.configuration = self.configuration or self.label


def _figures(runs: list[SweepRun]) -> list[tuple]:
    """The FIGURES some run of the sweep has (personal models, compression, async, ...)."""
    compressed = any(run.config.compression.type != "none" for run in runs)
    return shown_figures([run.history for run in runs], compressed)


def _mean_figure(histories: list[History], key: str) -> float | None:
    return mean_of(figure(h, key) for h in histories)


def seconds_per_round(history: History) -> float:
    """Mean seconds of every round run after the first evaluated one (the first includes worker
    start-up; a fine-tuning run's round 0 scores its base and trains nothing): the elapsed seconds
    between the first and the last evaluated round over the rounds between them, so that the rounds
    eval_every skips count, and the rounds scored are not the only ones timed. A run evaluated in a
    single round: its elapsed seconds less the start-up (summary.json's startup_seconds) over its
    rounds; without those figures (an older version's run), the evaluated rounds' own seconds."""
    trained = [row for row in history.rows if row["round"] > 0]
    if not trained:
        return math.nan
    first, last = trained[0], trained[-1]
    if first.get("elapsed_seconds") is not None and last.get("elapsed_seconds") is not None:
        if last["round"] > first["round"]:
            return (last["elapsed_seconds"] - first["elapsed_seconds"]) / (last["round"] - first["round"])
        startup = history.summary.get("startup_seconds")
        if isinstance(startup, (int, float)) and history.summary.get("resumed_at_round") is None:
            return (last["elapsed_seconds"] - startup) / last["round"]
    seconds = [row["seconds"] for row in trained[1:]] or [first["seconds"]]
    return sum(seconds) / len(seconds)


def configurations(runs: list[SweepRun]) -> list[list[SweepRun]]:
    """The runs grouped by configuration (the seeds of a grid point), in the order of the sweep."""
    groups: dict[str, list[SweepRun]] = {}
    for run in runs:
        groups.setdefault(run.configuration, []).append(run)
    return list(groups.values())


def _tokens(runs: list[SweepRun]) -> bool:
    """Every run is a language model's (token-level): the tables add its perplexity, and call its
    accuracy token accuracy. A sweep that mixes in classification runs is tabled as one of those."""
    return all(run.history.tokens for run in runs)


def _scored_apart(runs: list[SweepRun]) -> bool:
    """Whether some run scored rounds on eval_subset's samples: the final and best figures and the
    rounds to a target then come from the rounds scored on the whole test set, which a column names."""
    return any(run.history.scored_apart for run in runs)


def _samples(count: int | None) -> str:
    return "–" if count is None else f"{count:,} samples"


def _client_scores(runs: list[SweepRun]) -> str | None:
    """How the sweep names its runs' accuracy on the clients' own test splits (see client_scores)."""
    return client_scores(run.history for run in runs)


def _client_columns(histories: list[History], runs: list[SweepRun]) -> dict:
    """sweep.csv's accuracy on the clients' own test splits, every run's that scored its clients
    (FedAvg's with the global model, a personal algorithm's with the clients' own models; means over
    seeds), and which model that was; and where some run's global model never trained, which."""
    columns = {}
    if _client_scores(runs):
        columns |= {
            "final_client_accuracy": _blank(mean_of(h.final_client_accuracy for h in histories)),
            "best_client_accuracy": _blank(mean_of(h.best_client_accuracy for h in histories)),
            "client_eval_model": _blank(histories[0].client_eval_model),
        }
    if not all(run.history.global_model_trained for run in runs):
        columns["global_model_trained"] = all(h.global_model_trained for h in histories)
    return columns


def _repeated(runs: list[SweepRun]) -> bool:
    return any(run.seed is not None for run in runs)


def _target(run: SweepRun, target: float | None) -> float | None:
    return target if target is not None else run.config.stop_at_accuracy


def _with_target(runs: list[SweepRun], target: float | None) -> bool:
    return any(_target(run, target) is not None for run in runs)


def _row(run: SweepRun, target: float | None, runs: list[SweepRun]) -> dict:
    """One run's row of sweep.csv (runs.csv under --seeds)."""
    h = run.history
    row = {
        "run": run.label,
        **dict(run.point),
        **({"seed": run.seed} if run.seed is not None else {}),
        "final_test_accuracy": h.final_accuracy,
        "best_test_accuracy": h.best_accuracy,
        **_client_columns([h], runs),
        **(
            {"final_test_perplexity": h.final_perplexity, "best_test_perplexity": h.best_perplexity}
            if _tokens(runs)
            else {}
        ),
        **({"test_samples": _blank(h.scored_on)} if _scored_apart(runs) else {}),
        "seconds_per_round": round(seconds_per_round(h), 4),
        "rounds": h.last_round,
    }
    if _with_epsilon(runs):
        row["epsilon"] = _blank(epsilon(h))
    row |= {key: _blank(figure(h, key)) for key, _, _ in _figures(runs)}
    if _with_target(runs, target):
        goal = _target(run, target)
        reached = None if goal is None else rounds_to_target(h, goal)
        row |= {"target": _blank(goal), "rounds_to_target": _blank(reached)}
    return row


def _group_row(group: list[SweepRun], target: float | None, runs: list[SweepRun]) -> dict:
    """One configuration's row of sweep.csv under --seeds: means and sample standard deviations
    over its seeds (a deviation is left empty below two values)."""
    histories = [run.history for run in group]
    final, final_sd = mean_and_sd(h.final_accuracy for h in histories)
    best, best_sd = mean_and_sd(h.best_accuracy for h in histories)
    n = len(group)
    row = {
        "configuration": group[0].configuration,
        **dict(group[0].point),
        "seeds": " ".join(str(run.seed) for run in group),
        "runs": n,
        "final_test_accuracy": final,
        "final_test_accuracy_std": _blank(final_sd if n > 1 else None),
        "best_test_accuracy": best,
        "best_test_accuracy_std": _blank(best_sd if n > 1 else None),
        **_client_columns(histories, runs),
        **({"test_samples": _blank(histories[0].scored_on)} if _scored_apart(runs) else {}),
        **(_perplexity_columns(histories) if _tokens(runs) else {}),
        "seconds_per_round": round(mean_and_sd(seconds_per_round(h) for h in histories)[0], 4),
    }
    if _with_epsilon(runs):
        row["epsilon"] = _blank(_mean_epsilon(histories))
    row |= {key: _blank(_mean_figure(histories, key)) for key, _, _ in _figures(runs)}
    if _with_target(runs, target):
        stats = target_stats(histories, _target(group[0], target))
        reached = stats["reached"] or 0
        row |= {
            "target": _blank(stats["target"]),
            "rounds_to_target": _blank(stats["rounds_to_target"] if reached else None),
            "rounds_to_target_std": _blank(stats["rounds_to_target_std"] if reached > 1 else None),
            "reached_target": _blank(stats["reached"]),
        }
    return row


def _perplexity_columns(histories: list[History]) -> dict:
    """A configuration's final and best (lowest) test perplexity over its seeds: mean and sample
    standard deviation (empty below two seeds)."""
    columns = {}
    for which in ("final", "best"):
        mean, sd = mean_and_sd(getattr(h, f"{which}_perplexity") for h in histories)
        columns |= {
            f"{which}_test_perplexity": mean,
            f"{which}_test_perplexity_std": _blank(sd if len(histories) > 1 else None),
        }
    return columns


def _mean_epsilon(histories: list[History]) -> float | None:
    """Over seeds: the same unless some stopped early (stop_at_accuracy)."""
    return mean_of(epsilon(h) for h in histories)


def _with_epsilon(runs: list[SweepRun]) -> bool:
    return any(epsilon(run.history) is not None for run in runs)


def _blank(value):
    return "" if value is None else value


def write_table(runs: list[SweepRun], path: Path, target: float | None = None) -> None:
    """sweep.csv: one row per run, or under --seeds one row per configuration."""
    if _repeated(runs):
        rows = [_group_row(group, target, runs) for group in configurations(runs)]
    else:
        rows = [_row(run, target, runs) for run in runs]
    write_csv(path, rows)


def write_csv(path: Path, rows: list[dict]) -> None:
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    write_atomically(path, write)


def format_table(runs: list[SweepRun], target: float | None = None) -> str:
    """A fixed-width table: run, final and best test accuracy (where every run is a language
    model's: final and best test perplexity first, then token accuracy; a global model that never
    trained marked so), where some run scored its clients (eval_per_client) the final and best mean
    accuracy on their own test splits and, where not every such run scored personal models, the
    model its clients used (see client_scores), the epsilon spent (runs with a
    privacy section), the FIGURES of summary.json some run has (megabytes sent and compression
    ratio, mean staleness, clients lost), rounds to the
    target (where one is set), seconds per round. Under --seeds, one row per configuration: its
    number of seeds, then mean ± sample standard deviation over them (a figure: its mean), and the
    rounds to the target as ``mean ± sd (reached/seeds)`` over the seeds that reached it."""
    repeated = _repeated(runs)
    groups = configurations(runs) if repeated else [[run] for run in runs]
    columns = [
        ("configuration" if repeated else "run", [g[0].configuration if repeated else g[0].label for g in groups])
    ]
    if repeated:
        columns.append(("seeds", [str(len(g)) for g in groups]))
    tokens = _tokens(runs)
    if tokens:  # a language model is judged by its perplexity first
        for title, value in (("final ppl", lambda h: h.final_perplexity), ("best ppl", lambda h: h.best_perplexity)):
            columns.append((title, [_accuracy([value(run.history) for run in g], ".2f") for g in groups]))
    scores = _client_scores(runs)
    named = "tok acc" if tokens else "global acc" if scores else "acc"  # beside the accuracy on the clients' splits
    for title, value in (("final", lambda h: h.final_accuracy), ("best", lambda h: h.best_accuracy)):
        cells = [_accuracy([value(run.history) for run in g]) + untrained_note(r.history for r in g) for g in groups]
        columns.append((f"{title} {named}", cells))
    if scores:
        for title, value in (("final", "final_client_accuracy"), ("best", "best_client_accuracy")):
            values = [[getattr(run.history, value) for run in g] for g in groups]
            columns.append((f"{title} {scores} acc", ["–" if None in v else _accuracy(v) for v in values]))
        if scores == "client":  # which model each run's clients were scored with
            columns.append(("clients use", [g[0].history.client_eval_model or "–" for g in groups]))
    if _scored_apart(runs):  # the set the figures before come from, where some rounds were scored on eval_subset's
        columns.append(("scored on", [_samples(g[0].history.scored_on) for g in groups]))
    if _with_epsilon(runs):
        epsilons = [_mean_epsilon([run.history for run in g]) for g in groups]
        columns.append(("epsilon", ["–" if e is None else f"{e:.3g}" for e in epsilons]))
    for key, title, spec in _figures(runs):
        if title:
            values = [_mean_figure([run.history for run in g], key) for g in groups]
            columns.append((title, ["–" if v is None else format(v, spec) for v in values]))
    if _with_target(runs, target):
        goals = [_target(g[0], target) for g in groups]
        stats = [target_stats([run.history for run in g], goal) for g, goal in zip(groups, goals)]
        cells = ["–" if s["target"] is None else format_rounds_to_target(s) for s in stats]
        if len(set(goals)) == 1:
            columns.append((f"rounds to {goals[0]:g}", cells))
        else:
            columns += [
                ("target", ["–" if goal is None else f"{goal:g}" for goal in goals]),
                ("rounds to target", cells),
            ]
    columns.append(("s/round", [f"{mean_and_sd(seconds_per_round(run.history) for run in g)[0]:.2f}" for g in groups]))
    return "\n".join(_aligned([[title for title, _ in columns], *zip(*(cells for _, cells in columns))]))


def _aligned(rows: list) -> list[str]:
    """Rows of cells as fixed-width lines: the first column to the left, the others to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}" for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]


def _printable(text: str) -> str:
    """The table as the terminal can show it: ``+/-`` for ``±`` where the output's encoding
    (ASCII, say) has no such character, rather than failing once every run is done."""
    try:
        text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
        return text
    except (UnicodeEncodeError, LookupError):
        return text.replace("±", "+/-").replace("–", "-")


def _accuracy(values: list[float], spec: str = ".4f") -> str:
    """One run's accuracy (or perplexity), or the mean ± sample standard deviation of several."""
    mean, sd = mean_and_sd(values)
    return format(mean, spec) if len(values) == 1 else f"{mean:{spec}} ± {sd:{spec}}"


# ----------------------------------------------------------------------------- pivot


def pivot_blocks(runs: list[SweepRun], down: str, across: str) -> list[tuple[list[tuple[str, str]], dict]]:
    """The sweep's runs with the values of the grid key ``down`` as rows and those of ``across`` as
    columns: one block per combination of the other grid keys (``[(key, value)]``, in the sweep's
    order), each ``{row value: {column value: [the History of each seed]}}``."""
    blocks: dict[tuple, dict] = {}
    for run in runs:
        point = dict(run.point)
        others = tuple((key, value) for key, value in run.point if key not in (down, across))
        cells = blocks.setdefault(others, {})
        cells.setdefault(point[down], {}).setdefault(point[across], []).append(run.history)
    return [(list(others), cells) for others, cells in blocks.items()]


def pivot_figures(runs: list[SweepRun]) -> list[tuple[str, str, str | None, Callable]]:
    """What the pivot shows, each as (pivot.csv's name, title, what it scores, a History's value):
    the final test accuracy, the global model's on the whole test set; where some run scored its
    clients (eval_per_client), first the final mean accuracy on the clients' own test splits, on
    which FedAvg's global model and the personal algorithms' own models compare on the same data."""
    scores = _client_scores(runs)
    test = ("final_test_accuracy", "final test accuracy", None, lambda h: h.final_accuracy)
    if not scores:
        return [test]
    scored = {
        "personal": "each client's own model on its own test split",
        "client": "each client's model on its own test split: the global one or its own, as marked",
    }[scores]
    return [
        ("final_client_accuracy", f"final {scores} accuracy", scored, lambda h: h.final_client_accuracy),
        (*test[:2], "the global model on the whole test set", test[3]),
    ]


def _pivot_row(cells: dict, columns: list[str], value: Callable) -> dict:
    """A pivot row's cells: column value -> (mean over its seeds, their Histories), where it has one."""
    row = {}
    for column in columns:
        values = [value(h) for h in cells.get(column, [])]
        if values and None not in values:
            row[column] = (mean_and_sd(values)[0], cells[column])
    return row


def _pivot_note(name: str, histories: list[History], scores: str | None) -> str:
    """What a pivot cell says besides its figure: a global model that never trained; under mixed
    client scoring, which model the clients were scored with."""
    if name == "final_test_accuracy":
        return untrained_note(histories)
    return f" ({histories[0].client_eval_model})" if scores == "client" and histories[0].client_eval_model else ""


def format_pivot(runs: list[SweepRun], down: str, across: str) -> str:
    """``pivot_blocks`` as fixed-width tables, one set per figure of ``pivot_figures``, a
    configuration's cell its mean ± sample standard deviation over seeds, with a last column
    ``worst``: the lowest mean of the row (ByzFL's heatmaps give each cell the worst accuracy over
    the attacks)."""
    out = []
    scores = _client_scores(runs)
    blocks = pivot_blocks(runs, down, across)
    for name, title, scored, value in pivot_figures(runs):
        for others, cells in blocks:
            columns = list(dict.fromkeys(column for row in cells.values() for column in row))
            table = [[f"{down} \\ {across}", *columns, "worst"]]
            for row, values in cells.items():
                means = _pivot_row(values, columns, value)
                texts = [
                    _accuracy([value(h) for h in means[c][1]]) + _pivot_note(name, means[c][1], scores)
                    if c in means
                    else "–"
                    for c in columns
                ]
                worst = min(means.values(), key=lambda cell: cell[0], default=None)
                texts.append("–" if worst is None else f"{worst[0]:.4f}" + _pivot_note(name, worst[1], scores))
                table.append([row, *texts])
            where = f", {', '.join(f'{k}={v}' for k, v in others)}" if others else ""
            out.append("\n".join([f"{title}{where}" + (f" ({scored})" if scored else ""), *_aligned(table)]))
    return "\n\n".join(out)


def write_pivot(runs: list[SweepRun], down: str, across: str, path: Path) -> None:
    """pivot.csv: one row per row of every pivot block, the other grid keys first, each column
    value's mean over seeds (empty where not run yet), then ``worst``. Where the sweep scored its
    clients, a first column ``figure`` says which of ``pivot_figures`` a row holds; where some
    run's global model never trained, ``never_trained`` lists the column values whose global model
    (a final_test_accuracy row's figure) did not."""
    rows = []
    figures = pivot_figures(runs)
    untrained = not all(run.history.global_model_trained for run in runs)
    blocks = pivot_blocks(runs, down, across)
    columns = list(dict.fromkeys(c for _, cells in blocks for row in cells.values() for c in row))
    for name, _, _, value in figures:
        for others, cells in blocks:
            for row, values in cells.items():
                means = _pivot_row(values, columns, value)
                rows.append(
                    {
                        **({"figure": name} if len(figures) > 1 else {}),
                        **dict(others),
                        down: row,
                        **{c: _blank(means[c][0] if c in means else None) for c in columns},
                        "worst": _blank(min((m for m, _ in means.values()), default=None)),
                        **({"never_trained": _never_trained(name, means)} if untrained else {}),
                    }
                )
    write_csv(path, rows)


def _never_trained(name: str, means: dict) -> str:
    if name != "final_test_accuracy":
        return ""
    return " ".join(c for c, (_, histories) in means.items() if not all(h.global_model_trained for h in histories))
