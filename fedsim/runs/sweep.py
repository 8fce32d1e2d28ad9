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
they also report the rounds to it over the seeds that reached it, and how many did. A sweep of
language models' runs also reports the final and best (lowest) test perplexity.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import numbers
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError, DataError, FedsimError, UnguardedScript, plural, shown, write_error
from ..core.files import atomic_write_text
from ..core.overrides import overlap
from ..experiment.config import Config
from ..experiment.validation import load_config
from ..results.history import check_target, load_run
from ..results.rundir import ARGUMENTS, FLAGS, safe_dir_name
from .sweepdir import SWEEP_FILE, TABLES, clear_for_overwrite, identity, left_to_do, placement, sweep_root
from .sweepgrid import grid_axes, set_keys
from .sweepruns import SweepRun, _printable, _row, format_pivot, format_table, write_csv, write_pivot, write_table

logger = logging.getLogger("fedsim")


def parse_seeds(seeds: str | Iterable[int], source: str = "--seeds") -> list[int]:
    """``"0,1,2"`` (or a list of integers) -> ``[0, 1, 2]``; ``source`` names them in an error
    (``--seeds``, or the experiment file's ``sweep.seeds``)."""
    if isinstance(seeds, str):
        try:
            values = [int(text.strip()) for text in seeds.split(",")]
        except ValueError:
            raise ConfigError(f"{source} {seeds}: expected integers separated by commas, e.g. 0,1,2") from None
    else:
        if isinstance(seeds, (dict, set)) or not isinstance(seeds, Iterable):
            raise ConfigError(f"{source}: expected a list of integers or a string such as 0,1,2, got {shown(seeds)}")
        values = list(seeds)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{source} {values}: expected integers, e.g. [0, 1, 2]")
        values = [int(v) for v in values]
    if not values:
        raise ConfigError(f"{source}: give at least one seed, e.g. 0,1,2")
    if len(set(values)) < len(values):
        raise ConfigError(f"{source} {','.join(map(str, values))}: a seed is listed twice; list each once")
    return values


def run_label(name: str, point: list[tuple[str, str]]) -> str:
    return safe_dir_name("-".join([name] + [f"{key}={value}" for key, value in point]))


def plan(
    config: str | os.PathLike | dict | Config,
    grid: list[str],
    overrides: list[str] = (),
    seeds: str | Iterable[int] | None = None,
) -> list[SweepRun]:
    """One validated Config per grid point (and per seed of ``seeds``): the file, then
    ``overrides``, then the point, then the seed. Without ``seeds`` a run is named after its
    point; with them the runs of a point share the point's name, and their directories end in
    ``-seed=S``."""
    return _planned(config, grid, overrides, seeds)[0]


def _planned(
    config: str | os.PathLike | dict | Config, grid: list[str], overrides: list[str], seeds: str | Iterable[int] | None
) -> tuple[list[SweepRun], str]:
    """``plan``'s runs, and the sweep's name (its configuration's, which its runs' names begin with)."""
    axes, file_seeds, where = grid_axes(config, grid)
    if seeds is not None:
        seeds = parse_seeds(seeds)
    elif file_seeds is not None:
        seeds = parse_seeds(file_seeds, f"{where}: sweep.seeds")
    if not axes and seeds is None:
        raise ConfigError(
            "give at least one --grid KEY=V1,V2,... or --seeds S1,S2,..., e.g. --grid aggregator=fedavg,median "
            "or --seeds 0,1,2 (or a sweep section in the experiment file)"
        )
    seeded = next((key for key, values in axes if any(overlap("seed", k) for k in set_keys(values))), None)
    if seeds is not None and seeded is not None:
        other = "--grid seed=..." if seeded == "seed" else f"the axis {seeded}"
        raise ConfigError(
            f"--seeds and {other} both give seeds; use --seeds to repeat every configuration under each seed, "
            "or --grid seed=... to sweep the seed as a setting"
        )
    _warn_lost_overrides(axes, seeds, list(overrides))
    base = base_config(config, overrides, axes)
    keys = {(key, text): set_keys([(text, settings)]) for key, values in axes for text, settings in values}
    name, blame = base.name, Blame(keys, base.origin[0])
    runs, seen = [], {}
    for values in itertools.product(*(choices for _, choices in axes)):
        point = [(key, text) for (key, _), (text, _) in zip(axes, values)]
        sets = [item for _, settings in values for item in settings]
        configuration = run_label(name, point)
        for seed in seeds if seeds is not None else [None]:
            repeat = [] if seed is None else [f"seed={seed}"]
            try:
                cfg = load_config(config, [*overrides, *sets, *repeat])
            except ConfigError as e:
                raise blame(e, point, seed) from None
            same = seen.setdefault(repr(cfg.to_dict()), point)  # 0.1 and 0.10 are one value
            if same is not point:
                raise ConfigError(
                    f"--grid: {_spelled(same)} and {_spelled(point)} are the same experiment; list each value once"
                )
            cfg.name = configuration
            label = configuration if seed is None else run_label(name, [*point, ("seed", str(seed))])
            runs.append(SweepRun(label, point, cfg, seed=seed, configuration=configuration, blame=blame))
    labels = [run.label for run in runs]
    if len(set(labels)) < len(labels):
        raise ConfigError("--grid: two grid points give the same run name; make the values distinct")
    return runs, name


