"""A sweep's directory: what each of its runs is (``sweep.json``), and what is left to do of a
sweep interrupted earlier, so that the same sweep into the same directory continues it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml

from ..core.errors import FedsimError, write_error
from ..core.overrides import with_keys_added_since
from ..experiment.config import Config
from ..experiment.validation import load_config
from ..results.keys import PLACEMENT_KEYS, flatten_config
from ..results.rundir import FLAGS, RUN_FILES, RunDirectory, read_mapping

SWEEP_FILE = "sweep.json"  # what each run of the sweep is, so that the same sweep continues it
TABLES = ("sweep.csv", "runs.csv", "pivot.csv")  # the tables a sweep writes beside its runs


def identity(cfg: Config) -> str:
    """What a run computes: its config but for where and how fast it runs."""
    return yaml.safe_dump({k: v for k, v in flatten_config(cfg.to_dict()) if k not in PLACEMENT_KEYS}, sort_keys=True)


def placement(cfg: Config) -> dict:
    """The keys of where and how fast ``cfg`` runs, for a resumed run to take from the sweep."""
    return {k: v for k, v in flatten_config(cfg.to_dict()) if k in PLACEMENT_KEYS}


def sweep_root(
    out: str | os.PathLike | None, name: str, overwrite: bool, runs: list, spelled: tuple[str, str] = FLAGS
) -> Path:
    """The sweep's directory: a new one, or ``out``, which must be empty (or replaced, with
    ``overwrite``) or hold this same sweep, to be continued. ``spelled``: how the caller names
    ``out`` and ``overwrite`` (the command's flags or fedsim.sweep's arguments)."""
    if out is not None and not overwrite and (Path(out) / SWEEP_FILE).is_file():
        recorded = _computed(read_mapping(Path(out) / SWEEP_FILE, json.loads).get("runs"))
        planned = _computed({run.label: identity(run.config) for run in runs})
        if recorded != planned:
            flag, overwriting = spelled
            again = "give the command" if spelled == FLAGS else "call fedsim.sweep with the arguments"
            raise FedsimError(
                f"{flag} {out}: holds another sweep ({_difference(recorded, planned)}); {again} that "
                f"started it to continue it, {overwriting} to replace it, or another {flag}"
            )
        return Path(out)
    return RunDirectory.target(out, f"{name}-sweep", overwrite, spelled)


def _computed(runs: object) -> dict:
    """sweep.json's runs (label: ``identity``) as what each computes, a mapping of its keys, those
    added to fedsim since the sweep was recorded at their defaults; an unreadable record as {}."""
    if not isinstance(runs, dict):
        return {}
    defaults, computed = yaml.safe_load(identity(Config())), {}
    for label, text in runs.items():
        try:
            keys = yaml.safe_load(text) if isinstance(text, str) else None
        except yaml.YAMLError:
            keys = None
        computed[label] = with_keys_added_since(keys, defaults) if isinstance(keys, dict) else text
    return computed


def _difference(recorded: dict, planned: dict) -> str:
    label = next(label for label in [*planned, *recorded] if recorded.get(label) != planned.get(label))
    if label not in recorded or label not in planned:
        return f"{label} is a run of {'this sweep' if label in planned else 'that sweep'} only"
    before, now = recorded[label], planned[label]
    if not isinstance(before, dict):
        return f"its run {label} is recorded unreadably"
    key = next(k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k))
    return f"its run {label} has {key}: {before.get(key)!r}, this one {now.get(key)!r}"


def left_to_do(path: Path, cfg: Config) -> str:
    """What the run of ``cfg`` in ``path`` needs: ``finished`` (kept as it is), ``resume`` (from
    its checkpoint) or ``start`` (nothing of this configuration is there)."""
    try:
        if identity(load_config(path / "config.yaml")) != identity(cfg):
            return "start"  # left by the sweep that --overwrite replaced
        summary = read_mapping(path / "summary.json", json.loads)
    except FedsimError:
        return "start"  # none yet, or unreadable
    if summary.get("status") == "finished":
        return "finished"
    return "resume" if (path / "checkpoint.pt").is_file() else "start"


def clear_for_overwrite(root: Path) -> None:
    """What ``--overwrite`` replaces in ``root`` before a sweep starts there: an earlier sweep's
    runs (those its sweep.json lists) and tables, or a run's own files; nothing else the folder
    holds, so that nothing of theirs is read with the new sweep's runs (``fedsim plot root/*``)."""
    try:
        recorded = read_mapping(root / SWEEP_FILE, json.loads).get("runs")
    except FedsimError:  # none, or unreadable: no runs of an earlier sweep are known
        recorded = None
    try:
        for label in recorded if isinstance(recorded, dict) else {}:
            if (root / label / "config.yaml").is_file() and (root / label).resolve().parent == root.resolve():
                shutil.rmtree(root / label)
        for name in (*TABLES, SWEEP_FILE, *RUN_FILES):
            (root / name).unlink(missing_ok=True)
    except OSError as e:
        raise write_error(root, e) from None
