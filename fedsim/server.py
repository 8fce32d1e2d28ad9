"""The round loop: sample clients, train them in the worker pool, update the global model,
evaluate, record.

All randomness is a function of (seed, round, client) (see streams.py): the client sample of a
round and who is online, fails or straggles in it (see system.py), each client's shuffling and
dropout, the attack noise. A run therefore gives the same
numbers whatever the number of workers, and a resumed run continues exactly where it stopped.
The loop knows no particular algorithm, rule or attack: it calls their interfaces.
"""
from __future__ import annotations

import importlib
import logging
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from . import components
from .aggregation import row_norms
from .algorithms import Round
from .attacks import attacker_mask, make_attack
from .callbacks import ClientAccuracyFile, ClientsFile, MetricsFile, RunStart
from .client_eval import COLUMNS as CLIENT_ACCURACY_COLUMNS
from .client_eval import ClientEvaluation
from .config import Config, apply_overrides, load_config, locate, save_config, unused_settings, work_items
from .distributed import RankStopped, Ranks, rank_device
from .errors import (ConfigError, FedsimError, NonFiniteError, OutputError, WorkerError,
                     explain_resource_error)
from .federation import initial_model, load_federation
from .flat import FlatModel
from .interrupts import shielded
from .privacy import Privacy
from .progress import RoundLog, console_logging
from .results import History, RunDirectory, flatten_config, read_clients
from .server_opt import make_server_optimizer
from .streams import attack_generator
from .system import RoundPlan, System
from .workers import ClientRunner, InlinePool, Shared, WorkerPool, peak_rss_bytes, slot_groups

logger = logging.getLogger("fedsim")

_START_TIMEOUT = 300.0  # seconds for workers to start (spawn, imports, CUDA context, model)
_FIRST_ROUND_TIMEOUT = 900.0  # the first round also pays for cuDNN set-up and first kernels
# Keys a resumed run may change: how long it runs, where and how fast, how often it reports.
RESUMABLE_KEYS = {"rounds", "workers", "worker_timeout", "checkpoint_every", "stop_at_accuracy",
                  "on_worker_failure", "eval_every", "eval_batch_size", "device", "sharing_strategy",
                  "data.root", "data.download", "data.placement"}


def resolve_device(name: str) -> torch.device:
    """The run's device; a CUDA device always with its index (workers pass it to set_device)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: '{name}' asked for, but CUDA is not available here "
                              f"(torch {torch.__version__}); use device: cpu or auto")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device: '{name}' asked for, but there are {torch.cuda.device_count()} CUDA devices")
    return device


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# Each worker process on a GPU holds a CUDA context (about 0.5 GiB) plus its model, gradients
# and activations; this budget per worker keeps the default from over-subscribing the card.
_GPU_BYTES_PER_WORKER = 1 << 30


def resolve_workers(cfg: Config, device: torch.device) -> int:
    if cfg.workers is not None:
        return cfg.workers
    workers = min(work_items(cfg), available_cores())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        workers = min(workers, max(1, int(0.8 * free // _GPU_BYTES_PER_WORKER)))
    return workers


def data_placement(placement: str, data, device: torch.device) -> torch.device:
    """Where the dataset lives: on the device, or in host memory when it would take more than
    half of the GPU's free memory (``auto``), or when asked (``host``)."""
    if device.type != "cuda" or placement == "device":
        return device
    if placement == "host":
        return torch.device("cpu")
    size = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    free, _ = torch.cuda.mem_get_info(device)
    return device if size <= free / 2 else torch.device("cpu")