def base_config(config: str | os.PathLike | dict | Config, overrides: list[str], axes: list) -> Config:
    """What the grid points start from: the file with the overrides; or, where that alone is
    refused and the grid replaces it (a rule with options only its axis gives), the file with the
    first grid point, so that a sweep of valid points is not refused for a configuration none of
    them runs."""
    try:
        return load_config(config, list(overrides))
    except ConfigError as refused:
        first = [item for _, values in axes for item in values[0][1]]
        if first:
            try:
                return load_config(config, [*overrides, *first])
            except ConfigError:
                pass
        raise refused from None


def _warn_lost_overrides(axes: list, seeds: list[int] | None, overrides: list[str]) -> None:
    """A ``--set`` of a key that an axis (or ``--seeds``) sets is replaced in every run, the point
    being applied after the overrides: said once, since it may be there only to make the file's
    configuration whole (a privacy section that needs its noise_multiplier)."""
    given = set_keys([("--set", overrides)])
    swept = [(key, set_keys(values)) for key, values in axes] + ([("--seeds", {"seed"})] if seeds is not None else [])
    for key in sorted(given):
        axis = next((axis for axis, keys in swept if any(overlap(key, k) for k in keys)), None)
        if axis == "--seeds":
            logger.warning(f"--set {key}: --seeds gives every run its seed in its place")
        elif axis is not None:
            logger.warning(f"--set {key}: the grid's axis {axis} sets it in every run, in its place")


@dataclass
class Blame:
    """Names an error found in checking a grid point by the grid values it came from, as the
    user gave them, since the run's overrides say ``--set`` of keys the user never set: a key
    that one axis (or --seeds) sets is named by that axis's value, ``--grid key=value`` (``--grid
    rule=gm (aggregator_options)`` where the key differs), and any other error by the whole
    point, ``--grid attack.count=20 --grid data.gamma=0: byzfl.yaml: aggregator_options: ...``."""

    keys: dict[tuple[str, str], set[str]]  # the keys each value of each axis sets
    origin: str  # the configuration's file (or "config"), as errors name it

    def __call__(self, error: FedsimError, point: list[tuple[str, str]], seed: int | None) -> FedsimError:
        keys = set().union(*(self.keys.get(value) or {value[0]} for value in point))
        if isinstance(error, DataError) and error.missing and not any(overlap("data", k) for k in keys):
            return error  # files missing whatever the point: the sweep's data, not one of its values
        text = str(error)
        source = "--set " if text.startswith("--set ") else f"{self.origin}: "
        named, colon, rest = text.removeprefix(source).partition(":")
        flags = [(f"--grid {key}={value}", key, self.keys.get((key, value)) or {key}) for key, value in point]
        if seed is not None:
            flags.append((f"--seeds {seed}", "seed", {"seed"}))
        blamed = [(flag, key) for flag, key, keys in flags if any(overlap(named, k) for k in keys)]
        if text.startswith(source) and colon and " " not in named and len(blamed) == 1:
            flag, key = blamed[0]
            given = f"{flag}{'' if key == named else f' ({named})'}{colon}{rest}"
        else:  # no one value makes the error (several do, or one with the file's): the whole point
            given = f"{' '.join(flag for flag, _, _ in flags[: len(point)] or flags)}: {text}"
        return reworded(error, given)


