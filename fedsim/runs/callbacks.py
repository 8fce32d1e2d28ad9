"""Observers of a run, called in the server process: the run's own files are written by some of
them (metrics.csv, clients.csv, client_accuracy.csv), and the experiment trackers' (TensorBoard,
MLflow, Weights & Biases) are others.

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
import hashlib
import importlib
import json
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from ..core.errors import FedsimError, cut, user_code, write_error
from ..core.files import write_atomically
from ..experiment.config import TRACKERS as TRACKER_NAMES
from ..results.history import History
from ..results.keys import flatten_config
from ..results.records import CLIENT_COLUMNS
from ..results.rundir import RunDirectory, cell_text, read_client_accuracy, row_cells

if TYPE_CHECKING:
    from ..experiment.config import Config
    from ..fl.client_eval import ClientEvaluation

CLIENT_ACCURACY_COLUMNS = ("round", "client", "client_name", "model", "samples", "accuracy", "trained")


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


def client_figures(clients: list[dict]) -> dict[str, list[float]]:
    """The figures of a round's clients that the trackers show as a spread: each trained client's
    training loss and update norm (a dropped client's are not figures of training)."""
    return {
        key: [c[key] for c in clients if not c["dropped"] and c.get(key) is not None and math.isfinite(c[key])]
        for key in ("train_loss", "update_norm")
    }


def _scalars(values: dict) -> dict[str, float]:
    """The numbers of a mapping, by key: no None, NaN (a round not evaluated), bool or text."""
    return {
        key: value
        for key, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def _needs(package: str, tracker: str, extra: str):
    """``package`` imported, or one line that says how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise FedsimError(
            f'the {tracker} tracker needs the {package} package: pip install "fedsim-sync[{extra}]"'
        ) from None


class TensorBoard(Callback):
    """TensorBoard's events: every metric of a round, histograms of the clients' training losses
    and update norms, the config and the summary as text, and the plot as an image, under
    ``log_dir`` (default: the run directory's ``tensorboard``). Needs the tensorboard package
    (``pip install "fedsim-sync[tensorboard]"``)."""

    def __init__(self, log_dir: str | os.PathLike | None = None):
        self.log_dir = log_dir
        self.writer = None

    def on_run_start(self, run: RunStart) -> None:
        _needs("tensorboard", "TensorBoard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir or Path(run.run_dir) / "tensorboard"), purge_step=run.first_round)
        self.writer.add_text("config", _as_code(yaml.safe_dump(run.config.to_dict(), sort_keys=False)), run.first_round)

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        step = row["round"]
        for key, value in _scalars(row).items():
            if key != "round":
                self.writer.add_scalar(key, value, step)
        for key, values in client_figures(clients).items():
            if values:
                self.writer.add_histogram(f"clients/{key}", torch.tensor(values), step)
        self.writer.flush()

    def on_run_end(self, history: History) -> None:
        if self.writer is None:
            return
        step = history.round[-1] if history.rows else 0
        if history.summary:
            self.writer.add_text("summary", _as_code(json.dumps(history.summary, indent=1)), step)
        plot = Path(history.run_dir) / "accuracy.png" if history.run_dir else None
        if plot and plot.is_file():
            from matplotlib.image import imread

            self.writer.add_image("plot", imread(plot)[..., :3], step, dataformats="HWC")
        self.writer.close()


def _as_code(text: str) -> str:
    """Text that TensorBoard shows as it is (its text is Markdown: indented, a code block)."""
    return "\n".join(f"    {line}" for line in text.splitlines())


class MLflow(Callback):
    """An MLflow run per fedsim run, in the experiment named as the config is (``experiment``
    replaces it), in MLflow's tracking store: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else
    MLflow's own default, a local database ``mlflow.db`` in the working directory (no server;
    ``mlflow ui`` in that folder shows it). Logged: the config's keys as parameters (and whole, as
    ``config.yaml``), every metric of a round at the round's step, the spread of the clients'
    training losses and update norms (``clients/train_loss/min``, ``median``, ``max``, ...),
    ``summary.json`` and its numbers as metrics, the plot, ``clients.csv`` and (with
    eval_per_client) ``client_accuracy.csv``. A resumed run goes on in the MLflow run it began.
    Needs the mlflow package (``pip install "fedsim-sync[mlflow]"``)."""

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None):
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.client = self.run_id = None

    def on_run_start(self, run: RunStart) -> None:
        tracking = _needs("mlflow", "MLflow", "mlflow").tracking
        self.client = client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment or run.config.name
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else client.create_experiment(name)
        run_dir = str(Path(run.run_dir).resolve())
        earlier = run.first_round > 1 and client.search_runs(
            [experiment_id], filter_string=f"tags.`fedsim.run_dir` = {_quoted(run_dir)}", max_results=1
        )
        if earlier:
            self.run_id = earlier[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = client.create_run(
            experiment_id, run_name=Path(run_dir).name, tags={"fedsim.run_dir": run_dir}
        ).info.run_id
        config = run.config.to_dict()
        params = [_mlflow_param(key, value) for key, value in flatten_config(config)]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per call
            client.log_batch(self.run_id, params=params[start : start + 100])
        client.log_dict(self.run_id, config, "config.yaml")

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        from mlflow.entities import Metric

        step, now = row["round"], int(time.time() * 1000)
        values = {key: value for key, value in _scalars(row).items() if key != "round"}
        for key, figures in client_figures(clients).items():
            if figures:
                spread = torch.tensor(figures, dtype=torch.float64)
                values |= {
                    f"clients/{key}/min": spread.min().item(),
                    f"clients/{key}/median": spread.quantile(0.5).item(),
                    f"clients/{key}/mean": spread.mean().item(),
                    f"clients/{key}/max": spread.max().item(),
                }
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def on_run_end(self, history: History) -> None:
        if self.run_id is None:
            return
        from mlflow.entities import Metric, RunTag

        client, summary = self.client, history.summary
        if summary:
            client.log_dict(self.run_id, summary, "summary.json")
            step, now = summary.get("rounds") or 0, int(time.time() * 1000)
            metrics = [Metric(key, value, now, step) for key, value in _scalars(summary).items()]
            client.log_batch(self.run_id, metrics=metrics, tags=[RunTag("fedsim.status", str(summary.get("status")))])
        for name in ("accuracy.png", "clients.csv", "client_accuracy.csv"):
            if history.run_dir and (Path(history.run_dir) / name).is_file():
                client.log_artifact(self.run_id, str(Path(history.run_dir) / name))
        status = {"finished": "FINISHED", "failed": "FAILED"}.get(summary.get("status"), "KILLED")
        client.set_terminated(self.run_id, status)


def _quoted(text: str) -> str:
    """A string in an MLflow search filter."""
    return f'"{text}"' if "'" in text else f"'{text}'"


def _mlflow_param(key: str, value: object):
    from mlflow.entities import Param

    return Param(key, cut(json.dumps(value) if not isinstance(value, str) else value, 6000))  # MLflow's limit


class WandB(Callback):
    """A Weights & Biases run per fedsim run, in the project named as the config is (``project``
    replaces it), offline unless ``mode`` or ``WANDB_MODE`` says otherwise: its files go to the
    run directory's ``wandb/``, for ``wandb sync`` to upload later. Logged: the config, every
    metric of a round against ``round``, histograms of the clients' training losses and update
    norms, the summary, the plot and ``clients`` (and, with eval_per_client, ``client_accuracy``)
    as tables. ``init`` passes more keywords to ``wandb.init``. A resumed run goes on in the W&B
    run it began (the id follows from the run directory). Needs the wandb package (``pip install
    "fedsim-sync[wandb]"``)."""

    def __init__(self, project: str | None = None, mode: str | None = None, **init: object):
        self.project, self.mode, self.init = project, mode, init
        self.run = None

    def on_run_start(self, run: RunStart) -> None:
        wandb = _needs("wandb", "Weights & Biases", "wandb")
        run_dir = Path(run.run_dir).resolve()
        (run_dir / "wandb").mkdir(exist_ok=True)
        self.run = wandb.init(
            **{
                "project": self.project or run.config.name,
                "name": run_dir.name,
                "id": hashlib.sha1(str(run_dir).encode()).hexdigest()[:16],
                "resume": "allow",
                "dir": str(run_dir),
                "config": run.config.to_dict(),
                "mode": self.mode or os.environ.get("WANDB_MODE") or "offline",
                "settings": wandb.Settings(silent=True, console="off"),
                **self.init,
            }
        )
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        import wandb

        values = _scalars(row)
        for key, figures in client_figures(clients).items():
            if figures:
                values[f"clients/{key}"] = wandb.Histogram(figures)
        self.run.log(values)

    def on_run_end(self, history: History) -> None:
        if self.run is None:
            return
        import wandb

        tables = {"clients": history.client_records, "client_accuracy": history.client_accuracy}
        logged = {name: _wandb_table(wandb, records) for name, records in tables.items() if records}
        plot = Path(history.run_dir) / "accuracy.png" if history.run_dir else None
        if plot and plot.is_file():
            logged["plot"] = wandb.Image(str(plot))
        if logged:
            self.run.log(logged)
        self.run.summary.update(history.summary)
        self.run.finish(exit_code=0 if history.summary.get("status") == "finished" else 1)
        self.run = None
        wandb.teardown()  # its service process too: a run leaves no process behind


def _wandb_table(wandb, records: list[dict]):
    columns = list(records[0])
    return wandb.Table(columns=columns, data=[[record.get(c) for c in columns] for record in records])


def notify(callbacks: Iterable[object], event: str, *args: object) -> None:
    """Call every callback that has ``event``; one that raises stops the run in one line."""
    for callback in callbacks:
        method = getattr(callback, event, None)
        if method is None:
            continue
        where = f" in round {args[0]['round']}" if event == "on_round_end" else ""
        with user_code(f"callback {type(callback).__name__}.{event} failed{where}"):
            method(*args)


# the callback of each tracker a config's ``trackers`` may name
TRACKERS = dict(zip(TRACKER_NAMES, (TensorBoard, MLflow, WandB), strict=True))


def trackers_of(cfg: Config, callbacks: Iterable[object] = ()) -> list[Callback]:
    """A callback for each tracker that ``cfg.trackers`` names, but for one already among
    ``callbacks`` (given as an object, with options of its own, or by a command-line flag)."""
    given = {type(callback) for callback in callbacks}
    return [TRACKERS[name]() for name in cfg.trackers if TRACKERS[name] not in given]
