"""The round loop: sample clients, train them in the worker pool, aggregate, evaluate, record.

All randomness is a function of (seed, round, client): the client sample of a round, each
client's shuffling and dropout, the attack noise. A run therefore gives the same numbers
whatever the number of workers, and a resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import importlib
import math
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from . import aggregation
from .attacks import attacker_mask, corrupt_updates
from .client import derive_seed
from .config import Config, apply_overrides, load_config, locate, save_config, work_items
from .data import load_dataset, options_for, partition
from .errors import (ConfigError, FedsimError, NonFiniteError, OutputError, WorkerError,
                     explain_resource_error)
from .interrupts import shielded
from .flat import FlatModel
from .models import build_model
from .progress import RoundLog
from .results import History, RunDirectory, flatten_config
from .server_opt import make_server_optimizer
from .workers import Shared, WorkerPool, peak_rss_bytes

_SAMPLE_STREAM, _ATTACK_STREAM = 1, 2  # keys that keep the server's random streams apart
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


def sample_clients(seed: int, rnd: int, num_clients: int, k: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, _SAMPLE_STREAM, rnd])
    return torch.from_numpy(np.sort(rng.choice(num_clients, size=k, replace=False)))


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
    """One run: the data on the device, the global model, the worker pool, the round loop."""

    def __init__(self, cfg: Config, log=print):
        self.cfg, self.log = cfg, log
        self.t_start = time.perf_counter()
        torch.multiprocessing.set_sharing_strategy(cfg.sharing_strategy)
        self.device = resolve_device(cfg.device)
        self.workers = resolve_workers(cfg, self.device)
        self.pool = WorkerPool(cfg, self.workers, self.device)  # they import torch while the data loads
        try:
            self._prepare()
        except BaseException:
            self.pool.close()
            raise

    def _prepare(self) -> None:
        """The data on its device, the clients' index ranges, the global model, the buffers."""
        cfg, log = self.cfg, self.log
        data = load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.limit, cfg.data.download)
        parts = partition(data.train_y, cfg.data.partition, cfg.data.num_clients, cfg.seed,
                          **options_for(cfg.data.partition, cfg.data))
        sizes = [len(p) for p in parts]
        if 0 in sizes:
            raise ConfigError(f"data.partition: client {sizes.index(0)} gets no samples; "
                              f"use fewer clients or more data")
        torch.manual_seed(cfg.seed)
        self.model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes), self.device)
        if cfg.backend == "vmap" and len(self.model) != self.model.num_params:
            raise ConfigError(f"backend: vmap cannot train {cfg.model}, whose batch-norm statistics are not "
                              f"parameters; use backend: process")
        self.data_device = data_placement(cfg.data.placement, data, self.device)
        if self.data_device != self.device:
            log(f"{cfg.data.dataset} is kept in host memory (data.placement); batches are copied to {self.device}")
        self.test_x, self.test_y = data.test_x.to(self.data_device), data.test_y.to(self.data_device)
        self.shared = self._allocate(data, parts)
        self.aggregate = aggregation.get(cfg.aggregator, **cfg.aggregator_options)
        self.server_opt = make_server_optimizer(cfg, self.model.num_params, self.device)
        self.rows: list[dict] = []
        self.first_round = 1
        self.checkpoint_round = 0
        self.startup_seconds = None
        self.worker_peak_memory_mb: list[float] = []
        self.elapsed_before = 0.0  # wall seconds a resumed run had spent before it stopped

    def _allocate(self, data, parts) -> Shared:
        cfg, k, p, dev = self.cfg, self.cfg.clients_per_round, len(self.model), self.device
        scaffold = cfg.algorithm == "scaffold"
        n = self.model.num_params
        return Shared(
            train_x=data.train_x.to(self.data_device), train_y=data.train_y.to(self.data_device),
            client_indices=torch.cat(parts).to(self.data_device),
            client_offsets=torch.tensor([0] + np.cumsum([len(q) for q in parts]).tolist()),
            num_classes=data.num_classes,
            global_flat=torch.zeros(p, device=dev), local_flat=torch.zeros(k, p, device=dev),
            stats=torch.zeros(k, 2, device=dev),
            assignment=torch.zeros(k, dtype=torch.int64),
            progress=torch.zeros(max(self.workers, 1), dtype=torch.int64),
            attackers=attacker_mask(cfg.seed, cfg.data.num_clients, cfg.attack),
            server_control=torch.zeros(n, device=dev) if scaffold else None,
            client_controls=torch.zeros(cfg.data.num_clients, n, device=dev) if scaffold else None,
            control_deltas=torch.zeros(k, n, device=dev) if scaffold else None,
        ).share_cpu_tensors()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, rnd: int, elapsed: float) -> dict:
        s = self.shared
        state = {
            "round": rnd,
            "elapsed_seconds": elapsed,
            "global": self.model.flat.cpu(),
            "server_optimizer": {k: v.cpu() for k, v in self.server_opt.state_dict().items()},
            "torch_rng": torch.get_rng_state(),
            "config": run_identity(self.cfg),
        }
        if s.client_controls is not None:
            state["server_control"] = s.server_control.cpu()
            state["client_controls"] = s.client_controls.cpu()
        return state

    def restore(self, state: dict, rows: list[dict], source: Path) -> None:
        """Continue from ``state``, the checkpoint read from the file ``source``."""
        s = self.shared
        self._check_checkpoint(state, source)
        self.model.flat.copy_(state["global"])
        self.server_opt.load_state_dict(state["server_optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if s.client_controls is not None:
            s.server_control.copy_(state["server_control"])
            s.client_controls.copy_(state["client_controls"])
        self.first_round = state["round"] + 1
        self.checkpoint_round = state["round"]
        self.elapsed_before = state["elapsed_seconds"]
        self.rows = rows

    def _check_checkpoint(self, state: dict, source: Path) -> None:
        """Every tensor the run restores must be there with this run's shape: a checkpoint
        copied from a run of another model (or torn by hand) is refused in one line."""
        s = self.shared
        expected = {"global": self.model.flat, "torch_rng": torch.get_rng_state()}
        expected.update({f"server_optimizer.{k}": v for k, v in self.server_opt.state_dict().items()})
        if s.client_controls is not None:
            expected.update(server_control=s.server_control, client_controls=s.client_controls)
        saved = state.get("server_optimizer")
        unexpected = sorted(set(saved) - set(self.server_opt.state_dict())) if isinstance(saved, dict) else []
        if unexpected:
            raise FedsimError(f"{source}: holds server_optimizer.{unexpected[0]}, which {self.cfg.server_optimizer} "
                              f"does not keep; it is not this run's checkpoint")
        for key, like in expected.items():
            section, _, name = key.partition(".")
            value = state.get(section)
            if name:
                value = value.get(name) if isinstance(value, dict) else None
            if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "nothing"
                raise FedsimError(f"{source}: holds {got} for {key} where this run ({self.cfg.model}, "
                                  f"{self.cfg.algorithm}, {self.cfg.server_optimizer}) needs {tuple(like.shape)}; "
                                  f"it is not this run's checkpoint")

    # ------------------------------------------------------------------ the loop

    def run(self, run_dir: RunDirectory) -> History:
        cfg, self.run_dir = self.cfg, run_dir
        status = "interrupted"
        pool = self.pool
        try:
            # the plot at the end needs matplotlib (most of a second to import): import it
            # while the workers start, when this process only waits
            threading.Thread(target=importlib.import_module, args=("fedsim.plot",), daemon=True).start()
            self._start(pool)
            self.log(f"{cfg.name}: {cfg.rounds} rounds of {cfg.clients_per_round}/{cfg.data.num_clients} clients, "
                     f"{self.workers} workers on {self.device}; writing {self.run_dir.path}")
            slowest = 0.0
            for rnd in range(self.first_round, cfg.rounds + 1):
                t0 = time.perf_counter()
                timeout = cfg.worker_timeout or (_FIRST_ROUND_TIMEOUT if slowest == 0 else max(120.0, 10 * slowest))
                pool = self._train_round(pool, rnd, timeout)
                evaluated = rnd % cfg.eval_every == 0 or rnd == cfg.rounds
                row = self._finish_round(rnd, t0, evaluated, train_seconds=time.perf_counter() - t0,
                                         worker_seconds=max(pool.busy_seconds))
                slowest = max(slowest, time.perf_counter() - t0)
                reached = self._reached_target(row)
                with shielded():  # the row, the checkpoint and the line stay in step
                    if evaluated:
                        self.rows.append(row)
                        self.run_dir.append(row)
                    if cfg.checkpoint_every and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds or reached):
                        self.run_dir.save_checkpoint(self.state_dict(rnd, row["elapsed_seconds"]))
                        self.checkpoint_round = rnd
                    self.log(_round_line(row, cfg.rounds))  # once printed, the round is on disk
                    if reached or rnd == cfg.rounds:
                        status = "finished"  # whatever arrives from here on, every round is done
                if reached:
                    self.log(f"reached stop_at_accuracy {cfg.stop_at_accuracy} in round {rnd}")
                    break
        except FedsimError:
            status = "failed"
            raise
        except (RuntimeError, OSError) as e:
            status = "failed"
            raise explain_resource_error(e) or e
        finally:
            ended_by = sys.exc_info()[1]  # the error that ends the run, if one does
            with shielded():
                self.worker_peak_memory_mb = [round(b / 2**20, 1) for b in pool.peak_memory]
                pool.close()
                try:
                    self._write_summary(status)
                except FedsimError as e:
                    if status == "finished":
                        raise
                    if not isinstance(ended_by, OutputError):  # a failing disk is said once
                        self.log.warn(f"could not write the summary and plot: {e}")  # never mask what ended the run
                finally:
                    self.run_dir.unlock()
                    self.log.close()  # an error or interrupt message starts on a line of its own
        return History(self.rows, cfg.to_dict(), self.run_dir.path, self.summary)

    def _start(self, pool: WorkerPool) -> WorkerPool:
        pool.start(self.shared, timeout=max(self.cfg.worker_timeout or 0, _START_TIMEOUT))
        if self.startup_seconds is None:  # data on the device, workers spawned and ready
            self.startup_seconds = round(time.perf_counter() - self.t_start, 3)
        return pool

    def _train_round(self, pool: WorkerPool, rnd: int, timeout: float) -> WorkerPool:
        clients = sample_clients(self.cfg.seed, rnd, self.cfg.data.num_clients, self.cfg.clients_per_round)
        self.shared.global_flat.copy_(self.model.flat)
        self.clients = clients
        for attempt in range(3):
            try:
                pool.run_round(rnd, clients, timeout)
                return pool
            except WorkerError as e:
                if self.cfg.on_worker_failure != "restart" or attempt == 2:
                    raise
                self.log.warn(f"round {rnd}: {e}; restarting the workers and re-running the round")
                pool.close()
                pool = self._start(WorkerPool(self.cfg, self.workers, self.device))

    def _finish_round(self, rnd: int, t0: float, evaluated: bool, train_seconds: float,
                      worker_seconds: float) -> dict:
        cfg, s, clients = self.cfg, self.shared, self.clients
        k, n = len(clients), self.model.num_params
        updates = s.local_flat[:k].sub_(self.model.flat)  # client weights - global weights, in place
        attacking = s.attackers[clients]
        corrupt_updates(cfg.attack, updates, attacking.nonzero().flatten().to(updates.device),
                        torch.Generator().manual_seed(derive_seed(cfg.seed, _ATTACK_STREAM, rnd)))
        finite = torch.isfinite(updates).all(dim=1)
        if s.control_deltas is not None:
            finite &= torch.isfinite(s.control_deltas[:k]).all(dim=1)
        keep = finite.nonzero().flatten()
        dropped = k - len(keep)
        if dropped:
            bad = clients[(~finite).cpu()].tolist()
            if cfg.on_nonfinite == "fail":
                raise NonFiniteError(f"round {rnd}: client {bad[0]} sent non-finite (NaN/Inf) weights "
                                     f"(on_nonfinite: fail; use drop to leave such clients out)")
            self.log.warn(f"round {rnd}: dropped {dropped} client(s) with non-finite weights: {bad}")
        sizes, losses = s.stats[keep, 0], s.stats[keep, 1]
        if len(keep):
            delta = self.aggregate(updates[keep], sizes)
            self._check_finite(delta, rnd, f"the aggregator {cfg.aggregator} returned a non-finite update")
            self.server_opt.step(self.model.params, delta[:n])
            self.model.flat[n:].add_(delta[n:])  # buffers (batch-norm statistics) are averaged as they are
            self._check_finite(self.model.flat, rnd, f"the server optimizer {cfg.server_optimizer} made the "
                                                     f"global weights non-finite")
            if s.control_deltas is not None:
                kept_clients = clients[keep.cpu()].to(s.client_controls.device)
                s.server_control.add_(s.control_deltas[keep].sum(dim=0), alpha=1 / cfg.data.num_clients)
                s.client_controls[kept_clients] += s.control_deltas[keep]
                self._check_finite(s.server_control, rnd, "SCAFFOLD's server control variate became non-finite")
        train_loss = float((sizes * losses).sum() / sizes.sum()) if len(keep) else math.nan  # syncs the device
        t_aggregated = time.perf_counter()
        accuracy, test_loss = math.nan, math.nan
        if evaluated:
            accuracy, test_loss = evaluate(self.model.module, self.test_x, self.test_y, cfg.eval_batch_size)
        seconds = time.perf_counter() - t0
        elapsed = self.elapsed_before + time.perf_counter() - self.t_start
        return {"round": rnd, "test_accuracy": accuracy, "test_loss": test_loss, "train_loss": train_loss,
                "seconds": round(seconds, 4), "elapsed_seconds": round(elapsed, 4), "clients": k,
                "dropped_clients": dropped, "attackers": int(attacking.sum()),
                "train_seconds": round(train_seconds, 4), "worker_seconds": round(worker_seconds, 4),
                "aggregate_seconds": round(t_aggregated - t0 - train_seconds, 4),
                "eval_seconds": round(time.perf_counter() - t_aggregated, 4)}

    def _check_finite(self, tensor: torch.Tensor, rnd: int, what: str) -> None:
        """The global state must stay finite even when every client update is (a rule or a server
        optimizer can overflow): stop before such a state is evaluated or checkpointed."""
        if not torch.isfinite(tensor).all():
            kept = f"the checkpoint of round {self.checkpoint_round} is kept" if self.checkpoint_round else \
                "no checkpoint was written"
            raise NonFiniteError(f"round {rnd}: {what} (NaN/Inf) although every client update used was finite; "
                                 f"nothing of this round was saved and {kept}; lower server_lr or attack.scale, or "
                                 f"bound updates with aggregator: norm_clip")

    def _reached_target(self, row: dict) -> bool:
        target = self.cfg.stop_at_accuracy
        return target is not None and not math.isnan(row["test_accuracy"]) and row["test_accuracy"] >= target

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


def _round_line(row: dict, rounds: int) -> str:
    width = len(str(rounds))
    acc = "   -  " if math.isnan(row["test_accuracy"]) else f"{row['test_accuracy']:.4f}"
    loss = "   -  " if math.isnan(row["test_loss"]) else f"{row['test_loss']:.4f}"
    extra = f"  dropped {row['dropped_clients']}" if row["dropped_clients"] else ""
    return (f"round {row['round']:>{width}}/{rounds}  test acc {acc}  test loss {loss}  "
            f"train loss {row['train_loss']:.4f}  {row['seconds']:.2f} s{extra}")


# ----------------------------------------------------------------------------- entry points


def run(config="experiments/mnist_seed.yaml", *, out=None, overwrite: bool = False, quiet: bool = False,
        progress: bool | None = None, **overrides) -> History:
    """Run an experiment and return its History.

    ``config`` is a YAML path, a dict or a Config; ``overrides`` set keys, dotted ones via
    ``**{"local.lr": 0.05}`` or whole sections as dicts (``data={"limit": 2000}``). Files go
    to ``out`` (default ``runs/<name>-<timestamp>``). ``progress``: show the rounds as one
    updating line (None: only on a terminal); ``quiet``: print no per-round lines at all.
    """
    return start_run(load_config(config, overrides), out=out, overwrite=overwrite, quiet=quiet, progress=progress)


def resume(run_dir, *, quiet: bool = False, progress: bool | None = None, **overrides) -> History:
    """Continue a run from its last checkpoint; ``rounds=N`` extends it."""
    return resume_run(run_dir, overrides, quiet=quiet, progress=progress)


def start_run(cfg: Config, out=None, overwrite: bool = False, quiet: bool = False, progress=None) -> History:
    """Run ``cfg`` into ``out`` (default ``runs/<name>-<timestamp>``)."""
    path = RunDirectory.target(out, cfg.name, overwrite)  # refuse a taken --out before loading anything
    sim = _setup(cfg, quiet, progress)
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


def resume_run(run_dir, overrides=None, quiet: bool = False, progress=None) -> History:
    """Continue ``run_dir`` from its checkpoint; ``overrides`` is a list of "key=value"
    strings (the CLI's --set) or a dict, limited to keys that keep it one run."""
    path = Path(run_dir)
    if not (path / "config.yaml").is_file():
        raise FedsimError(f"--resume {path}: not a run directory (no config.yaml)")
    bad = sorted(apply_overrides({}, overrides or {}) - RESUMABLE_KEYS)
    if bad:
        raise ConfigError(f"--set {bad[0]}: cannot change when resuming (the rounds before and after would not "
                          f"be one run); allowed: {', '.join(sorted(RESUMABLE_KEYS))}")
    directory = RunDirectory(path)
    directory.lock()  # a second resume of the same directory is refused, not interleaved
    try:
        state = directory.load_checkpoint()
        cfg = load_config(path / "config.yaml", overrides)
        _check_same_run(path, state, cfg)
        rows = directory.rows()
        if state["round"] >= cfg.rounds:
            print(f"{path}: already at round {state['round']} of {cfg.rounds}; nothing to do "
                  f"(extend with --set rounds=N)")
            directory.unlock()
            return History(rows, cfg.to_dict(), path)
        sim = _setup(cfg, quiet, progress)
    except BaseException:
        directory.unlock()
        raise
    try:
        # rows after the checkpoint happened after it, and are dropped (the rounds run again)
        sim.restore(state, [r for r in rows if r["round"] <= state["round"]], path / "checkpoint.pt")
        directory.write_rows(sim.rows)
        save_config(sim.cfg, path / "config.yaml")
    except BaseException:
        directory.unlock()
        sim.pool.close()
        raise
    return sim.run(directory)


def run_identity(cfg: Config) -> str:
    """The config of a run without the keys that may change on resume, as YAML: a checkpoint
    keeps it, so that a config.yaml edited by hand is not taken for the same run."""
    kept = {k: v for k, v in flatten_config(cfg.to_dict()) if k not in RESUMABLE_KEYS}
    return yaml.safe_dump(kept, sort_keys=True)


def _check_same_run(path: Path, state: dict, cfg: Config) -> None:
    recorded = state.get("config")
    if not isinstance(recorded, str):
        return  # a checkpoint from before runs recorded their identity
    before, now = yaml.safe_load(recorded), yaml.safe_load(run_identity(cfg))
    changed = sorted(k for k in set(before) | set(now) if before.get(k, "(unset)") != now.get(k, "(unset)"))
    if changed:
        key = changed[0]
        raise ConfigError(f"{path}: config.yaml says {key}: {now.get(key)!r} but checkpoint.pt was written by a run "
                          f"with {before.get(key)!r}; they are not one run (restore the matching file, or start "
                          f"a new run)")


def _setup(cfg: Config, quiet: bool, progress: bool | None) -> Simulation:
    try:
        sim = Simulation(cfg, log=RoundLog(progress, quiet=quiet))
    except FedsimError as e:
        raise locate(cfg, e) from None
    except (RuntimeError, OSError) as e:
        raise explain_resource_error(e) or e
    cfg.workers, cfg.device = sim.workers, str(sim.device)  # the resolved values, as they ran
    return sim
