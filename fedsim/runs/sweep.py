"""Sweeps: run every combination of a few config values, one run after another.

``sweep("experiments/compare/base.yaml", ["aggregator=fedavg,median", "seed=0,1"])`` runs four
experiments into ``<out>/<name>-aggregator=fedavg-seed=0/`` and so on, and writes
``<out>/sweep.csv`` with one row per run. Grid values are read as YAML scalars, like
``--set`` values; dotted keys reach into sections and option mappings
(``data.alpha=0.1,1.0``, ``aggregator_options.beta=0.1,0.2``). Every configuration is built
and checked as a run checks itself before its workers start, before the first run starts, so
a bad value fails at once; the same sweep into the same ``out`` again continues it (``Sweep``).

Seeds are an axis of their own: ``sweep(..., seeds=[0, 1, 2])`` (``fedsim sweep --seeds 0,1,2``)
runs every grid point under every seed into ``<name>-<point>-seed=S/``, like ``--grid seed=...``,
but as repeats of one configuration: the runs of a point share its name (so ``fedsim plot`` and
``results_table`` pool them), and the table and ``sweep.csv`` have one row per configuration,
with the mean and sample standard deviation over the seeds (``runs.csv`` keeps one row per run).
Where a target accuracy is set (``target``, or else the configuration's ``stop_at_accuracy``),
they also report the rounds to it over the seeds that reached it, and how many did.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import sys
from dataclasses import dataclass
from statistics import fmean
from pathlib import Path

from ..experiment.config import Config
from ..core.errors import ConfigError, FedsimError, write_error
from ..results.history import (History, check_target, format_rounds_to_target, load_run, mean_and_sd, rounds_to_target, target_stats)
from ..core.files import atomic_write_text, write_atomically
from ..results.rundir import safe_dir_name
from .sweepdir import SWEEP_FILE, identity, left_to_do, placement, sweep_root
from ..experiment.validation import load_config


@dataclass
class SweepRun:
    label: str  # the run's directory name (and, without seeds, its name)
    point: list[tuple[str, str]]  # (key, value text) of this grid point, not counting the seed of --seeds
    config: Config
    history: History | None = None
    seed: int | None = None  # the repeat's seed under --seeds, else None
    configuration: str = ""  # the grid point's label, which the seeds of a point share as their name
    todo: str = "start"  # what is left to do of it: start, resume (an interrupted run) or finished

    def __post_init__(self):
        self.configuration = self.configuration or self.label


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


def parse_seeds(seeds) -> list[int]:
    """``"0,1,2"`` (or a list of integers) -> ``[0, 1, 2]``."""
    if isinstance(seeds, str):
        try:
            values = [int(text.strip()) for text in seeds.split(",")]
        except ValueError:
            raise ConfigError(f"--seeds {seeds}: expected integers separated by commas, e.g. --seeds 0,1,2") from None
    else:
        values = list(seeds)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"--seeds {values}: expected integers, e.g. [0, 1, 2]")
    if not values:
        raise ConfigError("--seeds: give at least one seed, e.g. --seeds 0,1,2")
    if len(set(values)) < len(values):
        raise ConfigError(f"--seeds {','.join(map(str, values))}: a seed is listed twice; list each once")
    return values


def run_label(name: str, point: list[tuple[str, str]]) -> str:
    return safe_dir_name("-".join([name] + [f"{key}={value}" for key, value in point]))


def plan(config, grid: list[str], overrides: list[str] = (), seeds=None) -> list[SweepRun]:
    """One validated Config per grid point (and per seed of ``seeds``): the file, then
    ``overrides``, then the point, then the seed. Without ``seeds`` a run is named after its
    point; with them the runs of a point share the point's name, and their directories end in
    ``-seed=S``."""
    axes = parse_grid(grid)
    seeds = None if seeds is None else parse_seeds(seeds)
    if seeds is not None and any(key == "seed" for key, _ in axes):
        raise ConfigError("--seeds and --grid seed=... both give seeds; use --seeds to repeat every "
                          "configuration under each seed, or --grid seed=... to sweep the seed as a setting")
    name = load_config(config, list(overrides)).name
    runs, seen = [], {}
    for values in itertools.product(*(texts for _, texts in axes)):
        point = [(key, value) for (key, _), value in zip(axes, values)]
        configuration = run_label(name, point)
        for seed in seeds if seeds is not None else [None]:
            repeat = [] if seed is None else [f"seed={seed}"]
            try:
                cfg = load_config(config, [*overrides, *(f"{key}={value}" for key, value in point), *repeat])
            except ConfigError as e:
                raise _as_given(e, point, seed) from None
            same = seen.setdefault(repr(cfg.to_dict()), point)  # 0.1 and 0.10 are one value
            if same is not point:
                raise ConfigError(f"--grid: {_spelled(same)} and {_spelled(point)} are the same experiment; "
                                  f"list each value once")
            cfg.name = configuration
            label = configuration if seed is None else run_label(name, [*point, ("seed", str(seed))])
            runs.append(SweepRun(label, point, cfg, seed=seed, configuration=configuration))
    labels = [run.label for run in runs]
    if len(set(labels)) < len(labels):
        raise ConfigError("--grid: two grid points give the same run name; make the values distinct")
    return runs


def _as_given(error: ConfigError, point: list[tuple[str, str]], seed: int | None) -> ConfigError:
    """An error about a grid value (or a seed of --seeds) names it as the user gave it: ``--grid
    key=value`` (``--seeds``), not ``--set key``."""
    named = str(error).removeprefix("--set ").partition(":")[0]
    flags = {key: f"--grid {key}={value}" for key, value in point} | ({"seed": f"--seeds {seed}"} if seed is not None
                                                                        else {})
    key = next((key for key in flags if key == named or key.startswith(named + ".")), None)
    if not str(error).startswith("--set ") or key is None:
        return error
    return ConfigError(f"{flags[key]}{'' if key == named else f' ({named})'}{str(error)[len('--set ') + len(named):]}")


def _spelled(point: list[tuple[str, str]]) -> str:
    return ",".join(f"{key}={value}" for key, value in point)


def seconds_per_round(history: History) -> float:
    """Mean seconds of the evaluated rounds, leaving out the first (it includes worker start-up)."""
    seconds = history.seconds[1:] or history.seconds
    return sum(seconds) / len(seconds) if seconds else math.nan


def sweep(config, grid: list[str], overrides: list[str] = (), out=None, overwrite: bool = False,
          quiet: bool = False, log=None, seeds=None, target: float | None = None) -> list[SweepRun]:
    """Run every grid point of ``config`` (under every seed of ``seeds``) into ``out`` (default
    ``runs/<name>-sweep-<timestamp>``); return the runs with their histories and write
    ``out/sweep.csv`` (with ``seeds``, one row per configuration, and ``out/runs.csv``, one per
    run). ``target``: report the rounds to this test accuracy (a fraction; the runs go on),
    instead of each configuration's ``stop_at_accuracy``. The same sweep into the same ``out``
    again continues it (see ``Sweep``)."""
    return prepare(config, grid, overrides, out, overwrite, seeds, target).run(quiet, log)


def prepare(config, grid: list[str], overrides: list[str] = (), out=None, overwrite: bool = False, seeds=None,
            target: float | None = None) -> "Sweep":
    """The sweep planned and checked whole before any run trains: every configuration as a run
    checks it before its workers start (the data and its limit, the model's probe, ...), and
    what is left to do of a sweep interrupted earlier in ``out``. Writes nothing."""
    from .session import check_run

    target = check_target(target, "--target")
    runs = plan(config, grid, overrides, seeds)
    root = sweep_root(out, load_config(config, list(overrides)).name, overwrite, runs)
    for run in runs:
        run.todo = "start" if overwrite else left_to_do(root / run.label, run.config)
    datasets = {}  # each dataset read once
    for run in runs:
        if run.todo != "finished":
            try:
                check_run(run.config, datasets)
            except FedsimError as e:
                raise type(e)(f"sweep run {run.label}: {e}") from None
    return Sweep(runs, root, seeds, target, named=out is not None)


@dataclass
class Sweep:
    """A planned sweep: its runs, its directory, and what is left to do of each run.

    ``sweep.json`` records what every run of the sweep is; the same sweep into the same
    directory again (the same command, with the same ``--out``) continues it: finished runs are
    kept, an interrupted one resumes from its checkpoint, the others start. ``sweep.csv`` (and
    ``runs.csv``) are rewritten after every run from the runs finished so far, so they never
    list a run that is not finished on disk."""

    runs: list[SweepRun]
    root: Path
    seeds: list[int] | None
    target: float | None
    named: bool  # the directory was given (--out): the same command continues the sweep

    def run(self, quiet: bool = False, log=None) -> list[SweepRun]:
        from ..execution.pool import PoolKeeper
        from ..results.progress import RoundLog
        from .launch import resume_run, start_run

        log, root, n = log or RoundLog(progress=False), self.root, len(self.runs)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(root, e) from None
        kept = [run for run in self.runs if run.todo == "finished"]
        resumes = any(run.todo == "resume" for run in self.runs)
        log(f"continuing the sweep in {root}: {len(kept)} of {n} runs finished" if kept or resumes
            else f"sweep of {n} runs into {root}")
        atomic_write_text(root / SWEEP_FILE, json.dumps({"runs": {run.label: identity(run.config)
                                                                  for run in self.runs}}, indent=1) + "\n")
        for run in kept:
            run.history = load_run(root / run.label)
        self._write_tables()
        with PoolKeeper() as pools:  # runs on the same device with as many workers share the workers
            for index, run in enumerate(self.runs, 1):
                if run.history is not None:
                    continue
                log(f"[{index}/{n}] {run.label}" + (" (resuming from its checkpoint)" if run.todo == "resume" else ""))
                try:
                    run.history = resume_run(root / run.label, placement(run.config), quiet=quiet, pools=pools) \
                        if run.todo == "resume" else start_run(run.config, out=root / run.label, overwrite=True,
                                                               quiet=quiet, pools=pools)
                except FedsimError as e:
                    raise type(e)(f"sweep run {run.label}: {e}") from None
                self._write_tables()
        log(_printable(format_table(self.runs, self.target)))
        log(f"runs, sweep.csv{' and runs.csv' if self.seeds is not None else ''} in {root}")
        return self.runs

    def _write_tables(self) -> None:
        """sweep.csv (and runs.csv) of the runs finished so far; none while no run is finished."""
        finished = [run for run in self.runs if run.history is not None]
        if not finished:
            for name in TABLES:
                try:
                    (self.root / name).unlink(missing_ok=True)
                except OSError as e:
                    raise write_error(self.root / name, e) from None
            return
        write_table(finished, self.root / "sweep.csv", self.target)
        if self.seeds is not None:
            write_csv(self.root / "runs.csv", [_row(run, self.target, finished) for run in finished])

    def interrupted_message(self) -> str:
        """What an interrupted sweep left, read from the disk, and how to continue it."""
        finished = sum(run.history is not None for run in self.runs)
        again = "run the same command again" if self.named else f"run the same command with --out {self.root}"
        tables = [name for name in TABLES if (self.root / name).is_file()]
        if not finished or not tables:
            return f"sweep interrupted before any run finished; {again} to continue it"
        return (f"sweep interrupted; {finished} of {len(self.runs)} runs finished, tabled in "
                f"{' and '.join(str(self.root / name) for name in tables)}; {again} to continue it")


TABLES = ("sweep.csv", "runs.csv")


def configurations(runs: list[SweepRun]) -> list[list[SweepRun]]:
    """The runs grouped by configuration (the seeds of a grid point), in the order of the sweep."""
    groups: dict[str, list[SweepRun]] = {}
    for run in runs:
        groups.setdefault(run.configuration, []).append(run)
    return list(groups.values())


def _repeated(runs: list[SweepRun]) -> bool:
    return any(run.seed is not None for run in runs)


def _target(run: SweepRun, target: float | None) -> float | None:
    return target if target is not None else run.config.stop_at_accuracy


def _with_target(runs: list[SweepRun], target: float | None) -> bool:
    return any(_target(run, target) is not None for run in runs)


def _row(run: SweepRun, target: float | None, runs: list[SweepRun]) -> dict:
    """One run's row of sweep.csv (runs.csv under --seeds)."""
    h = run.history
    row = {"run": run.label, **dict(run.point), **({"seed": run.seed} if run.seed is not None else {}),
           "final_test_accuracy": h.final_accuracy, "best_test_accuracy": h.best_accuracy,
           "seconds_per_round": round(seconds_per_round(h), 4), "rounds": h.rows[-1]["round"] if h.rows else 0}
    if _with_epsilon(runs):
        row["epsilon"] = _blank(_epsilon(h))
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
    row = {"configuration": group[0].configuration, **dict(group[0].point),
           "seeds": " ".join(str(run.seed) for run in group), "runs": n,
           "final_test_accuracy": final, "final_test_accuracy_std": _blank(final_sd if n > 1 else None),
           "best_test_accuracy": best, "best_test_accuracy_std": _blank(best_sd if n > 1 else None),
           "seconds_per_round": round(mean_and_sd(seconds_per_round(h) for h in histories)[0], 4)}
    if _with_epsilon(runs):
        row["epsilon"] = _blank(_mean_epsilon(histories))
    if _with_target(runs, target):
        stats = target_stats(histories, _target(group[0], target))
        reached = stats["reached"] or 0
        row |= {"target": _blank(stats["target"]),
                "rounds_to_target": _blank(stats["rounds_to_target"] if reached else None),
                "rounds_to_target_std": _blank(stats["rounds_to_target_std"] if reached > 1 else None),
                "reached_target": _blank(stats["reached"])}
    return row


def _epsilon(history: History) -> float | None:
    """The privacy a run spent (its last row's epsilon); None without a privacy section."""
    return history.rows[-1].get("epsilon") if history.rows and history.config.get("privacy") else None


def _mean_epsilon(histories: list[History]) -> float | None:
    """Over seeds: the same unless some stopped early (stop_at_accuracy)."""
    values = [_epsilon(h) for h in histories]
    return None if None in values else fmean(values)


def _with_epsilon(runs: list[SweepRun]) -> bool:
    return any(_epsilon(run.history) is not None for run in runs)


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
    """A fixed-width table: run, final and best test accuracy, the epsilon spent (runs with a
    privacy section), rounds to the target (where one is set), seconds per round. Under --seeds, one row per configuration: its number of seeds,
    then mean ± sample standard deviation over them, and the rounds to the target as
    ``mean ± sd (reached/seeds)`` over the seeds that reached it."""
    repeated = _repeated(runs)
    groups = configurations(runs) if repeated else [[run] for run in runs]
    columns = [("configuration" if repeated else "run", [g[0].configuration if repeated else g[0].label
                                                         for g in groups])]
    if repeated:
        columns.append(("seeds", [str(len(g)) for g in groups]))
    for title, value in (("final acc", lambda h: h.final_accuracy), ("best acc", lambda h: h.best_accuracy)):
        columns.append((title, [_accuracy([value(run.history) for run in g]) for g in groups]))
    if _with_epsilon(runs):
        epsilons = [_mean_epsilon([run.history for run in g]) for g in groups]
        columns.append(("epsilon", ["–" if e is None else f"{e:.3g}" for e in epsilons]))
    if _with_target(runs, target):
        goals = [_target(g[0], target) for g in groups]
        stats = [target_stats([run.history for run in g], goal) for g, goal in zip(groups, goals)]
        cells = ["–" if s["target"] is None else format_rounds_to_target(s) for s in stats]
        if len(set(goals)) == 1:
            columns.append((f"rounds to {goals[0]:g}", cells))
        else:
            columns += [("target", ["–" if goal is None else f"{goal:g}" for goal in goals]),
                        ("rounds to target", cells)]
    columns.append(("s/round", [f"{mean_and_sd(seconds_per_round(run.history) for run in g)[0]:.2f}"
                                for g in groups]))
    widths = [max(len(title), *(len(cell) for cell in cells)) for title, cells in columns]
    lines = []
    for row in [[title for title, _ in columns], *zip(*(cells for _, cells in columns))]:
        lines.append("  ".join(f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def _printable(text: str) -> str:
    """The table as the terminal can show it: ``+/-`` for ``±`` where the output's encoding
    (ASCII, say) has no such character, rather than failing once every run is done."""
    try:
        text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
        return text
    except (UnicodeEncodeError, LookupError):
        return text.replace("±", "+/-").replace("–", "-")


def _accuracy(values: list[float]) -> str:
    """One run's accuracy, or the mean ± sample standard deviation of several."""
    mean, sd = mean_and_sd(values)
    return f"{mean:.4f}" if len(values) == 1 else f"{mean:.4f} ± {sd:.4f}"
