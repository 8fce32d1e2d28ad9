"""Starting and resuming runs: ``fedsim.run``, ``fedsim.resume`` and what the command line's
``run`` calls, on every rank."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import ConfigError, FedsimError, UnguardedScript, explain_resource_error
from ..core.overrides import overlap, with_keys_added_since
from ..execution.distributed import Ranks, RankStopped
from ..execution.pool import PoolKeeper
from ..execution.processes import UNGUARDED_SCRIPT, in_worker_start, start_fork_server, worker_imports
from ..execution.resources import keep_freed_memory
from ..experiment import components
from ..experiment.config import SECTIONS, Config, apply_overrides, directory_name, save_config
from ..experiment.reading import locate
from ..experiment.validation import load_config
from ..results.history import History
from ..results.keys import RESUMABLE_KEYS, flatten_config
from ..results.progress import RoundLog, console_logging
from ..results.rundir import ARGUMENTS, FLAGS, RunDirectory, read_mapping
from .session import Session, run_identity, started_with


def run(
    config: str | os.PathLike | dict | Config = "mnist_seed",
    *,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    progress: bool | None = None,
    callbacks: Iterable[object] = (),
    **overrides: Any,
) -> History:
    """Run an experiment and return its History.

    ``config`` is a YAML path, the name of a shipped experiment (``fedsim list``), a dict or
    a Config; ``overrides`` set keys, dotted ones via
    ``**{"local.lr": 0.05}`` or whole sections as dicts (``data={"limit": 2000}``); ``model``,
    ``aggregator``, ``algorithm`` and ``dataset`` may be objects of your own (see
    components.py). Files go to ``out`` (default ``runs/<name>-<timestamp>``). ``progress``:
    show the rounds as one updating line (None: only on a terminal); ``quiet``: print no
    per-round lines; ``callbacks``: observers of the run (see callbacks.py).
    """
    refuse_in_a_worker()
    cfg = load_config(config, _with_dataset_key(overrides))
    try:
        return start_run(
            cfg, out=out, overwrite=overwrite, quiet=quiet, progress=progress, callbacks=callbacks, spelled=ARGUMENTS
        )
    except UnguardedScript as e:
        raise SystemExit(f"fedsim: error: {e}") from None  # one line: the script cannot work as it is


def resume(
    run_dir: str | os.PathLike,
    *,
    quiet: bool = False,
    progress: bool | None = None,
    callbacks: Iterable[object] = (),
    **overrides: Any,
) -> History:
    """Continue a run from its last checkpoint; ``rounds=N`` extends it. A component that was
    given as an object (defined in a notebook, say) is given again the same way."""
    refuse_in_a_worker()
    try:
        return resume_run(run_dir, _with_dataset_key(overrides), quiet=quiet, progress=progress, callbacks=callbacks)
    except UnguardedScript as e:
        raise SystemExit(f"fedsim: error: {e}") from None


def refuse_in_a_worker() -> None:
    """A worker starting up imports the script that started the run; if the script calls
    fedsim.run at its top level, the call comes here in the worker, which then ends at once and
    quietly, with a status that the server turns into one line naming the guard."""
    if in_worker_start():
        os._exit(UNGUARDED_SCRIPT)


def _with_dataset_key(overrides: dict) -> dict:
    """``dataset=`` is short for ``data={"dataset": ...}``."""
    if "dataset" in overrides:
        overrides = {**overrides, "data.dataset": overrides["dataset"]}
        del overrides["dataset"]
    return overrides


def start_run(
    cfg: Config,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    progress: bool | None = None,
    callbacks: Iterable[object] = (),
    ranks: Ranks | None = None,
    pools: PoolKeeper | None = None,
    spelled: tuple[str, str] = FLAGS,
) -> History:
    """Run ``cfg`` into ``out`` (default ``runs/<name>[-<overrides>]-<timestamp>``, see
    config.directory_name); on ranks other than 0
    (see distributed.py) only train. ``pools``: a PoolKeeper whose workers the run may use
    (execution/pool.py). ``spelled``: how the caller names ``out`` and ``overwrite``."""
    ranks = ranks or Ranks()
    # before loading anything
    path = RunDirectory.target(out, directory_name(cfg), overwrite, spelled) if ranks.is_root else None
    session = _setup(cfg, quiet, progress, callbacks, ranks, pools)
    if not ranks.is_root:
        return session.run(None)
    try:
        run_dir = RunDirectory.create(path, overwrite)
        try:
            save_config(session.cfg, run_dir.path / "config.yaml")
        except BaseException:
            run_dir.unlock()
            raise
    except BaseException:
        session.executor.close()
        raise
    return session.run(run_dir)


def resume_run(
    run_dir: str | os.PathLike,
    overrides: list[str] | dict | None = None,
    quiet: bool = False,
    progress: bool | None = None,
    callbacks: Iterable[object] = (),
    ranks: Ranks | None = None,
    pools: PoolKeeper | None = None,
) -> History | None:
    """Continue ``run_dir`` from its checkpoint; ``overrides`` is a list of "key=value"
    strings (the CLI's --set) or a dict, limited to keys that keep it one run (and to the
    components of the run, given again as objects). Rank 0 reads the run directory; the other
    ranks receive what they need from it. ``pools``: as for start_run."""
    ranks = ranks or Ranks()
    path = Path(run_dir)
    directory = RunDirectory(path)
    loaded = {}

    def load() -> Config | None:
        if not (path / "config.yaml").is_file():
            raise FedsimError(f"--resume {path}: not a run directory (no config.yaml)")
        asked = _resumable(path, overrides)
        directory.lock()  # a second resume of the same directory is refused, not interleaved
        try:
            state = directory.load_checkpoint()
            cfg = load_config(path / "config.yaml", overrides)
            _check_same_run(path, state, cfg, asked)
            directory.check_in_step(state)
            loaded.update(state=state, rows=directory.rows(), cfg=cfg)
        except BaseException:
            directory.unlock()
            raise
        if state["round"] > cfg.rounds or (state["round"] == cfg.rounds and _ended(path, state)):
            print(f"{path}: already at round {state['round']} of {cfg.rounds}; nothing to do (--set rounds=N)")
            directory.unlock()
            return None
        return cfg  # at its last round without its summary (killed after the checkpoint): the session writes it

    cfg = agree_on_config(ranks, load)
    if cfg is None:
        return History(loaded["rows"], loaded["cfg"].to_dict(), path) if ranks.is_root else None
    try:
        started = started_with(loaded["state"], path) if ranks.is_root else {}  # the header shows them again
        session = _setup(cfg, quiet, progress, callbacks, ranks, pools, started)
    except BaseException:
        if ranks.is_root:
            directory.unlock()
        raise
    if not ranks.is_root:
        return session.run(None)
    try:
        # rows after the checkpoint happened after it, and are dropped (the rounds run again)
        state = loaded["state"]
        session.restore(state, [r for r in loaded["rows"] if r["round"] <= state["round"]], path / "checkpoint.pt")
        save_config(session.cfg, path / "config.yaml")
    except BaseException:
        directory.unlock()
        session.executor.close()
        raise
    return session.run(directory)


def _ended(path: Path, state: dict) -> bool:
    """Whether the run wrote its summary.json and plot after the checkpoint ``state``: a run killed
    between its last checkpoint and them has none, or an earlier run's (before a resume that extended it)."""
    summary = read_mapping(path / "summary.json", json.loads)
    return summary.get("status") == "finished" and summary.get("checkpoint_round") == state["round"]