@torch.inference_mode()
def evaluate(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """Test accuracy and mean loss; one host sync at the end. The test set may live in host
    memory (data.placement): each batch then goes to the model's device."""
    module.eval()
    device = next(module.parameters()).device
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        out = module(xb)
        loss += F.cross_entropy(out, yb, reduction="sum").double()
        correct += (out.argmax(dim=1) == yb).sum()
    return correct.item() / len(y), loss.item() / len(y)


class Simulation:
    """One run: the data on the device, the global model, the worker pool, the round loop.

    ``log`` prints the per-round lines: a RoundLog, or any function of one line of text;
    ``callbacks`` observe the run (see callbacks.py).
    """

    runner = ClientRunner  # what a worker trains its clients with
    client_copies = True  # each client trains a copy of the global weights, kept in a row of local_flat

    def __init__(self, cfg: Config, log=None, callbacks=(), ranks: Ranks | None = None):
        self.cfg = cfg
        self.ranks = ranks or Ranks()
        self.log = log if isinstance(log, RoundLog) else RoundLog(progress=False, write=log or print)
        self.user_callbacks = list(callbacks)
        self.t_start = time.perf_counter()
        torch.multiprocessing.set_sharing_strategy(cfg.sharing_strategy)
        self.device = resolve_device(rank_device(cfg.device) if self.ranks.world > 1 else cfg.device)
        self.ranks.use_device(self.device)
        self.workers = resolve_workers(cfg, self.device)
        self.pool = self._new_pool()  # the workers import torch while the data loads
        try:
            self._prepare()
        except BaseException:
            self.pool.close()
            raise

    def _new_pool(self) -> WorkerPool | InlinePool:
        if self.workers == 0:
            return InlinePool(self.cfg, self.device, self.runner)
        return WorkerPool(components.for_workers(self.cfg), self.workers, self.device, self.runner)

    def _prepare(self) -> None:
        """The data on its device, the clients' index ranges, the global model, the buffers."""
        cfg = self.cfg
        federation = load_federation(cfg)
        data, parts = federation.data, federation.parts
        sizes = [len(p) for p in parts]
        self.sizes = np.array(sizes)  # the clients' sample counts, for System.round
        self.system = System.from_config(cfg)
        if 0 in sizes:
            raise ConfigError(f"data.partition: client {sizes.index(0)} gets no samples; "
                              f"use fewer clients or more data")
        self.model = FlatModel(initial_model(cfg, data), self.device)
        if cfg.backend == "vmap" and len(self.model) != self.model.num_params:
            raise ConfigError(f"backend: vmap cannot train {components.describe(cfg.model)}, whose batch-norm "
                              f"statistics are not parameters; use backend: process")
        self.data_device = data_placement(cfg.data.placement, data, self.device)
        if self.data_device != self.device:
            logger.info(f"{data.name} is kept in host memory (data.placement); batches are copied to {self.device}")
        self.test_x, self.test_y = data.test_x.to(self.data_device), data.test_y.to(self.data_device)
        self.client_eval = ClientEvaluation.for_run(cfg, data, parts, self.data_device) if cfg.eval_per_client else None
        self.aggregate = components.aggregator(cfg.aggregator, cfg.aggregator_options)
        self.privacy = Privacy.from_config(cfg)  # DP-FedAvg in place of the rule (privacy.py), or None
        if self.privacy:
            self.privacy.check_model(components.describe(cfg.model), self.model.num_params, len(self.model))
        self.algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
        self.algorithm.setup(cfg)
        self.attack = make_attack(cfg.attack)
        self.shared = self._allocate(data, parts)
        self.server_opt = make_server_optimizer(cfg, self.model.num_params, self.device)
        self.rows: list[dict] = []
        self.client_rows: list[dict] = []
        self.first_round = 1
        self.checkpoint_round = 0
        self.startup_seconds = None
        self.worker_peak_memory_mb: list[float] = []
        self.elapsed_before = 0.0  # wall seconds a resumed run had spent before it stopped

    def _allocate(self, data, parts) -> Shared:
        cfg, k, n, dev = self.cfg, self.cfg.clients_per_round, self.model.num_params, self.device

        def zeros(shapes: dict, rows: tuple = ()) -> dict:
            return {name: torch.zeros(*rows, *shape, device=dev) for name, shape in shapes.items()}

        return Shared(
            train_x=data.train_x.to(self.data_device), train_y=data.train_y.to(self.data_device),
            client_indices=torch.cat(parts).to(self.data_device),
            client_offsets=torch.tensor([0] + np.cumsum([len(q) for q in parts]).tolist()),
            num_classes=data.num_classes,
            global_flat=torch.zeros(len(self.model), device=dev),
            local_flat=torch.zeros(k if self.client_copies else 0, len(self.model), device=dev),
            stats=torch.zeros(k, 3, device=dev),
            assignment=torch.zeros(k, dtype=torch.int64),
            step_limits=torch.full((k,), -1, dtype=torch.int64),
            progress=torch.zeros(max(self.workers, 1), dtype=torch.int64),
            attackers=attacker_mask(cfg.seed, cfg.data.num_clients, cfg.attack),
            server_state=zeros(self.algorithm.server_state(n)),
            client_state=zeros(self.algorithm.client_state(n), (cfg.data.num_clients,)),
            reports=zeros(self.algorithm.report_shapes(n), (k,)),
        ).share_cpu_tensors()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, rnd: int, elapsed: float) -> dict:
        s = self.shared
        return {
            "round": rnd,
            "elapsed_seconds": elapsed,
            "global": self.model.flat.cpu(),
            "server_optimizer": {k: v.cpu() for k, v in self.server_opt.state_dict().items()},
            "algorithm": {"server": {k: v.cpu() for k, v in s.server_state.items()},
                          "clients": {k: v.cpu() for k, v in s.client_state.items()}},
            "torch_rng": torch.get_rng_state(),
            "config": run_identity(self.cfg),
        }

    def restore(self, state: dict, rows: list[dict], source: Path) -> None:
        """Continue from ``state``, the checkpoint read from the file ``source``."""
        s = self.shared
        self._check_checkpoint(state, source)
        self.model.flat.copy_(state["global"])
        self.server_opt.load_state_dict(state["server_optimizer"])
        for name, value in state["algorithm"]["server"].items():
            s.server_state[name].copy_(value)
        for name, value in state["algorithm"]["clients"].items():
            s.client_state[name].copy_(value)
        torch.set_rng_state(state["torch_rng"])
        self.first_round = state["round"] + 1
        self.checkpoint_round = state["round"]
        self.elapsed_before = state["elapsed_seconds"]
        self.rows = rows
        records = source.parent / "clients.csv"
        if records.is_file():
            self.client_rows = [r for r in read_clients(records) if r["round"] <= state["round"]]

    def _check_checkpoint(self, state: dict, source: Path) -> None:
        """Every tensor the run restores must be there with this run's shape, and nothing else:
        a checkpoint copied from another run (or torn by hand) is refused in one line."""
        s = self.shared
        expected = {"global": self.model.flat, "torch_rng": torch.get_rng_state(),
                    **{f"server_optimizer.{k}": v for k, v in self.server_opt.state_dict().items()},
                    **{f"algorithm.server.{k}": v for k, v in s.server_state.items()},
                    **{f"algorithm.clients.{k}": v for k, v in s.client_state.items()}}
        saved = dict(flatten_config({key: state.get(key) for key in ("server_optimizer", "algorithm")}))
        unexpected = sorted(k for k, v in saved.items() if isinstance(v, torch.Tensor) and k not in expected)
        if unexpected:
            raise FedsimError(f"{source}: holds {unexpected[0]}, which this run does not keep; it is not this "
                              f"run's checkpoint")
        for key, like in expected.items():
            value = state
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "nothing"
                raise FedsimError(f"{source}: holds {got} for {key} where this run "
                                  f"({components.describe(self.cfg.model)}, {components.describe(self.cfg.algorithm)}, "
                                  f"{self.cfg.server_optimizer}) needs {tuple(like.shape)}; it is not this run's "
                                  f"checkpoint")

    # ------------------------------------------------------------------ the loop

    def run(self, run_dir: RunDirectory | None) -> History:
        """The round loop. On ranks other than 0 (see distributed.py) ``run_dir`` is None: they
        train their share of every round and take the new global model from rank 0."""
        cfg, self.run_dir, root = self.cfg, run_dir, self.ranks.is_root
        self.callbacks = [MetricsFile(run_dir), ClientsFile(run_dir.path / "clients.csv"),
                          *([ClientAccuracyFile(run_dir.path / "client_accuracy.csv", self.client_eval)]
                            if self.client_eval else []),
                          *self.user_callbacks] if root else []
        status, pool = "interrupted", self.pool
        try:
            with console_logging(self.log):
                if root:
                    # the plot at the end needs matplotlib (most of a second to import): import
                    # it while the workers start, when this process only waits
                    threading.Thread(target=importlib.import_module, args=("fedsim.plot",), daemon=True).start()
                    for message in [*unused_settings(cfg), self.client_eval and self.client_eval.warning()]:
                        if message:
                            logger.warning(message)
                self._start(pool)
                self._share_start()
                if root:
                    ranks = f"{self.ranks.world} ranks x " if self.ranks.world > 1 else ""
                    logger.info(f"{cfg.name}: {cfg.rounds} rounds of {cfg.clients_per_round}/{cfg.data.num_clients} "
                                f"clients, {ranks}{self.workers} workers on {self.device}; writing {run_dir.path}")
                    self._notify("on_run_start", RunStart(cfg, run_dir.path, self.first_round, self.model.module))
                slowest = 0.0
                for rnd in range(self.first_round, cfg.rounds + 1):
                    t0 = time.perf_counter()
                    timeout = cfg.worker_timeout or (_FIRST_ROUND_TIMEOUT if not slowest else max(120.0, 10 * slowest))
                    # 1. sample the round's clients among the online ones (every rank draws the same):
                    #    those whose work reaches the server are trained, partial stragglers for fewer steps
                    plan = self._sample(rnd)
                    clients = torch.from_numpy(plan.clients)
                    # 2. train them in the worker pool (each rank its share; rank 0 gathers the rows)
                    pool = self._train(pool, rnd, clients, timeout)
                    if not root:
                        if self._follow(rnd, clients):
                            continue
                        status = "finished"
                        break
                    t_trained = time.perf_counter()
                    # 3. their updates: attacks rewrite the attackers', non-finite ones are left out
                    round_, client_rows = self._collect(rnd, clients)
                    client_rows += self._lost(rnd, plan)
                    # 4. the server update: the algorithm (through the rule), then the server optimizer
                    if len(round_.clients):
                        self._update(rnd, round_)
                    t_updated = time.perf_counter()
                    # 5. evaluate (with eval_per_client, also on every client's test split)
                    evaluated = rnd % cfg.eval_every == 0 or rnd == cfg.rounds
                    accuracy, test_loss = (evaluate(self.model.module, self.test_x, self.test_y, cfg.eval_batch_size)
                                           if evaluated else (math.nan, math.nan))
                    per_client = (self.client_eval.score(self.model.module, self.test_x, self.test_y,
                                                         cfg.eval_batch_size, rnd)
                                  if evaluated and self.client_eval else dict.fromkeys(CLIENT_ACCURACY_COLUMNS))
                    row = {**self._row(rnd, t0, t_trained, t_updated, pool, round_, client_rows, accuracy, test_loss,
                                       plan),
                           **per_client}
                    slowest = max(slowest, row["seconds"])
                    reached = self._reached_target(row)
                    # 6. record it: callbacks (metrics.csv, clients.csv, ...), checkpoint, the round's line
                    with shielded():  # they stay in step whatever signal arrives
                        if evaluated:
                            self.rows.append(row)
                        self.client_rows.extend(client_rows)
                        self._notify("on_round_end", row, client_rows)
                        if cfg.checkpoint_every and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds or reached):
                            self.run_dir.save_checkpoint(self.state_dict(rnd, row["elapsed_seconds"]))
                            self.checkpoint_round = rnd
                        self.log.round_end(row, cfg.rounds)  # once printed, the round is on disk
                        if reached or rnd == cfg.rounds:
                            status = "finished"  # whatever arrives from here on, every round is done
                    # 7. the other ranks get the new global model (or learn that the run is over)
                    self._lead(rnd, clients, done=status == "finished")
                    if reached:
                        logger.info(f"reached stop_at_accuracy {cfg.stop_at_accuracy} in round {rnd}")
                        break
        except FedsimError:
            status = "failed"
            raise
        except (RuntimeError, OSError) as e:
            status = "failed"
            raise explain_resource_error(e) or e
        finally:
            self._finish(pool, status, ended_by=sys.exc_info()[1])
        return self.history()

    def history(self) -> History:
        return History(self.rows, self.cfg.to_dict(), self.run_dir.path if self.run_dir else None,
                       getattr(self, "summary", {}), client_records=self.client_rows)

    def _sample(self, rnd: int) -> RoundPlan:
        """The round's plan (see system.py), its step limits written where the workers read them."""
        cfg = self.cfg
        losses = None
        if self.system.needs_losses:  # rank 0's losses, so that every rank keeps the same clients
            losses = self.ranks.decide(self._candidate_losses(rnd) if self.ranks.is_root else None,
                                       f"sampling round {rnd}'s clients")
        plan = self.system.round(cfg.seed, rnd, cfg.data.num_clients, cfg.clients_per_round, self.sizes, losses)
        limits = [-1 if limit is None else limit for limit in plan.step_limits]
        self.shared.step_limits[:len(limits)] = torch.tensor(limits, dtype=torch.int64)
        return plan

    def _candidate_losses(self, rnd: int) -> dict[int, float] | None:
        """power_of_choice: the current global model's mean loss on each candidate's whole training
        set, computed here in the server process in eval mode (no dropout, no augmentation), so the
        same whatever the workers; None when there are no more candidates than clients to keep."""
        cfg, s = self.cfg, self.shared
        candidates = self.system.candidates(cfg.seed, rnd, cfg.data.num_clients, cfg.clients_per_round, self.sizes)
        if len(candidates) <= cfg.clients_per_round:
            return None
        losses = {}
        for c in candidates.tolist():
            ix = s.client_indices[int(s.client_offsets[c]): int(s.client_offsets[c + 1])]
            losses[c] = evaluate(self.model.module, s.train_x[ix], s.train_y[ix], cfg.eval_batch_size)[1]
        return losses

    def _lost(self, rnd: int, plan: RoundPlan) -> list[dict]:
        """One record per sampled client whose work never reached the server (a dropout, or a
        straggler that is dropped or finished no step in time): no loss, no update, no steps."""
        return [{"round": rnd, "client": c, "samples": int(self.sizes[c]), "train_loss": math.nan,
                 "update_norm": math.nan, "dropped": plan.outcome(c), "attacker": int(self.shared.attackers[c]),
                 "steps": 0} for c in plan.dropped.tolist()]

    def _start(self, pool: WorkerPool) -> WorkerPool:
        pool.start(self.shared, timeout=max(self.cfg.worker_timeout or 0, _START_TIMEOUT))
        if self.startup_seconds is None:  # data on the device, workers spawned and ready
            self.startup_seconds = round(time.perf_counter() - self.t_start, 3)
        return pool

    def _train(self, pool: WorkerPool, rnd: int, clients: torch.Tensor, timeout: float) -> WorkerPool:
        """Every client of this rank's share of the round trained from the global weights (a
        failed pool is restarted and its share re-run if the config says so: the workers change
        no state, see Algorithm); then rank 0 has every rank's rows."""
        groups = slot_groups(self.cfg, len(clients))
        error = None
        try:
            pool = self._train_share(pool, rnd, clients, self.ranks.groups(groups), timeout)
        except FedsimError as e:
            if self.ranks.world == 1:
                raise
            error = str(e)
        self.ranks.agree(error, f"round {rnd}'s training")
        self.ranks.gather_rows(self.shared, groups, f"gathering round {rnd}")
        return pool

    def _train_share(self, pool: WorkerPool, rnd: int, clients, groups, timeout: float) -> WorkerPool:
        for attempt in range(3):
            # every attempt starts from the global weights (Hogwild's workers train them in place)
            self.shared.global_flat.copy_(self.model.flat)
            try:
                pool.run_round(rnd, clients, groups, timeout)
                return pool
            except WorkerError as e:
                if self.cfg.on_worker_failure != "restart" or attempt == 2:
                    raise
                logger.warning(f"round {rnd}: {e}; restarting the workers and re-running the round")
                pool.close()
                pool = self._start(self._new_pool())

    # ------------------------------------------------------------------ several ranks

    def _share_start(self) -> None:
        """Every rank starts from rank 0's state (a resumed run's, on rank 0 only)."""
        s = self.shared
        self.first_round = self.ranks.decide(self.first_round, "starting")
        self.ranks.share([self.model.flat, *s.server_state.values(), *s.client_state.values()], "starting")

    def _lead(self, rnd: int, clients: torch.Tensor, done: bool) -> None:
        """Rank 0, after its round: tell the others whether to go on, and give them the state."""
        if self.ranks.world > 1:
            self.ranks.decide("done" if done else "next", f"ending round {rnd}")
            if not done:
                self._exchange_state(rnd, clients)

    def _follow(self, rnd: int, clients: torch.Tensor) -> bool:
        """Another rank, after its round: whether to go on, and rank 0's new state if so."""
        decision = self.ranks.decide(None, f"ending round {rnd}")
        if decision == "failed":
            raise RankStopped("")
        if decision == "done":
            return False
        self._exchange_state(rnd, clients)
        return True

    def _exchange_state(self, rnd: int, clients: torch.Tensor) -> None:
        """Rank 0's global weights, server state and the round's client-state rows on every rank
        (server_update changes the client state of the round's clients only)."""
        s = self.shared
        ids = clients.to(s.global_flat.device)
        rows = [state[ids] for state in s.client_state.values()]
        self.ranks.share([self.model.flat, *s.server_state.values(), *rows], f"sharing round {rnd}'s update")
        if not self.ranks.is_root:
            for state, row in zip(s.client_state.values(), rows):
                state[ids] = row

    def _collect(self, rnd: int, clients: torch.Tensor) -> tuple[Round, list[dict]]:
        """The round's updates as the server's update sees them, and one record per client."""
        cfg, s = self.cfg, self.shared
        k = len(clients)
        updates = s.local_flat[:k].sub_(self.model.flat)  # client weights - global weights, in place
        attacking = s.attackers[clients]
        rows = attacking.nonzero().flatten().to(updates.device)
        if len(rows):
            rewritten = self.attack.rewrite(updates[rows], attack_generator(cfg.seed, rnd))
            if rewritten is not None:
                updates[rows] = rewritten
        finite = torch.isfinite(updates).all(dim=1)
        for report in s.reports.values():
            finite &= torch.isfinite(report[:k].reshape(k, -1)).all(dim=1)
        keep = finite.nonzero().flatten()
        bad = clients[(~finite).cpu()].tolist()
        if bad:
            if cfg.on_nonfinite == "fail":
                raise NonFiniteError(f"round {rnd}: client {bad[0]} sent non-finite (NaN/Inf) weights "
                                     f"(on_nonfinite: fail; use drop to leave such clients out)")
            logger.warning(f"round {rnd}: dropped {len(bad)} client(s) with non-finite weights: {bad}")
        norms = row_norms(updates)
        stats = s.stats[:k].cpu()
        client_rows = [{"round": rnd, "client": int(c), "samples": int(stats[i, 0]), "train_loss": float(stats[i, 1]),
                        "update_norm": float(norms[i]), "dropped": 0 if finite[i] else "nonfinite",
                        "attacker": int(attacking[i]), "steps": int(stats[i, 2])}
                       for i, c in enumerate(clients.tolist())]
        state_device = s.global_flat.device
        round_ = Round(updates=updates[keep], weights=s.stats[keep, 0], clients=clients[keep.cpu()].to(state_device),
                       reports={name: report[keep] for name, report in s.reports.items()},
                       aggregate=self.privacy.rule(cfg.seed, rnd) if self.privacy else self.aggregate,
                       global_weights=self.model.flat, num_params=self.model.num_params,
                       num_clients=cfg.data.num_clients)
        return round_, client_rows

    def _update(self, rnd: int, round_: Round) -> None:
        """The new global model; a non-finite one is never kept (see _check_finite)."""
        n = self.model.num_params
        delta = self.algorithm.server_update(round_, self.shared.server_state, self.shared.client_state)
        self._check_finite(delta, rnd, f"the update of {components.describe(self.cfg.algorithm)} with the rule "
                                       f"{components.describe(self.cfg.aggregator)} is non-finite")
        self.server_opt.step(self.model.params, delta[:n])
        self.model.flat[n:].add_(delta[n:])  # buffers (batch-norm statistics) are averaged as they are
        self._check_finite(self.model.flat, rnd, f"the server optimizer {self.cfg.server_optimizer} made the "
                                                 f"global weights non-finite")
        for name, state in self.shared.server_state.items():
            self._check_finite(state, rnd, f"the algorithm's state {name!r} became non-finite")

    def _check_finite(self, tensor: torch.Tensor, rnd: int, what: str) -> None:
        """The global state must stay finite even when every client update is (a rule or a server
        optimizer can overflow): stop before such a state is evaluated or checkpointed."""
        if not torch.isfinite(tensor).all():
            kept = f"the checkpoint of round {self.checkpoint_round} is kept" if self.checkpoint_round else \
                "no checkpoint was written"
            raise NonFiniteError(f"round {rnd}: {what} (NaN/Inf) although every client update used was finite; "
                                 f"nothing of this round was saved and {kept}; lower server_lr or attack.scale, or "
                                 f"bound updates with aggregator: norm_clip")

    def _row(self, rnd, t0, t_trained, t_updated, pool, round_: Round, client_rows, accuracy, test_loss,
             plan: RoundPlan) -> dict:
        """The round's metrics; ``client_rows`` starts with the trained clients, slot by slot."""
        kept = len(round_.clients)
        losses = self.shared.stats[:, 1][[i for i, c in enumerate(client_rows) if not c["dropped"]]]
        # the mean over the clients' samples, as each client's loss is the mean over its own
        train_loss = float((round_.weights * losses).sum() / round_.weights.sum()) if kept else math.nan
        now = time.perf_counter()
        return {"round": rnd, "test_accuracy": accuracy, "test_loss": test_loss, "train_loss": train_loss,
                "seconds": round(now - t0, 4), "elapsed_seconds": round(self.elapsed_before + now - self.t_start, 4),
                "clients": len(client_rows),
                "attackers": sum(c["attacker"] for c in client_rows),
                "train_seconds": round(t_trained - t0, 4), "worker_seconds": round(max(pool.busy_seconds), 4),
                "aggregate_seconds": round(t_updated - t_trained, 4), "eval_seconds": round(now - t_updated, 4),
                "epsilon": self.privacy.epsilon(rnd) if self.privacy else None,
                # dropped_clients: the lost work of the plan, and the non-finite updates left out
                **plan.metrics(left_out=len(plan.clients) - kept)}

    def _reached_target(self, row: dict) -> bool:
        target = self.cfg.stop_at_accuracy
        return target is not None and not math.isnan(row["test_accuracy"]) and row["test_accuracy"] >= target

    def _notify(self, event: str, *args) -> None:
        """Call every callback that has ``event``; one that raises stops the run in one line."""
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is None:
                continue
            try:
                method(*args)
            except FedsimError:
                raise
            except Exception as e:
                where = f" in round {args[0]['round']}" if event == "on_round_end" else ""
                raise FedsimError(f"callback {type(callback).__name__}.{event} failed{where}: "
                                  f"{type(e).__name__}: {e}") from None

    def _finish(self, pool: WorkerPool, status: str, ended_by: BaseException | None) -> None:
        """Stop the workers, write the summary and plot, tell the callbacks; whatever happens."""
        with shielded():
            self.worker_peak_memory_mb = [round(b / 2**20, 1) for b in pool.peak_memory]
            pool.close()
            if self.ranks.world > 1:
                self._end_ranks(status, ended_by)
            if not self.ranks.is_root:
                self.log.close()
                return
            try:
                self._write_summary(status)
                self._notify("on_run_end", self.history())
            except FedsimError as e:
                if status == "finished":
                    raise
                if not isinstance(ended_by, OutputError):  # a failing disk is said once
                    logger.warning(f"could not finish the run's files: {e}")  # never mask what ended the run
            finally:
                self.run_dir.unlock()
                self.log.close()  # an error or interrupt message starts on a line of its own

    def _end_ranks(self, status: str, ended_by: BaseException | None) -> None:
        """Rank 0 tells the others when it stops early; every rank reports its memory to rank 0.
        A rank that is gone makes these fail: then there is nothing to tell or collect."""
        memory = {"rank": self.ranks.rank, "host": socket.gethostname(), "device": str(self.device),
                  "server_peak_memory_mb": _peak_memory_mb(self.device),
                  "worker_peak_memory_mb": self.worker_peak_memory_mb}
        try:
            if self.ranks.is_root and status != "finished" and not isinstance(ended_by, RankStopped):
                self.ranks.decide("failed", "stopping")
            self.rank_memory = self.ranks.collect(memory, "collecting the ranks' memory")
        except FedsimError:
            self.rank_memory = None

    def _write_summary(self, status: str) -> None:
        accuracies = [r["test_accuracy"] for r in self.rows]
        target = self.cfg.stop_at_accuracy
        self.summary = {
            "name": self.cfg.name,
            "status": status,
            "rounds": self.rows[-1]["round"] if self.rows else 0,
            "final_test_accuracy": accuracies[-1] if accuracies else None,
            "best_test_accuracy": max(accuracies) if accuracies else None,
            "final_test_loss": self.rows[-1]["test_loss"] if self.rows else None,
            "checkpoint_round": self.checkpoint_round,
            "rounds_to_target": next((r["round"] for r in self.rows if target and r["test_accuracy"] >= target), None),
            "startup_seconds": self.startup_seconds,
            "wall_seconds": round(self.elapsed_before + time.perf_counter() - self.t_start, 3),
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "workers": self.workers,
            "worker_peak_memory_mb": self.worker_peak_memory_mb,
            "server_peak_memory_mb": _peak_memory_mb(self.device),
            **({"ranks": self.rank_memory} if self.ranks.world > 1 else {}),
            "torch": torch.__version__,
        }
        self.run_dir.write_summary(self.summary)
        if self.rows:
            from .plot import save_accuracy_plot

            save_accuracy_plot(History(self.rows, self.cfg.to_dict(), self.run_dir.path),
                               self.run_dir.path / "accuracy.png")


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: tensors on the GPU (the allocator's peak, without the
    CUDA context), or resident set size on a CPU."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(peak_rss_bytes() / 2**20, 1)


