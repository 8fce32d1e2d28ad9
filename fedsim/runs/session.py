"""One run as its user sees it: the engine assembled from the config, the run directory and its
files, checkpoints, the round line, interrupts, and every rank's part of it.

The engine (engine/) runs a round and returns what happened; a session decides what becomes
of it: metrics.csv and clients.csv (through the file callbacks), the checkpoint, the round's
line, whether to go on, and, under torchrun, what the other ranks are told (execution/ranks.py).
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import yaml

from ..core.errors import FedsimError, OutputError, explain_resource_error, plural
from ..engine.buffers import RoundBuffers
from ..engine.state import GlobalState
from ..execution.distributed import Ranks
from ..execution.executors import Restarting, new_pool
from ..execution.hogwild import HogwildRunner
from ..execution.interrupts import shielded, then_shielded
from ..execution.pool import PoolKeeper
from ..execution.ranks import RanksExecutor
from ..execution.runner import ClientRunner
from ..experiment import components
from ..experiment.config import Config, overrides_of
from ..experiment.validation import unused_settings
from ..fl.client_eval import ClientEvaluation
from ..fl.compression import Compression
from ..fl.server_opt import make_server_optimizer
from ..results.history import History, describe_run
from ..results.keys import RESUMABLE_KEYS, flatten_config
from ..results.progress import RoundLog, console_logging
from ..results.records import client_columns
from ..results.rundir import RunDirectory, read_clients, read_mapping
from .callbacks import ClientAccuracyFile, ClientsFile, MetricsFile, RunStart, notify, trackers_of
from .parts import build_parts, component_names, data_placement, make_engine, resolve_workers, run_device
from .summary import account, update_bytes

logger = logging.getLogger("fedsim")


def run_identity(cfg: Config) -> str:
    """The config of a run without the keys that may change on resume, as YAML: a checkpoint
    keeps it, so that a config.yaml edited by hand is not taken for the same run."""
    kept = {k: v for k, v in flatten_config(cfg.to_dict()) if k not in RESUMABLE_KEYS}
    return yaml.safe_dump(kept, sort_keys=True)


def started_with(state: dict, folder: Path) -> dict:
    """The keys set when a run began, from its checkpoint (an older checkpoint's: from summary.json,
    if the run ended well enough to write one), never from what a later process wrote last."""
    started = state.get("overrides")
    if not isinstance(started, dict):
        started = read_mapping(folder / "summary.json", json.loads).get("overrides") or {}
    return started


def ready_message(
    cfg: Config, first_round: int, ranks: int, workers: int, device: torch.device, seconds: float, path: Path
) -> str:
    """The line that says the workers are ready: which rounds (a resumed run's from its
    checkpoint on), how, after how long, and where the files go."""
    if first_round > cfg.rounds:  # a run killed after its last checkpoint
        done = f"every round done (the checkpoint of round {cfg.rounds})"
        return f"{cfg.name}: {done}; writing its summary and plot in {path}"
    if first_round == 1:
        rounds = plural(cfg.rounds, "round")
    else:
        rounds = f"rounds {first_round} to {cfg.rounds} (resumed from the checkpoint of round {first_round - 1})"
    ranks_text = f"{ranks} ranks x " if ranks > 1 else ""
    return (
        f"{cfg.name}: {rounds} of {cfg.clients_per_round}/{cfg.data.num_clients} clients, {ranks_text}{workers} "
        f"workers on {device}, ready in {seconds:.1f} s; writing {path}"
    )


def feature_header(cfg: Config, update_bytes: tuple | None) -> str | None:
    """The figures known at the start, as a line: an update's size under compression, privacy's delta."""
    parts = []
    if update_bytes:
        whole, sent = update_bytes
        parts.append(f"an update travels as {sent} of its {whole} bytes ({sent / whole:.3g} of its whole size)")
    if cfg.privacy:
        parts.append(f"privacy: epsilon is spent at delta {cfg.privacy.delta:g}")
    return "; ".join(parts) or None


class Session:
    """One run: the data on the device, the global state, the executor, the round loop, the files.

    ``log`` prints the per-round lines: a RoundLog, or any function of one line of text;
    ``callbacks`` observe the run (see callbacks.py).
    """

    def __init__(
        self,
        cfg: Config,
        log: RoundLog | Callable[[str], None] | None = None,
        callbacks: Iterable[object] = (),
        ranks: Ranks | None = None,
        pools: PoolKeeper | None = None,
        started: dict | None = None,  # a resumed run's keys set when it began (started_with)
    ):
        self.cfg, self.ranks = cfg, ranks or Ranks()
        self.log = log if isinstance(log, RoundLog) else RoundLog(progress=False, write=log or print)
        self.user_callbacks = list(callbacks)
        self.t_start = time.perf_counter()
        torch.multiprocessing.set_sharing_strategy(cfg.sharing_strategy)
        self.device = run_device(cfg, self.ranks)
        self.ranks.use_device(self.device)
        self.workers = resolve_workers(cfg, self.device)
        runner = HogwildRunner if cfg.mode == "hogwild" else ClientRunner
        shipped = components.for_workers(cfg)
        make_pool = lambda: new_pool(shipped, self.workers, self.device, runner, pools)  # noqa: E731
        self.executor = Restarting(make_pool) if cfg.on_worker_failure == "restart" else make_pool()
        self.overrides = dict(sorted({**(started or {}), **overrides_of(cfg)}.items()))
        if self.ranks.is_root:  # what ran, and what the next seconds are spent on, before they are spent
            starting = f" and starting {self.workers} workers" if self.workers else ""
            aggregation = components.algorithm(cfg.algorithm, cfg.algorithm_options).aggregation(
                components.describe(cfg.aggregator)
            )
            logger.info(f"{cfg.name}: {describe_run(cfg.to_dict(), self.overrides, aggregation)}")
            logger.info(f"loading {components.describe(cfg.data.dataset)}{starting} on {self.device}")
        try:
            self._assemble()
        except BaseException:
            self.executor.close()
            raise
        self.rows: list[dict] = []
        self.client_rows: list[dict] = []
        self.first_round, self.elapsed_before = 1, 0.0  # a resumed run's, from its checkpoint
        self.hinted = False  # whether the line that offers eval_subset was printed
        self.startup_seconds, self.summary, self.run_dir = None, {}, None
        self.status = "interrupted"  # until the last round is on disk

    def _assemble(self) -> None:
        """The data on its device, the global state, the round's buffers and the engine."""
        cfg, device = self.cfg, self.device
        federation, model, privacy, algorithm, clients = build_parts(cfg, device)
        data = federation.data
        self.client_names = federation.client_names()  # the data's own ids of the clients, where it has them
        self.input_shape, self.num_classes = data.input_shape, data.num_classes
        data_device = data_placement(cfg.data.placement, data, device)
        if data_device != device:
            logger.info(f"{data.name} is kept in host memory (data.placement); batches are copied to {device}")
        self.compression = Compression.from_config(cfg)  # None: updates travel whole
        if self.compression:
            self.compression.use_states(clients)
        names = component_names(cfg)
        optimizer = make_server_optimizer(cfg, model.num_params, device)
        described = f"{components.describe(cfg.model)}, {names['algorithm']}, {names['server_optimizer']}"
        privacy_state = privacy.state if privacy else None
        self.state = GlobalState(
            model,
            optimizer,
            algorithm,
            clients,
            described,
            privacy_state=privacy_state,
            base_source=components.base_source(cfg),
        )
        self.buffers = RoundBuffers.allocate(
            cfg, self.state, data, federation.parts, data_device, algorithm, cfg.mode != "hogwild", self.workers
        )
        if self.ranks.several:
            self.executor = RanksExecutor(self.executor, self.ranks, cfg, self.state, device)
        test_parts = federation.test_parts() if cfg.eval_per_client else None
        self.client_eval = (
            ClientEvaluation(test_parts, data_device, self.client_names) if test_parts is not None else None
        )
        test = (data.test_x.to(data_device), data.test_y.to(data_device))
        self.engine = make_engine(
            cfg, self.state, self.buffers, self.executor, test, self.client_eval, privacy, self.compression
        )

    # ------------------------------------------------------------------ the run

    def restore(self, state: dict, rows: list[dict], source: Path) -> None:
        """Continue from ``state``, the checkpoint read from the file ``source``."""
        self.state.load_state_dict(state, source)
        self.first_round, self.elapsed_before, self.rows = state["round"] + 1, state["elapsed_seconds"], rows
        records = source.parent / "clients.csv"
        if records.is_file():
            self.client_rows = [r for r in read_clients(records) if r["round"] <= state["round"]]

    def run(self, run_dir: RunDirectory | None) -> History:
        """The rounds. On ranks other than 0 (see distributed.py) ``run_dir`` is None: they train
        their share of every round and take the new global state from rank 0."""
        self.run_dir, root = run_dir, self.ranks.is_root
        self.callbacks = (
            [
                MetricsFile(run_dir),
                ClientsFile(run_dir.path / "clients.csv", client_columns(self.state.algorithm.recorded_reports)),
                *(
                    [ClientAccuracyFile(run_dir.path / "client_accuracy.csv", self.client_eval)]
                    if self.client_eval
                    else []
                ),
                *self.user_callbacks,
                *trackers_of(self.cfg, self.user_callbacks),
            ]
            if root
            else []
        )
        then_shielded(self._play, self._finish)
        return self.history()

    def _play(self) -> None:
        """The start and the rounds; whatever ends them, ``_finish`` comes next."""
        cfg, root, run_dir = self.cfg, self.ranks.is_root, self.run_dir
        try:
            with console_logging(self.log):
                if root:
                    self._before_start()
                self._start()
                if not root:
                    self.executor.follow(self.engine, self.first_round)
                    self.status = "finished"
                else:
                    logger.info(
                        ready_message(
                            cfg,
                            self.first_round,
                            self.ranks.world,
                            self.workers,
                            self.device,
                            self.startup_seconds,
                            run_dir.path,
                        )
                    )
                    notify(
                        self.callbacks,
                        "on_run_start",
                        RunStart(cfg, run_dir.path, self.first_round, self.state.model.module),
                    )
                    self._rounds()
        except Exception as e:  # a signal leaves the run "interrupted"; anything else is a failure
            self.status = "failed"
            if isinstance(e, (RuntimeError, OSError)) and not isinstance(e, FedsimError):
                raise explain_resource_error(e) or e  # noqa: B904 (the same error, or one line that explains it)
            raise

    def _before_start(self) -> None:
        # the plot at the end needs matplotlib (most of a second to import): import it while the
        # workers start, when this process only waits
        threading.Thread(target=importlib.import_module, args=("fedsim.results.plot",), daemon=True).start()
        for message in [*unused_settings(self.cfg), self.client_eval and self.client_eval.warning()]:
            if message:
                logger.warning(message, extra={"once": message})  # a sweep says it for its first run only
        notes = [self.state.clients.shapes and self.state.clients.describe(), self.engine.evaluation_note()]
        for message in [*notes, feature_header(self.cfg, update_bytes(self.state, self.compression))]:
            if message:
                logger.info(message)
        if self.client_eval:
            self.log.per_client = "personal" if self.state.algorithm.has_personal_model else "client"
        self.log.tokens = self.engine.test[1].ndim == 2  # a language model's run: loss and perplexity first

    def _start(self) -> None:
        self.executor.start(self.buffers)
        self.startup_seconds = round(time.perf_counter() - self.t_start, 3)  # data placed, workers ready
        self.first_round = self.executor.share_start(self.first_round)

    def _rounds(self) -> None:
        """The leader's rounds, each recorded in step (files, checkpoint, line) whatever signal
        arrives. The status is the session's own, not a local: a signal held through the last
        round's files is delivered as that block ends, and must find the run already finished."""
        cfg = self.cfg
        if self.first_round > cfg.rounds:  # a run killed after its last checkpoint: only its files are left to write
            self.status = "finished"
        if cfg.initial_weights and self.first_round == 1:  # a fine-tuning run: its base's scores first
            row = self.engine.initial_row()
            row["elapsed_seconds"] = round(self.elapsed_before + time.perf_counter() - self.t_start, 4)
            with shielded():
                self.rows.append(row)
                notify(self.callbacks, "on_round_end", row, [])
                self.log.round_end(row, cfg.rounds)
        for rnd in range(self.first_round, cfg.rounds + 1):
            result = self.engine.run_round(rnd)
            row = {**result.row, "elapsed_seconds": round(self.elapsed_before + time.perf_counter() - self.t_start, 4)}
            reached = self.engine.reaches(row, cfg.stop_at_accuracy)
            with shielded():
                if result.evaluated:
                    self.rows.append(row)
                records = [self._named(record.as_row()) for record in result.clients]
                self.client_rows.extend(records)
                notify(self.callbacks, "on_round_end", row, records)
                if cfg.checkpoint_every and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds or reached):
                    checkpoint = {
                        **self.state.state_dict(rnd),
                        "elapsed_seconds": row["elapsed_seconds"],
                        "config": run_identity(cfg),
                        "overrides": self.overrides,  # how the run was started, for a resume after a kill
                        **RunDirectory.file_marks(self.rows, self.client_rows),
                    }
                    self.run_dir.save_checkpoint(checkpoint)
                    self.state.saved_round = rnd
                self.log.round_end(row, cfg.rounds)  # once printed, the round is on disk
                hint = result.evaluated and not self.hinted and self.engine.subset_hint(row)
                if hint:
                    self.hinted = True
                    logger.info(hint, extra={"once": "eval_subset hint"})  # a sweep's: its first run's figures
                if reached or rnd == cfg.rounds:
                    self.status = "finished"  # whatever arrives from here on, every round is done
            if rnd == self.first_round:  # the processes' memory once a round has touched it; again at the end
                self.executor.read_pss()
            # the other ranks, if any, get the new state or learn that the run is over
            self.executor.end_round(rnd, result.trained, go_on=self.status != "finished")
            if reached:
                logger.info(f"reached stop_at_accuracy {cfg.stop_at_accuracy} in round {rnd}")
                break

    def _named(self, record: dict) -> dict:
        """A client's record with its own id in the data beside its number (None where it has none)."""
        return {**record, "client_name": self.client_names[record["client"]] if self.client_names else None}

    def history(self) -> History:
        path = self.run_dir.path if self.run_dir else None
        return History(self.rows, self.cfg.to_dict(), path, self.summary, client_records=self.client_rows)

    def _finish(self, ended_by: BaseException | None) -> None:
        """Stop the workers, write the summary and plot, tell the callbacks; called with signals held."""
        status = self.status
        self.executor.read_pss()  # the second of the two readings (see _rounds), the workers still up
        # bytes: each worker's peak; each worker's PSS and the server's, read at one moment
        self.worker_memory = list(self.executor.peak_memory), list(self.executor.pss_memory), self.executor.server_pss
        self.executor.close(finished=status == "finished", ended_by=ended_by)
        if not self.ranks.is_root:
            self.log.close()
            return
        try:
            self._write_summary(status, ended_by)
            notify(self.callbacks, "on_run_end", self.history())
        except FedsimError as e:
            if status == "finished":
                raise
            if not isinstance(ended_by, OutputError):  # a failing disk is said once
                logger.warning(f"could not finish the run's files: {e}")  # never mask what ended the run
        finally:
            self.run_dir.unlock()
            self.log.close()  # an error or interrupt message starts on a line of its own

    def _write_summary(self, status: str, ended_by: BaseException | None) -> None:
        config = self.cfg.to_dict()
        self.summary = account(self, status, ended_by)
        self.run_dir.write_summary(self.summary)
        if self.rows:
            from ..results.plot import save_accuracy_plot

            save_accuracy_plot(
                History(self.rows, config, self.run_dir.path, self.summary), self.run_dir.path / "accuracy.png"
            )