def agree_on_config(ranks: Ranks, load: Callable[[], Config | None]) -> Config | None:
    """The config of a run: rank 0's ``load()`` (None: nothing to run); the other ranks receive
    it. If loading fails on rank 0, the others stop quietly and rank 0 says why."""
    if not ranks.several:
        return load()
    if ranks.is_root:
        try:
            cfg = load()
        except BaseException:
            ranks.decide(("stop", None), "sharing the config")
            raise
        ranks.decide(("run", cfg.to_dict()) if cfg is not None else ("done", None), "sharing the config")
        return cfg
    kind, values = ranks.decide(None, "sharing the config")
    if kind == "stop":
        raise RankStopped("")
    return load_config(values) if kind == "run" else None


def _resumable(path: Path, overrides: list[str] | dict | None) -> set[str]:
    """The keys a resume sets: each must be one that a resume may change, or keep the value the run
    has (else one line)."""
    given: dict = {}
    spelled = apply_overrides(given, overrides or {}, sections=SECTIONS)
    fixed = set(spelled) - RESUMABLE_KEYS - set(components.KEYS)
    if fixed:
        # both with the components given again (a class of the user's script is recorded by name only)
        again = {key: value for key, value in flatten_config(given) if key in components.KEYS}
        before = dict(flatten_config(load_config(path / "config.yaml", again).to_dict()))
        broken = None
        try:
            after = dict(flatten_config(load_config(path / "config.yaml", overrides).to_dict()))
        except ConfigError as error:  # a change that breaks the run's config is, first, a change a resume refuses
            after, broken = {**before, **dict(flatten_config(given))}, error
        changed = sorted(
            key
            for key in set(before) | set(after)
            if _part_of(key, fixed) and key not in components.KEYS and before.get(key) != after.get(key)
        )
        if changed:
            asked = next(k for k in sorted(fixed) if _part_of(changed[0], {k}))
            raise ConfigError(
                f"{spelled[asked]} {changed[0]}: cannot change when resuming (the rounds before and after "
                f"would not be one run); allowed: {', '.join(sorted(RESUMABLE_KEYS))}"
            )
        if broken:
            raise broken
    return set(spelled)