# ----------------------------------------------------------------------------- entry points


def run(config="experiments/mnist_seed.yaml", *, out=None, overwrite: bool = False, quiet: bool = False,
        progress: bool | None = None, callbacks=(), **overrides) -> History:
    """Run an experiment and return its History.

    ``config`` is a YAML path, a dict or a Config; ``overrides`` set keys, dotted ones via
    ``**{"local.lr": 0.05}`` or whole sections as dicts (``data={"limit": 2000}``); ``model``,
    ``aggregator``, ``algorithm`` and ``dataset`` may be objects of your own (see
    components.py). Files go to ``out`` (default ``runs/<name>-<timestamp>``). ``progress``:
    show the rounds as one updating line (None: only on a terminal); ``quiet``: print no
    per-round lines; ``callbacks``: observers of the run (see callbacks.py).
    """
    cfg = load_config(config, _with_dataset_key(overrides))
    return start_run(cfg, out=out, overwrite=overwrite, quiet=quiet, progress=progress, callbacks=callbacks)


def resume(run_dir, *, quiet: bool = False, progress: bool | None = None, callbacks=(), **overrides) -> History:
    """Continue a run from its last checkpoint; ``rounds=N`` extends it. A component that was
    given as an object (defined in a notebook, say) is given again the same way."""
    return resume_run(run_dir, _with_dataset_key(overrides), quiet=quiet, progress=progress, callbacks=callbacks)


