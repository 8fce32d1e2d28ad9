"""Run directories: resolved config, per-round metrics, summary, checkpoint, and History.

A run directory holds::

    config.yaml     the resolved configuration (what actually ran)
    metrics.csv     one row per evaluated round, written as the run goes
    clients.csv     one row per sampled client per round
    client_accuracy.csv  each client's test accuracy per evaluated round (eval_per_client)
    summary.json    final and best accuracy, rounds, wall time, device, workers
    accuracy.png    per-round test accuracy
    checkpoint.pt   the latest round's state, for --resume
"""
from __future__ import annotations

import csv
import errno
import glob
import hashlib
import json
import math
import os
import re
from datetime import datetime
from pathlib import Path
from statistics import fmean, stdev

from .errors import ConfigError, FedsimError, write_error
from .yamlfile import parse_yaml

COLUMNS = ("round", "test_accuracy", "test_loss", "train_loss", "seconds", "elapsed_seconds",
           "clients", "dropped_clients", "attackers", "train_seconds", "worker_seconds", "aggregate_seconds",
           "eval_seconds", "epsilon", "client_accuracy_mean", "client_accuracy_std", "client_accuracy_p10",
           "simulated_seconds", "unavailable", "stragglers")
# columns of what a run may leave off (privacy, eval_per_client), and columns that rows of an older
# version lack (a resumed run rewrites those rows): empty in metrics.csv, None in a History
OPTIONAL_COLUMNS = {"epsilon", "client_accuracy_mean", "client_accuracy_std", "client_accuracy_p10",
                    "simulated_seconds", "unavailable", "stragglers"}
_INT_COLUMNS = {"round", "clients", "dropped_clients", "attackers", "unavailable", "stragglers"}
RUN_FILES = ("config.yaml", "metrics.csv", "clients.csv", "client_accuracy.csv", "summary.json", "accuracy.png",
             "checkpoint.pt")


class History:
    """Per-round metrics of a run, one entry per evaluated round.

    Columns are attributes holding lists (``h.round``, ``h.test_accuracy``, ...); ``h.rows``
    holds the same as dicts, ``h.client_records`` one dict per sampled client per round (the
    rows of clients.csv), ``h.client_accuracy`` one dict per client per evaluated round (the rows
    of client_accuracy.csv, with eval_per_client), ``h.config`` the resolved config as a dict, ``h.summary`` the summary,
    ``h.run_dir`` where the files are.
    """

    def __init__(self, rows=None, config: dict | None = None, run_dir: Path | None = None,
                 summary: dict | None = None, client_records: list[dict] | None = None):
        self.rows: list[dict] = list(rows or [])
        self.config = config or {}
        self.run_dir = run_dir
        self.summary = summary or {}
        self._client_records = client_records
        self._client_accuracy = None

    def __getattr__(self, name):
        if name in COLUMNS:  # a column a run directory of an older version lacks reads as None
            return [row.get(name) for row in self.rows]
        raise AttributeError(name)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def client_records(self) -> list[dict]:
        """One dict per sampled client per round (read from clients.csv when first asked for)."""
        if self._client_records is None:
            path = self.run_dir / "clients.csv" if self.run_dir else None
            self._client_records = read_clients(path) if path and path.is_file() else []
        return self._client_records

    @property
    def client_accuracy(self) -> list[dict]:
        """The global model's accuracy on each client's test split, one dict (round, client,
        samples, accuracy) per client per evaluated round; [] for a run without eval_per_client.
        Read from client_accuracy.csv when first asked for."""
        if self._client_accuracy is None:
            path = self.run_dir / "client_accuracy.csv" if self.run_dir else None
            self._client_accuracy = read_client_accuracy(path) if path and path.is_file() else []
        return self._client_accuracy

    def to_pandas(self, clients: bool = False):
        """The rows (or, with ``clients=True``, the per-client rows) as a pandas DataFrame."""
        try:
            import pandas
        except ImportError:
            raise FedsimError("History.to_pandas needs pandas: pip install pandas") from None
        return pandas.DataFrame(self.client_records if clients else self.rows)

    @property
    def name(self) -> str:
        return self.config.get("name") or (self.run_dir.name if self.run_dir else "run")

    def config_value(self, key: str):
        """The value of a config key, dotted for sections (``"data.alpha"``)."""
        if key == "name":
            return self.name
        value = self.config
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise FedsimError(f"{key}: not a config key of run {self.name!r}")
            value = value[part]
        return value

    @property
    def final_accuracy(self) -> float:
        return self.rows[-1]["test_accuracy"] if self.rows else math.nan

    @property
    def best_accuracy(self) -> float:
        return max(self.test_accuracy, default=math.nan)

    def __repr__(self) -> str:
        where = f" in {self.run_dir}" if self.run_dir else ""
        return (f"History({self.name!r}: {len(self.rows)} evaluated rounds, "
                f"final accuracy {self.final_accuracy:.4f}{where})")