def reworded(error: FedsimError, text: str) -> FedsimError:
    """``error`` saying ``text``: its class and attributes (a DataError's ``missing``) kept."""
    renamed = copy.copy(error)
    renamed.args = (text,)
    return renamed


def _spelled(point: list[tuple[str, str]]) -> str:
    return ",".join(f"{key}={value}" for key, value in point)


def sweep(
    config: str | os.PathLike | dict | Config,
    grid: list[str] | str,
    overrides: list[str] | str = (),
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    log: Callable[[str], None] | None = None,
    seeds: str | Iterable[int] | None = None,
    target: float | None = None,
    pivot: str | tuple[str, str] | None = None,
) -> list[SweepRun]:
    """Run every grid point of ``config`` (under every seed of ``seeds``) into ``out`` (default
    ``runs/<name>-sweep-<timestamp>``), as ``fedsim sweep`` does: ``grid`` and ``overrides`` as
    its ``--grid`` and ``--set`` take them (``["aggregator=median,krum", "attack.count=1,2"]``,
    ``["rounds=20"]``; one string is one of them), ``seeds`` as ``--seeds`` (``"0,1,2"`` or a
    list). Return the runs, each with its ``history`` (``results_table`` and ``plot_runs`` take
    them as they are), and write
    ``out/sweep.csv`` (with ``seeds``, one row per configuration, and ``out/runs.csv``, one per
    run). ``target``: report the rounds to this test accuracy (a fraction; the runs go on),
    instead of each configuration's ``stop_at_accuracy``. ``pivot``: ``"ROW,COLUMN"``, two grid
    keys (e.g. ``"aggregator,attack.type"``): also print the final accuracy with ROW's values down
    and COLUMN's across, and write it to ``out/pivot.csv``. The same sweep into the same ``out``
    again continues it (see ``Sweep``). A script that runs one with workers calls it under
    ``if __name__ == "__main__":``, as it does ``fedsim.run``."""
    from .launch import refuse_in_a_worker

    refuse_in_a_worker()
    if not isinstance(config, (str, os.PathLike, dict, Config)):
        raise ConfigError(
            f"config: expected an experiment file, a shipped experiment's name, a dict or a Config, got {shown(config)}"
        )
    grid, overrides = _texts("grid", grid, "aggregator=fedavg,median"), _texts("overrides", overrides, "rounds=20")
    if isinstance(pivot, (list, tuple)):
        pivot = ",".join(map(str, pivot))
    # checked here first, to be named as this call names them
    seeds, target = (parse_seeds(seeds, "seeds") if seeds is not None else None), check_target(target)
    try:
        planned = prepare(config, grid, overrides, out, overwrite, seeds, target, pivot, spelled=ARGUMENTS)
        try:
            return planned.run(quiet, log)
        except KeyboardInterrupt:  # said where the sweep's lines go; the caller's Ctrl-C still stops it
            from ..results.progress import RoundLog

            (log or RoundLog(progress=False))(planned.interrupted_message(in_python=True))
            raise
    except UnguardedScript as e:
        raise SystemExit(f"fedsim: error: {e}") from None  # one line: the script cannot work as it is