def _with_dataset_key(overrides: dict) -> dict:
    """``dataset=`` is short for ``data={"dataset": ...}``."""
    if "dataset" in overrides:
        overrides = {**overrides, "data.dataset": overrides["dataset"]}
        del overrides["dataset"]
    return overrides


def start_run(cfg: Config, out=None, overwrite: bool = False, quiet: bool = False, progress=None,
              callbacks=(), ranks: Ranks | None = None) -> History:
    """Run ``cfg`` into ``out`` (default ``runs/<name>-<timestamp>``); on ranks other than 0
    (see distributed.py) only train."""
    ranks = ranks or Ranks()
    path = RunDirectory.target(out, cfg.name, overwrite) if ranks.is_root else None  # before loading anything
    sim = _setup(cfg, quiet, progress, callbacks, ranks)
    if not ranks.is_root:
        return sim.run(None)
    try:
        run_dir = RunDirectory.create(path, overwrite)
        try:
            save_config(sim.cfg, run_dir.path / "config.yaml")
        except BaseException:
            run_dir.unlock()
            raise
    except BaseException:
        sim.pool.close()
        raise
    return sim.run(run_dir)


def resume_run(run_dir, overrides=None, quiet: bool = False, progress=None, callbacks=(),
               ranks: Ranks | None = None) -> History | None:
    """Continue ``run_dir`` from its checkpoint; ``overrides`` is a list of "key=value"
    strings (the CLI's --set) or a dict, limited to keys that keep it one run (and to the
    components of the run, given again as objects). Rank 0 reads the run directory; the other
    ranks receive what they need from it."""
    ranks = ranks or Ranks()
    path = Path(run_dir)
    directory = RunDirectory(path)
    loaded = {}

    def load() -> Config | None:
        if not (path / "config.yaml").is_file():
            raise FedsimError(f"--resume {path}: not a run directory (no config.yaml)")
        bad = sorted(apply_overrides({}, overrides or {}) - RESUMABLE_KEYS - set(components.KEYS))
        if bad:
            raise ConfigError(f"--set {bad[0]}: cannot change when resuming (the rounds before and after would not "
                              f"be one run); allowed: {', '.join(sorted(RESUMABLE_KEYS))}")
        directory.lock()  # a second resume of the same directory is refused, not interleaved
        try:
            state = directory.load_checkpoint()
            cfg = load_config(path / "config.yaml", overrides)
            _check_same_run(path, state, cfg)
            loaded.update(state=state, rows=directory.rows(), cfg=cfg)
        except BaseException:
            directory.unlock()
            raise
        if state["round"] >= cfg.rounds:
            print(f"{path}: already at round {state['round']} of {cfg.rounds}; nothing to do "
                  f"(extend with --set rounds=N)")
            directory.unlock()
            return None
        return cfg

    cfg = agree_on_config(ranks, load)
    if cfg is None:
        return History(loaded["rows"], loaded["cfg"].to_dict(), path) if ranks.is_root else None
    try:
        sim = _setup(cfg, quiet, progress, callbacks, ranks)
    except BaseException:
        if ranks.is_root:
            directory.unlock()
        raise
    if not ranks.is_root:
        return sim.run(None)
    try:
        # rows after the checkpoint happened after it, and are dropped (the rounds run again)
        state = loaded["state"]
        sim.restore(state, [r for r in loaded["rows"] if r["round"] <= state["round"]], path / "checkpoint.pt")
        save_config(sim.cfg, path / "config.yaml")
    except BaseException:
        directory.unlock()
        sim.pool.close()
        raise
    return sim.run(directory)