def _part_of(key: str, keys) -> bool:
    """Whether ``key`` is one of ``keys``, a part of one's mapping, or the mapping one is part of
    (mapping values are flattened: aggregator_options.beta, system.speed.lognormal)."""
    return any(overlap(key, r) for r in keys)


def _check_same_run(path: Path, state: dict, cfg: Config, asked=frozenset()) -> None:
    """The config to resume with must be the one that wrote the checkpoint, but for the keys a
    resume may change; ``asked``: the keys the user set for this resume (the others come from
    config.yaml)."""
    planned = read_mapping(path / "config.yaml", yaml.safe_load).get("rounds")
    if cfg.local.lr_schedule == "cosine" and "rounds" in asked and cfg.rounds != planned:
        raise ConfigError(
            f"--set rounds={cfg.rounds}: cannot change when resuming; {path} anneals its learning rate over "
            f"its {planned} rounds (local.lr_schedule: cosine), and the rounds before and after would not be one run"
        )
    identity = state.get("config")
    if not isinstance(identity, str):
        return  # a checkpoint from before runs recorded their identity
    before, now = yaml.safe_load(identity), yaml.safe_load(run_identity(cfg))

    before = with_keys_added_since(before, yaml.safe_load(run_identity(Config())))
    changed = sorted(k for k in set(before) | set(now) if before.get(k, "(unset)") != now.get(k, "(unset)"))
    if not changed:
        return
    key = changed[0]
    if _part_of(key, asked):
        raise ConfigError(
            f"--set {key}={now.get(key)!r}: cannot change when resuming; {path} ran with {key}: "
            f"{before.get(key)!r}, and the rounds before and after would not be one run"
        )
    raise ConfigError(
        f"{path}: config.yaml says {key}: {now.get(key)!r} but checkpoint.pt was written by a run "
        f"with {before.get(key)!r}; they are not one run (restore the matching file, or start a new run)"
    )


def _setup(
    cfg: Config,
    quiet: bool,
    progress: bool | None,
    callbacks=(),
    ranks: Ranks | None = None,
    pools=None,
    started: dict | None = None,
) -> Session:
    ranks = ranks or Ranks()
    log = RoundLog(progress, quiet=quiet or not ranks.is_root)
    keep_freed_memory()  # the server's stacks of updates, as the workers' (execution/resources.py)
    if cfg.workers != 0:  # the workers' imports, while the session loads the data
        start_fork_server(worker_imports(cfg.to_dict()))
    try:
        with console_logging(log):  # the session says what it loads and starts, as it starts
            session = Session(cfg, log=log, callbacks=callbacks, ranks=ranks, pools=pools, started=started)
    except FedsimError as e:
        raise locate(cfg, e) from None
    except (RuntimeError, OSError) as e:
        raise explain_resource_error(e) or e  # noqa: B904 (the same error, or one line that explains it)
    cfg.workers, cfg.device = session.workers, str(session.device)  # the resolved values, as they ran
    return session
