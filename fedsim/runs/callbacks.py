"""Observers of a run, called in the server process: the run's own files are written by some of
them (metrics.csv, clients.csv, client_accuracy.csv), and a TensorBoard writer is another.

A callback is any object with some of these methods (the others are not called):

    on_run_start(run: RunStart)              before the first round (also of a resumed run)
    on_round_end(row: dict, clients: list)   after every round: its metrics row (test_accuracy
                                             is NaN on rounds that are not evaluated) and one
                                             dict per sampled client
    on_run_end(history: History)             after the last round, or when the run stops

Pass them as ``fedsim.run(..., callbacks=[...])``. A callback that raises stops the run with
one line naming it and the round.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.errors import user_code, write_error
from ..core.files import write_atomically
from ..results.history import History
from ..results.records import CLIENT_COLUMNS
from ..results.rundir import RunDirectory, cell_text, read_client_accuracy, row_cells

if TYPE_CHECKING:
    from ..fl.client_eval import ClientEvaluation

CLIENT_ACCURACY_COLUMNS = ("round", "client", "client_name", "model", "samples", "accuracy")


@dataclass
class RunStart:
    config: object  # the run's Config
    run_dir: Path
    first_round: int  # 1, or the round after the checkpoint of a resumed run
    model: torch.nn.Module  # the global model; its weights change every round


class Callback:
    """A base class to subclass (optional: any object with these methods will do)."""

    def on_run_start(self, run: RunStart) -> None:
        pass

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        pass

    def on_run_end(self, history: History) -> None:
        pass


class MetricsFile(Callback):
    """metrics.csv: one row per evaluated round."""

    def __init__(self, run_dir: RunDirectory):
        self.run_dir = run_dir

    def on_run_start(self, run: RunStart) -> None:  # a resumed run drops the rows after its checkpoint
        self.run_dir.write_rows([r for r in self.run_dir.rows() if r["round"] < run.first_round])

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        if not math.isnan(row["test_accuracy"]):
            self.run_dir.append(row)


class ClientsFile(Callback):
    """clients.csv: one row per sampled client per round, as ``on_round_end`` receives them."""

    def __init__(self, path: Path, columns: tuple[str, ...] = CLIENT_COLUMNS):
        self.path = path
        self.columns = columns  # every run's, then those its algorithm records (records.client_columns)

    def on_run_start(self, run: RunStart) -> None:
        kept = []
        if run.first_round > 1 and self.path.is_file():
            with open(self.path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["round"]) < run.first_round]
        # rows of an older version lack the newer columns: those cells stay empty
        self._write("w", [self.columns, *([row.get(c) or "" for c in self.columns] for row in kept)])

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        # a record without a column (hogwild's have no steps, a lost client no reports) leaves its cell empty
        self._write("a", [list(row_cells(client, self.columns).values()) for client in clients])

    def _write(self, mode: str, rows) -> None:
        try:
            with open(self.path, mode, newline="") as f:
                csv.writer(f).writerows(rows)
        except OSError as e:
            raise write_error(self.path, e) from None


class ClientAccuracyFile(Callback):
    """client_accuracy.csv (eval_per_client): the global model's accuracy on each client's test
    split, one row per client per evaluated round, from ``evaluation.last`` (a ClientEvaluation).
    The header and the rows a resumed run keeps are written whole or not at all; a round's rows
    are appended whole or cut back."""

    def __init__(self, path: Path, evaluation: ClientEvaluation):
        self.path = path
        self.evaluation = evaluation

    def on_run_start(self, run: RunStart) -> None:
        kept = []
        if run.first_round > 1 and self.path.is_file():
            kept = [r for r in read_client_accuracy(self.path) if r["round"] < run.first_round]

        def write(tmp):
            with open(tmp, "w", newline="") as f:
                csv.writer(f).writerows([CLIENT_ACCURACY_COLUMNS, *_cells(kept, CLIENT_ACCURACY_COLUMNS)])

        write_atomically(self.path, write)

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        records = self.evaluation.last
        if not records or records[0]["round"] != row["round"]:  # a round that was not evaluated
            return
        try:
            with open(self.path, "a", newline="") as f:
                size = f.tell()
                try:
                    csv.writer(f).writerows(_cells(records, CLIENT_ACCURACY_COLUMNS))
                    f.flush()
                except BaseException:
                    f.truncate(size)
                    raise
        except OSError as e:
            raise write_error(self.path, e) from None


def _cells(records: list[dict], columns) -> list[list[str]]:
    return [[cell_text(record.get(c)) for c in columns] for record in records]  # a row of an older file lacks some


class TensorBoard(Callback):
    """Scalars for TensorBoard: every metric of a round, and the spread of the clients' training
    losses and update norms, under ``log_dir`` (default: the run directory's ``tensorboard``).
    Needs the tensorboard package (``pip install "fedsim-sync[tensorboard]"``)."""

    def __init__(self, log_dir: str | os.PathLike | None = None):
        self.log_dir = log_dir
        self.writer = None

    def on_run_start(self, run: RunStart) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from ..core.errors import FedsimError

            raise FedsimError(
                'the TensorBoard writer needs the tensorboard package: pip install "fedsim-sync[tensorboard]"'
            ) from None
        self.writer = SummaryWriter(str(self.log_dir or Path(run.run_dir) / "tensorboard"), purge_step=run.first_round)

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        step = row["round"]
        for key, value in row.items():
            if key != "round" and isinstance(value, (int, float)) and not math.isnan(value):
                self.writer.add_scalar(key, value, step)
        for key in ("train_loss", "update_norm"):
            values = [c[key] for c in clients if not c["dropped"] and math.isfinite(c[key])]
            if values:
                self.writer.add_histogram(f"clients/{key}", torch.tensor(values), step)
        self.writer.flush()

    def on_run_end(self, history: History) -> None:
        if self.writer is not None:
            self.writer.close()


def notify(callbacks: Iterable[object], event: str, *args: object) -> None:
    """Call every callback that has ``event``; one that raises stops the run in one line."""
    for callback in callbacks:
        method = getattr(callback, event, None)
        if method is None:
            continue
        where = f" in round {args[0]['round']}" if event == "on_round_end" else ""
        with user_code(f"callback {type(callback).__name__}.{event} failed{where}"):
            method(*args)