def load_run(run_dir: str | os.PathLike) -> History:
    """The metrics, config and summary of a run directory (finished or not)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FedsimError(f"{path}: no such run directory")
    if not (path / "metrics.csv").is_file():
        raise FedsimError(f"{path}: not a run directory (no metrics.csv)")
    config = _read_optional(path / "config.yaml", _yaml_mapping)
    summary = _read_optional(path / "summary.json", json.loads)
    return History(read_metrics(path / "metrics.csv"), config, path, summary)


def load_runs(pattern: str | os.PathLike) -> list[History]:
    """Every run directory matching a glob pattern, e.g. ``runs/compare-*``, sorted by path."""
    paths = sorted(p for p in glob.glob(str(pattern), recursive=True) if (Path(p) / "metrics.csv").is_file())
    if not paths:
        raise FedsimError(f"{pattern}: no run directory (with a metrics.csv) matches")
    return [load_run(p) for p in paths]


# Keys that say where and how a run executed, not what it computed: runs whose configs differ
# only in these (and in seed and name) are repeats of one experiment.
RUN_SPECIFIC_KEYS = frozenset({
    "name", "seed", "device", "workers", "backend", "checkpoint_every", "worker_timeout",
    "on_worker_failure", "sharing_strategy", "eval_batch_size", "data.root", "data.download", "data.placement",
})


def group_repeats(histories, distinguish=()) -> list[list[History]]:
    """Runs grouped by experiment: configs equal except ``RUN_SPECIFIC_KEYS`` (seed, name, ...).

    Keys in ``distinguish`` separate groups even when they are run-specific (plotting with
    ``label="seed"`` keeps every seed apart). Groups keep the order of their first run; a
    run without a config is a group of its own.
    """
    groups: dict = {}
    for index, history in enumerate(histories):
        key = _experiment_key(history.config, set(distinguish)) if history.config else index
        groups.setdefault(key, []).append(history)
    return list(groups.values())


def _experiment_key(config: dict, distinguish: set) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in flatten_config(config)
                        if k not in RUN_SPECIFIC_KEYS or k in distinguish))


def flatten_config(config: dict, prefix: str = ""):
    """(dotted key, value) pairs of a nested config dict."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flatten_config(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class ResultsTable(list):
    """Rows (dicts) of a results table. It prints as markdown, and Jupyter shows it as a table."""

    def __init__(self, rows, columns):
        super().__init__(rows)
        self.columns = list(columns)

    def markdown(self) -> str:
        repeated = any(row["runs"] > 1 for row in self)
        columns = [c for c in self.columns if c != "runs" or repeated]
        headers = [_header(c, self) for c in columns]
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---:" if c in _HEADERS else "---" for c in columns) + "|"]
        for row in self:
            lines.append("| " + " | ".join(_cell(row, c) for c in columns) + " |")
        return "\n".join(lines)

    __str__ = __repr__ = _repr_markdown_ = markdown  # Jupyter renders _repr_markdown_


_HEADERS = {"runs": "runs", "final_accuracy": "final acc. (%)", "best_accuracy": "best acc. (%)",
            "target": "target (%)", "rounds_to_target": "rounds to target", "rounds": "rounds",
            "wall_seconds": "wall (s)"}


def _header(column: str, rows) -> str:
    if column == "rounds_to_target":
        targets = {row["target"] for row in rows if row["target"] is not None}
        if len(targets) == 1:  # one target for every row: it goes in the header, no column of its own
            return f"rounds to {_percent(targets.pop())} %"
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
        return f"{100 * value:.1f}{spread}"
    if column == "best_accuracy":
        return f"{100 * value:.1f}"
    if column == "target":
        return "–" if value is None else _percent(value)
    if column == "rounds_to_target":
        return "–" if row["target"] is None else format_rounds_to_target(row)
    if column == "wall_seconds":
        return f"{value:.1f}"
    return str(value)


def rounds_to_target(history: History, target: float) -> int | None:
    """The first evaluated round whose test accuracy is at least ``target`` (a fraction), read
    from the rows; None when no evaluated round got there. With ``eval_every`` > 1 only the
    evaluated rounds count."""
    return next((row["round"] for row in history.rows if row["test_accuracy"] >= target), None)