def agree_on_config(ranks: Ranks, load) -> Config | None:
    """The config of a run: rank 0's ``load()`` (None: nothing to run); the other ranks receive
    it. If loading fails on rank 0, the others stop quietly and rank 0 says why."""
    if ranks.world == 1:
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


def run_identity(cfg: Config) -> str:
    """The config of a run without the keys that may change on resume, as YAML: a checkpoint
    keeps it, so that a config.yaml edited by hand is not taken for the same run."""
    kept = {k: v for k, v in flatten_config(cfg.to_dict()) if k not in RESUMABLE_KEYS}
    return yaml.safe_dump(kept, sort_keys=True)


def _check_same_run(path: Path, state: dict, cfg: Config) -> None:
    identity = state.get("config")
    if not isinstance(identity, str):
        return  # a checkpoint from before runs recorded their identity
    before, now = yaml.safe_load(identity), yaml.safe_load(run_identity(cfg))

    # a key added since ran at its default. Mapping values are flattened (aggregator_options.beta,
    # system.speed.lognormal), so a key counts as recorded when the checkpoint holds it, a part of
    # its mapping, or the mapping it is part of.
    def recorded(key: str) -> bool:
        return any(r == key or r.startswith(key + ".") or key.startswith(r + ".") for r in before)

    before = {**{k: v for k, v in yaml.safe_load(run_identity(Config())).items() if not recorded(k)}, **before}
    changed = sorted(k for k in set(before) | set(now) if before.get(k, "(unset)") != now.get(k, "(unset)"))
    if changed:
        key = changed[0]
        raise ConfigError(f"{path}: config.yaml says {key}: {now.get(key)!r} but checkpoint.pt was written by a run "
                          f"with {before.get(key)!r}; they are not one run (restore the matching file, or start "
                          f"a new run)")


def _setup(cfg: Config, quiet: bool, progress: bool | None, callbacks=(), ranks: Ranks | None = None) -> Simulation:
    ranks = ranks or Ranks()
    kind = Simulation
    if cfg.mode == "hogwild":
        from .hogwild import HogwildSimulation as kind
    try:
        sim = kind(cfg, log=RoundLog(progress, quiet=quiet or not ranks.is_root), callbacks=callbacks, ranks=ranks)
    except FedsimError as e:
        raise locate(cfg, e) from None
    except (RuntimeError, OSError) as e:
        raise explain_resource_error(e) or e
    cfg.workers, cfg.device = sim.workers, str(sim.device)  # the resolved values, as they ran
    return sim
