"""The files of one run directory, and how they are written and read safely.

A run directory holds::

    config.yaml     the resolved configuration (what actually ran)
    metrics.csv     one row per evaluated round, written as the run goes
    clients.csv     one row per sampled client per round
    client_accuracy.csv  each client's test accuracy per evaluated round (eval_per_client)
    summary.json    final and best accuracy, rounds, wall time, device, workers
    accuracy.png    per-round test accuracy
    checkpoint.pt   the latest round's state, for --resume

Every file is written whole or not at all (``write_atomically``); the readers turn a damaged or
foreign file into one line naming it. ``fedsim.results`` reads runs back as Histories.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from ..core.errors import FedsimError, cut, write_error
from ..core.files import atomic_write_text, read_checkpoint, write_atomically
from .records import CLIENT_COLUMNS
from .records import METRIC_COLUMNS as COLUMNS

# columns of what a run may leave off (privacy, eval_per_client, the bytes of hogwild), and columns
# that rows of an older version lack (a resumed run rewrites those rows): empty in metrics.csv, None
# in a History
OPTIONAL_COLUMNS = {
    "test_perplexity",
    "test_samples",
    "epsilon",
    "clip",
    "client_accuracy_mean",
    "client_accuracy_std",
    "client_accuracy_p10",
    "simulated_seconds",
    "simulated_time",
    "unavailable",
    "stragglers",
    "bytes_down",
    "bytes_up",
    "cumulative_bytes",
    "clusters",
}
_INT_COLUMNS = {
    "round",
    "test_samples",
    "clients",
    "dropped_clients",
    "attackers",
    "unavailable",
    "stragglers",
    "bytes_down",
    "bytes_up",
    "cumulative_bytes",
    "clusters",
}
RUN_FILES = (
    "config.yaml",
    "metrics.csv",
    "clients.csv",
    "client_accuracy.csv",
    "summary.json",
    "accuracy.png",
    "checkpoint.pt",
)


# how a caller names the output folder and its replacement: the command line's flags, or the
# arguments of fedsim.run and fedsim.sweep
FLAGS = ("--out", "--overwrite")
ARGUMENTS = ("out", "overwrite=True")


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
    def target(
        out: str | os.PathLike | None, name: str, overwrite: bool = False, spelled: tuple[str, str] = FLAGS
    ) -> Path:
        """The directory a new run will write: ``out``, or ``runs/<name>-<timestamp>``.
        Refuses an ``out`` that holds files unless ``overwrite``, naming both as ``spelled``
        (FLAGS or ARGUMENTS); creates nothing."""
        flag, overwriting = spelled
        if out is None:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            base = f"{safe_dir_name(name)}-{stamp}"
            path, n = Path("runs") / base, 2
            while path.exists():
                path, n = Path("runs") / f"{base}-{n}", n + 1
            check_output_path(path, flag)
            return path
        path = Path(out)
        check_output_path(path, flag)
        if path.exists() and not path.is_dir():
            raise FedsimError(f"{flag} {path}: exists and is not a directory")
        if path.is_dir() and any(path.iterdir()) and not overwrite:
            raise FedsimError(
                f"{flag} {path}: directory exists and is not empty; pass {overwriting} to replace its run files"
            )
        return path

    @classmethod
    def create(cls, path: Path, overwrite: bool = False) -> RunDirectory:
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
        self._lock = _lock(self.path, exclusive=True)

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
                    csv.writer(f).writerow([cell_text(row.get(c, "")) for c in COLUMNS])
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
                writer.writerows([cell_text(row.get(c, "")) for c in COLUMNS] for row in rows)

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
        try:
            return read_checkpoint(path)
        except FedsimError as e:
            raise FedsimError(f"{e}; the run cannot be resumed from it") from None

    @staticmethod
    def file_marks(rows: list[dict], client_rows: list[dict]) -> dict:
        """What a checkpoint keeps of metrics.csv and clients.csv: how many rows each holds, and
        its last row cell for cell, so that a resume knows they are its run's (``check_in_step``)."""
        files = {"metrics.csv": (rows, COLUMNS), "clients.csv": (client_rows, CLIENT_COLUMNS)}
        return {
            "file_rows": {name: len(kept) for name, (kept, _) in files.items()},
            "file_last_rows": {name: row_cells(kept[-1], columns) for name, (kept, columns) in files.items() if kept},
        }

    def check_in_step(self, state: dict) -> None:
        """Before a round is added, the files must hold what they held when the checkpoint
        ``state`` was saved: as many rows up to its round as it counted (a checkpoint of an older
        version counted none). A file cut back, replaced or copied from elsewhere is named."""
        counted, rnd = state.get("file_rows"), state["round"]
        for name, read in (("metrics.csv", read_metrics), ("clients.csv", read_clients)):
            if not isinstance(counted, dict) or not isinstance(counted.get(name), int):
                continue
            path = self.path / name
            missing = not path.is_file() and name == "clients.csv"  # a missing metrics.csv is named by its reader
            rows = 0 if missing else sum(row["round"] <= rnd for row in read(path))
            if rows != counted[name]:
                raise FedsimError(
                    f"{path}: holds {rows} rows up to round {rnd}, but checkpoint.pt was saved when it "
                    f"held {counted[name]}; the run directory's files disagree, so the run cannot be "
                    f"continued (restore the file, or start a new run)"
                )
            last = (state.get("file_last_rows") or {}).get(name)
            if rows and isinstance(last, dict):
                self._check_last_row(path, rows, last)

    def _check_last_row(self, path: Path, count: int, saved: dict) -> None:
        """The file's row ``count`` must be the one the checkpoint saw last, cell for cell: a file
        of another run with as many rows differs there (its losses, its times)."""
        with open(path, newline="") as f:
            row = next(itertools.islice(csv.DictReader(f), count - 1, None), {})
        differing = next((column for column, cell in saved.items() if (row.get(column) or "") != cell), None)
        if differing is not None:
            raise FedsimError(
                f"{path}: row {count} is not the one checkpoint.pt was saved after (its {differing} "
                f"differs): one of the two is another run's, so the run cannot be continued (restore "
                f"the file, or start a new run)"
            )