def _texts(name: str, value: object, example: str) -> list[str]:
    """``grid`` or ``overrides`` of the Python call: strings as the command line's flags take them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{name}: expected a list of strings such as [{example!r}], got {shown(value)}")


def prepare(
    config: str | os.PathLike | dict | Config,
    grid: list[str],
    overrides: list[str] = (),
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    seeds: str | Iterable[int] | None = None,
    target: float | None = None,
    pivot: str | None = None,
    spelled: tuple[str, str] = FLAGS,
) -> Sweep:
    """The sweep planned and checked whole before any run trains: every configuration as a run
    checks it before its workers start (the data and its limit, the model's probe, ...), and
    what is left to do of a sweep interrupted earlier in ``out``. Writes nothing. ``spelled``:
    how the caller names ``out`` and ``overwrite``."""
    from .parts import check_run

    target = check_target(target, "--target")
    runs, name = _planned(config, grid, overrides, seeds)
    pivoted = parse_pivot(pivot, [key for key, _ in runs[0].point] if runs else [])
    root = sweep_root(out, name, overwrite, runs, spelled)
    for run in runs:
        run.todo = "start" if overwrite else left_to_do(root / run.label, run.config)
    datasets = {}  # each dataset read once
    for run in runs:
        if run.todo != "finished":
            try:
                check_run(run.config, datasets)
            except FedsimError as e:
                raise run.blame(e, run.point, run.seed) from None
    repeats = list(dict.fromkeys(run.seed for run in runs)) if runs and runs[0].seed is not None else None
    return Sweep(runs, root, repeats, target, named=out is not None, pivot=pivoted, replace=overwrite)


def parse_pivot(pivot: str | None, keys: list[str]) -> tuple[str, str] | None:
    """``"ROW,COLUMN"``: two distinct keys of the grid."""
    if pivot is None:
        return None
    parts = [part.strip() for part in str(pivot).split(",")]
    grid = ", ".join(keys) if keys else "none"
    if len(parts) != 2 or parts[0] == parts[1] or not all(parts):
        raise ConfigError(f"--pivot: give two grid keys as ROW,COLUMN (e.g. aggregator,attack.type), got {pivot!r}")
    for part in parts:
        if part not in keys:
            raise ConfigError(f"--pivot: {part} is not a --grid key of this sweep; its grid keys: {grid}")
    return parts[0], parts[1]


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
    pivot: tuple[str, str] | None = None  # (row key, column key) of the pivot table, or None
    replace: bool = False  # --overwrite: what an earlier sweep or run left in the directory goes first

    def run(self, quiet: bool = False, log: Callable[[str], None] | None = None) -> list[SweepRun]:
        from ..execution.pool import PoolKeeper
        from ..results.progress import RoundLog, said_once
        from .launch import resume_run, start_run

        log, root, n = log or RoundLog(progress=False), self.root, len(self.runs)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(root, e) from None
        if self.replace:
            clear_for_overwrite(root)
        kept = [run for run in self.runs if run.todo == "finished"]
        resumes = any(run.todo == "resume" for run in self.runs)
        log(
            f"continuing the sweep in {root}: {len(kept)} of {n} runs finished"
            if kept or resumes
            else f"sweep of {plural(n, 'run')} into {root}"
        )
        atomic_write_text(
            root / SWEEP_FILE,
            json.dumps({"runs": {run.label: identity(run.config) for run in self.runs}}, indent=1) + "\n",
        )
        for run in kept:
            run.history = load_run(root / run.label)
        self._write_tables()
        # runs on the same device with as many workers share the workers; a warning or hint is said once
        with PoolKeeper() as pools, said_once():
            for index, run in enumerate(self.runs, 1):
                if run.history is not None:
                    continue
                log(f"[{index}/{n}] {run.label}" + (" (resuming from its checkpoint)" if run.todo == "resume" else ""))
                try:
                    run.history = (
                        resume_run(root / run.label, placement(run.config), quiet=quiet, pools=pools)
                        if run.todo == "resume"
                        else start_run(run.config, out=root / run.label, overwrite=True, quiet=quiet, pools=pools)
                    )
                except UnguardedScript:
                    raise  # the script's, not this run's
                except FedsimError as e:
                    raise reworded(e, f"sweep run {run.label}: {e}") from None
                run.todo = "finished"
                self._write_tables()
        log(_printable(format_table(self.runs, self.target)))
        if self.pivot:
            log(_printable(format_pivot(self.runs, *self.pivot)))
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
        if self.pivot:
            write_pivot(finished, *self.pivot, self.root / "pivot.csv")

    def interrupted_message(self, in_python: bool = False) -> str:
        """What an interrupted sweep left, read from the disk, and how to continue it: with the same
        command, or (``in_python``) the same call of ``fedsim.sweep``."""
        finished = sum(run.history is not None for run in self.runs)
        if in_python:
            again = "call fedsim.sweep again" + (
                " with the same arguments" if self.named else f" with out={str(self.root)!r}"
            )
        else:
            again = "run the same command again" if self.named else f"run the same command with --out {self.root}"
        tables = [name for name in TABLES if (self.root / name).is_file()]
        if not finished or not tables:
            return f"sweep interrupted before any run finished; {again} to continue it"
        return (
            f"sweep interrupted; {finished} of {len(self.runs)} runs finished, tabled in "
            f"{' and '.join(str(self.root / name) for name in tables)}; {again} to continue it"
        )