def mean_and_sd(values) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1); the deviation of one value is 0, of none nan."""
    values = list(values)
    if not values:
        return math.nan, math.nan
    return fmean(values), (stdev(values) if len(values) > 1 else 0.0)


def target_stats(histories, target: float | None) -> dict:
    """Rounds to ``target`` over repeats: ``rounds_to_target`` (the mean over the runs that
    reached it, nan when none did), ``rounds_to_target_std`` (their sample standard deviation),
    ``reached`` (how many did) and ``runs``."""
    histories = list(histories)
    if target is None:
        return {"target": None, "rounds_to_target": None, "rounds_to_target_std": None, "reached": None,
                "runs": len(histories)}
    reached = [r for r in (rounds_to_target(h, target) for h in histories) if r is not None]
    mean, sd = mean_and_sd(reached)
    return {"target": target, "rounds_to_target": mean, "rounds_to_target_std": sd, "reached": len(reached),
            "runs": len(histories)}


def format_rounds_to_target(stats: dict) -> str:
    """``"22.3 ± 1.5 (3/3)"`` over repeats (the spread once two runs reached the target, the count
    always), ``"22"`` or ``"not reached"`` for a single run."""
    if stats["runs"] == 1:
        return "not reached" if not stats["reached"] else f"{stats['rounds_to_target']:.0f}"
    count = f"({stats['reached']}/{stats['runs']})"
    if not stats["reached"]:
        return f"– {count}"
    spread = f" ± {stats['rounds_to_target_std']:.1f}" if stats["reached"] > 1 else ""
    return f"{stats['rounds_to_target']:.1f}{spread} {count}"


def check_target(target, spelled: str = "target") -> float | None:
    """A target test accuracy: a fraction in (0, 1], or None; else a ConfigError naming ``spelled``."""
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not 0 < target <= 1):
        raise ConfigError(f"{spelled}: must be a test accuracy, a fraction in (0, 1], got {target!r}")
    return target


def results_table(histories, keys=("name",), target: float | None = None) -> ResultsTable:
    """One row per experiment (repeats over seeds pooled): the ``keys``' config values, the
    number of runs, final accuracy (mean and sample standard deviation over the runs), best
    accuracy, rounds and wall seconds (means). Accuracies are fractions; the markdown shows %.

    Rounds to a test accuracy: ``target`` (a fraction), or where it is None each experiment's
    ``stop_at_accuracy``. A run reaches it in the first evaluated round whose test accuracy is at
    least the target; the row gets the mean and sample standard deviation of that round over the
    runs that reached it (``rounds_to_target``, ``rounds_to_target_std``), how many did
    (``reached``) and the ``target``; the markdown shows them as ``22.3 ± 1.5 (3/3)``. The
    columns are there when some row has a target.
    """
    check_target(target)
    rows = []
    for group in group_repeats(histories, distinguish=keys):
        finals = [h.final_accuracy for h in group]
        goal = target if target is not None else group[0].config.get("stop_at_accuracy")
        stats = target_stats(group, goal)
        rows.append({
            **{key: group[0].config_value(key) for key in keys},
            "runs": len(group),
            "final_accuracy": fmean(finals),
            "final_accuracy_std": stdev(finals) if len(finals) > 1 else 0.0,
            "best_accuracy": fmean([h.best_accuracy for h in group]),
            "target": stats["target"],
            "rounds_to_target": stats["rounds_to_target"],
            "rounds_to_target_std": stats["rounds_to_target_std"],
            "reached": stats["reached"],
            "rounds": group[0].rows[-1]["round"] if group[0].rows else 0,
            "wall_seconds": fmean([h.summary.get("wall_seconds") or _last(h, "elapsed_seconds") for h in group]),
        })
    columns = [*keys, *_HEADERS]
    targets = {row["target"] for row in rows}
    if targets == {None}:  # nobody asked for rounds to a target
        columns = [c for c in columns if c not in ("target", "rounds_to_target")]
    elif len(targets) == 1:  # one target: named in the header
        columns.remove("target")
    return ResultsTable(rows, columns)


def _last(history: History, column: str) -> float:
    return history.rows[-1][column] if history.rows else math.nan


def _read_optional(path: Path, parse) -> dict:
    """A run file's mapping, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = parse(path.read_text())
    except (OSError, ValueError) as e:  # json's and yaml's errors are ValueErrors (see _yaml_mapping)
        raise FedsimError(f"{path}: cannot read ({_cut(str(e).splitlines()[0])})") from None
    if not isinstance(value, dict):
        raise FedsimError(f"{path}: cannot read (expected a mapping, got {type(value).__name__})")
    return value