class RunInUseError(FedsimError):
    """Another process holds the run directory's lock."""

    exit_code = 1


def refuse_if_in_use(path: str | os.PathLike) -> None:
    """Refuse at once a directory that another fedsim process holds, before torch and the workers
    are started; the run takes its own lock later. The glance takes a shared lock, so that the
    ranks of one job, which all glance before they meet and so before rank 0 locks, never refuse
    each other."""
    try:
        os.close(_lock(Path(path), exclusive=False))
    except OSError:
        pass  # no such directory (yet), or not one: the run itself says what is wrong


def _lock(path: Path, exclusive: bool) -> int:
    """A descriptor of ``path`` holding its lock; RunInUseError where another process holds it."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunInUseError(
            f"{path}: another fedsim process is running in this directory; wait for it to finish (or stop it) first"
        ) from None
    return fd


def cell_text(value: object) -> str:
    """A value as a run's CSV files write it: repr keeps every bit of a float, so two runs' files
    are equal exactly when their numbers are; None (an optional column of a run without its
    feature) is an empty cell."""
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def row_cells(row: dict, columns: Iterable[str]) -> dict[str, str]:
    """A row's cells as its file holds them, by column."""
    return {column: cell_text(row.get(column, "")) for column in columns}


def read_mapping(path: Path, parse: Callable[[str], Any]) -> dict:
    """A run file's mapping, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = parse(path.read_text())
    except (OSError, ValueError) as e:  # json's and yaml's errors are ValueErrors (see results._yaml_mapping)
        raise FedsimError(f"{path}: cannot read ({cut(str(e).splitlines()[0], 80)})") from None
    if not isinstance(value, dict):
        raise FedsimError(f"{path}: cannot read (expected a mapping, got {type(value).__name__})")
    return value


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


def _client_cell(column: str, value: str | None):
    if value is None or value == "":  # a cell the row lacks (a row of an older version, shorter), or empty
        return None
    if column in ("train_loss", "update_norm"):
        return float(value)
    if column == "client_name" or (column == "dropped" and not value.isdigit()):
        return value
    return int(value)


TEXT_CELLS = ("model", "client_name")  # client_accuracy.csv's cells that are words


def read_client_accuracy(path: Path) -> list[dict]:
    """The rows of a client_accuracy.csv, numbers as numbers (accuracy nan: no test samples;
    ``trained`` None where the global model was scored, or in a file older than the column)."""
    try:
        with open(path, newline="") as f:
            return [
                # an empty client_name (a client without an id of its own) is None, as in clients.csv
                {
                    k: float(v) if k == "accuracy" else (v or None) if k in TEXT_CELLS or not v else int(v)
                    for k, v in row.items()
                }
                for row in csv.DictReader(f)
            ]
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
        text = f"{text[: _MAX_DIR_NAME - 9]}-{digest}"
    return text


def check_output_path(path: Path, flag: str = "--out") -> None:
    """Refuse, in one line, a path that cannot become a directory: a name too long, or an
    existing file where a directory has to be. Creates nothing."""
    for part in path.parts:
        if len(part.encode()) > 255:
            raise FedsimError(f"{flag} {cut(str(path), 80)}: a name in it is longer than 255 bytes")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise FedsimError(f"{flag} {path}: {parent} is a file, not a directory")
