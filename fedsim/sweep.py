"""Sweeps: run every combination of a few config values, one run after another.

``sweep("experiments/compare/base.yaml", ["aggregator=fedavg,median", "seed=0,1"])`` runs four
experiments into ``<out>/<name>-aggregator=fedavg-seed=0/`` and so on, and writes
``<out>/sweep.csv`` with one row per run. Grid values are read as YAML scalars, like
``--set`` values; dotted keys reach into sections and option mappings
(``data.alpha=0.1,1.0``, ``aggregator_options.beta=0.1,0.2``). Every configuration is built
and validated before the first run starts, so a bad value fails at once.
"""
from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from .config import Config, load_config
from .errors import ConfigError, FedsimError, write_error
from .results import History, RunDirectory, safe_dir_name, write_atomically

@dataclass
class SweepRun:
    label: str  # the run's name and directory name
    point: list[tuple[str, str]]  # (key, value text) of this grid point
    config: Config
    history: History | None = None


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["aggregator=fedavg,median", "seed=0,1"]`` -> ``[("aggregator", ["fedavg", "median"]), ...]``."""
    grid, seen = [], set()
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        texts = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(texts):
            raise ConfigError(f"--grid {spec}: expected key=value1,value2,... e.g. --grid aggregator=fedavg,median")
        if key in seen:
            raise ConfigError(f"--grid {key}: given twice; list all its values in one --grid")
        seen.add(key)
        grid.append((key, texts))
    return grid


def run_label(name: str, point: list[tuple[str, str]]) -> str:
    return safe_dir_name("-".join([name] + [f"{key}={value}" for key, value in point]))


def plan(config, grid: list[str], overrides: list[str] = ()) -> list[SweepRun]:
    """One validated Config per grid point: the file, then ``overrides``, then the point."""
    axes = parse_grid(grid)
    name = load_config(config, list(overrides)).name
    runs, seen = [], {}
    for values in itertools.product(*(texts for _, texts in axes)):
        point = [(key, value) for (key, _), value in zip(axes, values)]
        cfg = load_config(config, [*overrides, *(f"{key}={value}" for key, value in point)])
        same = seen.setdefault(repr(cfg.to_dict()), point)  # 0.1 and 0.10 are one value
        if same is not point:
            raise ConfigError(f"--grid: {_spelled(same)} and {_spelled(point)} are the same experiment; "
                              f"list each value once")
        cfg.name = run_label(name, point)
        runs.append(SweepRun(cfg.name, point, cfg))
    labels = [run.label for run in runs]
    if len(set(labels)) < len(labels):
        raise ConfigError("--grid: two grid points give the same run name; make the values distinct")
    return runs


def _spelled(point: list[tuple[str, str]]) -> str:
    return ",".join(f"{key}={value}" for key, value in point)


def seconds_per_round(history: History) -> float:
    """Mean seconds of the evaluated rounds, leaving out the first (it includes worker start-up)."""
    seconds = history.seconds[1:] or history.seconds
    return sum(seconds) / len(seconds) if seconds else math.nan


def sweep(config, grid: list[str], overrides: list[str] = (), out=None, overwrite: bool = False,
          quiet: bool = False, log=None) -> list[SweepRun]:
    """Run every grid point of ``config`` into ``out`` (default ``runs/<name>-sweep-<timestamp>``);
    return the runs with their histories and write ``out/sweep.csv``."""
    from .progress import RoundLog
    from .server import start_run

    log = log or RoundLog(progress=False)
    runs = plan(config, grid, overrides)
    base = load_config(config, list(overrides)).name
    root = RunDirectory.target(out, f"{base}-sweep", overwrite)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(root, e) from None
    log(f"sweep of {len(runs)} runs into {root}")
    try:
        for index, run in enumerate(runs, 1):
            log(f"[{index}/{len(runs)}] {run.label}")
            try:
                run.history = start_run(run.config, out=root / run.label, overwrite=overwrite, quiet=quiet)
            except FedsimError as e:
                raise type(e)(f"sweep run {run.label}: {e}") from None
    finally:  # an interrupted or failed sweep still tables the runs that finished
        finished = [run for run in runs if run.history is not None]
        if finished:
            write_table(finished, root / "sweep.csv")
    log(format_table(runs))
    log(f"runs and sweep.csv in {root}")
    return runs


def _row(run: SweepRun) -> dict:
    h = run.history
    return {"run": run.label, **dict(run.point), "final_test_accuracy": h.final_accuracy,
            "best_test_accuracy": h.best_accuracy, "seconds_per_round": round(seconds_per_round(h), 4),
            "rounds": h.rows[-1]["round"] if h.rows else 0}


def write_table(runs: list[SweepRun], path: Path) -> None:
    rows = [_row(run) for run in runs]

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    write_atomically(path, write)


def format_table(runs: list[SweepRun]) -> str:
    """A fixed-width table: run, final and best test accuracy, seconds per round."""
    width = max(len("run"), *(len(run.label) for run in runs))
    lines = [f"{'run':<{width}}  {'final acc':>9}  {'best acc':>9}  {'s/round':>8}"]
    for run in runs:
        h = run.history
        lines.append(f"{run.label:<{width}}  {h.final_accuracy:>9.4f}  {h.best_accuracy:>9.4f}  "
                     f"{seconds_per_round(h):>8.2f}")
    return "\n".join(lines)