def _yaml_mapping(text: str):
    import yaml


    try:
        return parse_yaml(text)
    except yaml.YAMLError as e:
        raise ValueError(" ".join(str(e).split())) from None


def read_metrics(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if not {"round", "test_accuracy"} <= set(reader.fieldnames or ()):
                raise FedsimError(f"{path}: not a fedsim metrics file (no round and test_accuracy columns)")
            rows = []
            for row in reader:
                try:
                    rows.append({k: _parse(k, v) for k, v in row.items()})
                except (TypeError, ValueError):
                    raise FedsimError(f"{path}: line {reader.line_num}: not a complete metrics row") from None
            return rows
    except FileNotFoundError:
        raise FedsimError(f"{path}: missing; a run directory keeps its per-round metrics there") from None
    except (UnicodeDecodeError, csv.Error):
        raise FedsimError(f"{path}: not a fedsim metrics file (not CSV text)") from None
    except OSError as e:
        raise FedsimError(f"{path}: cannot read ({e.strerror or e})") from None


def read_clients(path: Path) -> list[dict]:
    """The rows of a clients.csv, numbers as numbers; ``dropped`` is 0 or the reason (a word; 1 in
    files of an older version), and a cell that rows of an older version lack is None."""
    try:
        with open(path, newline="") as f:
            return [{k: _client_cell(k, v) for k, v in row.items()} for row in csv.DictReader(f)]
    except (OSError, UnicodeDecodeError, csv.Error, TypeError, ValueError) as e:
        raise FedsimError(f"{path}: not a fedsim clients file ({type(e).__name__})") from None


def _client_cell(column: str, value: str):
    if value == "":
        return None
    if column in ("train_loss", "update_norm"):
        return float(value)
    if column == "dropped" and not value.isdigit():
        return value
    return int(value)


def read_client_accuracy(path: Path) -> list[dict]:
    """The rows of a client_accuracy.csv, numbers as numbers (accuracy nan: no test samples)."""
    try:
        with open(path, newline="") as f:
            return [{k: (float(v) if k == "accuracy" else int(v)) for k, v in row.items()} for row in csv.DictReader(f)]
    except (OSError, UnicodeDecodeError, csv.Error, TypeError, ValueError) as e:
        raise FedsimError(f"{path}: not a fedsim client accuracy file ({type(e).__name__})") from None


def _parse(column: str, value: str):
    """A cell of metrics.csv: fedsim's own columns are numbers (an integer or a float, which
    may be nan), or None where an optional column is empty; a column fedsim does not know is
    kept as it is, number or text."""
    if column in OPTIONAL_COLUMNS and value == "":
        return None
    if column in _INT_COLUMNS:
        return int(value)
    if column in COLUMNS:
        return float(value)
    try:
        return float(value)
    except ValueError:
        return value


_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")  # characters kept out of directory names
_MAX_DIR_NAME = 120  # file systems allow 255 bytes; a timestamp and suffixes come on top


def safe_dir_name(name: str) -> str:
    """A directory name for a run name: letters, digits and ``._=+-`` only, so that ``../x`` or
    ``/etc`` stays one name inside ``runs/``; no leading dot; at most _MAX_DIR_NAME characters,
    a long name ending in a hash of the whole so that two long names stay apart."""
    text = _UNSAFE.sub("_", name).lstrip(".") or "run"
    if len(text) > _MAX_DIR_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        text = f"{text[:_MAX_DIR_NAME - 9]}-{digest}"
    return text


def check_output_path(path: Path, flag: str = "--out") -> None:
    """Refuse, in one line, a path that cannot become a directory: a name too long, or an
    existing file where a directory has to be. Creates nothing."""
    for part in path.parts:
        if len(part.encode()) > 255:
            raise FedsimError(f"{flag} {_cut(str(path))}: a name in it is longer than 255 bytes")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise FedsimError(f"{flag} {path}: {parent} is a file, not a directory")


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


class RunDirectory:
    """Writes one run's files; rows are flushed as they come, so an interrupted run keeps them.

    Every file is written whole or not at all (see ``write_atomically``), and while a run
    writes, it holds a lock on the directory, so that a second run or resume of the same
    directory is refused instead of interleaving its rows.
    """

    def __init__(self, path: Path):
        self.path = path
        self._lock = None

    @staticmethod
    def target(out: str | os.PathLike | None, name: str, overwrite: bool = False) -> Path:
        """The directory a new run will write: ``out``, or ``runs/<name>-<timestamp>``.
        Refuses an ``out`` that holds files unless ``overwrite``; creates nothing."""
        if out is None:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            base = f"{safe_dir_name(name)}-{stamp}"
            path, n = Path("runs") / base, 2
            while path.exists():
                path, n = Path("runs") / f"{base}-{n}", n + 1
            check_output_path(path)
            return path
        path = Path(out)
        check_output_path(path)
        if path.exists() and not path.is_dir():
            raise FedsimError(f"--out {path}: exists and is not a directory")
        if path.is_dir() and any(path.iterdir()) and not overwrite:
            raise FedsimError(f"--out {path}: directory exists and is not empty; "
                              f"pass --overwrite to replace its run files")
        return path

    @classmethod
    def create(cls, path: Path, overwrite: bool = False) -> "RunDirectory":
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(path, e) from None
        directory = cls(path)
        directory.lock()
        try:
            if overwrite:
                for file in RUN_FILES:
                    (path / file).unlink(missing_ok=True)
            directory.write_rows([])
        except BaseException:
            directory.unlock()
            raise
        return directory

    def lock(self) -> None:
        """Hold an exclusive lock on the directory until ``unlock`` (or this process ends)."""
        import fcntl

        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunInUseError(f"{self.path}: another fedsim process is running in this directory; "
                                f"wait for it to finish (or stop it) first") from None
        self._lock = fd

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the lock
            self._lock = None

    def append(self, row: dict) -> None:
        """Add one row to metrics.csv; a failed write is cut back, so no half row stays."""
        path = self.path / "metrics.csv"
        try:
            with open(path, "a", newline="") as f:
                size = f.tell()
                try:
                    csv.writer(f).writerow([_format(row.get(c, "")) for c in COLUMNS])
                    f.flush()
                except BaseException:
                    f.truncate(size)
                    raise
        except OSError as e:
            raise write_error(path, e) from None

    def rows(self) -> list[dict]:
        return read_metrics(self.path / "metrics.csv")

    def write_rows(self, rows: list[dict]) -> None:
        """Replace metrics.csv by the header and ``rows``, whole or not at all."""
        def write(tmp):
            with open(tmp, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(COLUMNS)
                writer.writerows([_format(row.get(c, "")) for c in COLUMNS] for row in rows)

        write_atomically(self.path / "metrics.csv", write)

    def write_summary(self, summary: dict) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")

    def save_checkpoint(self, state: dict) -> None:
        import torch  # here, so that loading and plotting results does not wait for torch

        write_atomically(self.path / "checkpoint.pt", lambda tmp: torch.save(state, tmp))

    def load_checkpoint(self) -> dict:
        path = self.path / "checkpoint.pt"
        if not path.is_file():
            raise FedsimError(f"{self.path}: no checkpoint.pt to resume from")
        import pickle

        import torch

        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            raise FedsimError(f"{path}: corrupt or not a fedsim checkpoint; the run cannot be resumed "
                              f"from it") from None
        if not isinstance(state, dict) or "round" not in state or "global" not in state:
            raise FedsimError(f"{path}: not a fedsim checkpoint (no round and global weights)")
        if not isinstance(state["round"], int) or state["round"] < 0 or \
                not isinstance(state.get("elapsed_seconds", 0.0), (int, float)):
            raise FedsimError(f"{path}: not a fedsim checkpoint (its round is {state['round']!r})")
        return state


class RunInUseError(FedsimError):
    """Another process holds the run directory's lock."""

    exit_code = 1


def write_atomically(path: Path, write, advice: str = "choose another place with --out") -> None:
    """Write ``path`` whole or not at all: ``write(tmp)`` fills a temporary file beside it,
    which then replaces ``path``. A full disk, a crash or an interrupt leaves the old file whole
    and no temporary file behind; a failure is one line naming the path and what to do."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(path, e, advice) from None
    except RuntimeError as e:  # torch.save reports a failed write as a RuntimeError
        raise write_error(path, _as_os_error(path, e), advice) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # could not be created in the first place


def _as_os_error(path: Path, error: RuntimeError) -> OSError:
    """The OSError behind a library's failed write: a full disk when it has no room left."""
    try:
        stats = os.statvfs(path.parent)
        if stats.f_bavail * stats.f_frsize < 1 << 20:
            return OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        pass
    return OSError(errno.EIO, str(error).splitlines()[0])


def atomic_write_text(path: Path, text: str, advice: str = "choose another place with --out") -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text), advice)


def _format(value) -> str:
    # repr keeps every bit of a float, so two runs' files are equal exactly when their numbers are
    if value is None:  # an optional column of a run without its feature
        return ""
    return repr(value) if isinstance(value, float) else str(value)
