"""Asynchronous rounds on the simulated clock (see fl/asynchronous.py for the methods): each call of
``run_round`` plays the clock forward until the next server update.

Events happen in the order of the simulated clock, never of the machine's: a client that
starts at time t finishes at t + its simulated duration, ties go to the earlier start. Which
client starts is drawn from the stream of the run's j-th start, so the order of events, and
every client's training stream (keyed by j), are functions of the seed alone.

Training is done lazily and in parallel batches: a client's update is only needed when it
arrives, and by then every client in flight has started from a model that is already known. So
when the next arrival has not been trained yet, every client in flight that has not been trained
is trained in one call of the executor, each slot from its own start (``slot_starts``). The
batches are functions of the event order alone, so the numbers do not depend on the number of
workers; the clients in flight (what they started from, or their trained weights) are part of
the checkpoint, so a resumed run trains the same batches and continues exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.blocks import all_finite
from ..core.errors import FedsimError
from ..core.streams import async_start_generator
from ..experiment.config import Config
from ..fl.asynchronous import make_method
from ..results.records import ClientRecord, RoundRow
from .loop import Engine, RoundResult
from .state import GlobalState
from .update import check_finite, stop_on_nonfinite, warn_dropped


@dataclass
class Job:
    """A client in flight."""

    number: int  # the run's j-th start: keys the choice of the client and its training stream
    client: int
    version: int  # the server updates applied before it started: the model it trains
    started_at: float  # simulated seconds
    finishes_at: float
    dropout: bool  # it fails before reporting: its work is lost and never trained
    start_weights: torch.Tensor | None = None  # the model it started from (one copy per version); None: dropout
    weights: torch.Tensor | None = None  # its trained weights, once trained
    loss: float = math.nan
    steps: int = 0

    def key(self) -> tuple[float, int]:
        return self.finishes_at, self.number


class Schedule:
    """What the clock holds between server updates: the time, the updates applied, the clients in
    flight. Part of an async run's global state, and of its checkpoint (a start shared by several
    clients is saved once)."""

    def __init__(self):
        self.clock, self.version, self.next_number = 0.0, 0, 0
        self.jobs: list[Job] = []

    def state_dict(self) -> dict:
        starts = {job.version: job.start_weights.cpu() for job in self.jobs if job.start_weights is not None}
        jobs = [
            {**vars(job), "start_weights": None, "weights": None if job.weights is None else job.weights.cpu()}
            for job in self.jobs
        ]
        return {
            "clock": self.clock,
            "version": self.version,
            "next_number": self.next_number,
            "starts": starts,
            "jobs": jobs,
        }

    def load_state_dict(self, state: dict, source: Path, like: torch.Tensor) -> None:
        """Continue from ``state``; ``like`` is the global weights, whose shape and device every
        model in flight has."""
        damaged = f"{source}: its clients in flight do not fit this run; it is not this run's checkpoint"
        try:
            jobs = [Job(**job) for job in state["jobs"]]
            clock, version, number = float(state["clock"]), int(state["version"]), int(state["next_number"])
            starts = dict(state["starts"])
        except (KeyError, TypeError, ValueError):
            raise FedsimError(damaged) from None

        def fits(t) -> bool:
            return isinstance(t, torch.Tensor) and t.shape == like.shape and bool(torch.isfinite(t).all())

        starts = {v: t.to(like.device) for v, t in starts.items() if fits(t)}
        for job in jobs:
            if not job.dropout:
                if job.version not in starts or not (job.weights is None or fits(job.weights)):
                    raise FedsimError(damaged)
                job.start_weights = starts[job.version]
                job.weights = None if job.weights is None else job.weights.to(like.device)
        self.clock, self.version, self.next_number, self.jobs = clock, version, number, jobs


class AsyncEngine(Engine):
    """An Engine whose round is one server update of FedBuff or FedAsync. It takes Engine's
    arguments; its update strategy and privacy are None (the method applies the updates)."""

    def __init__(self, cfg: Config, state: GlobalState, *parts: Any, **options: Any):
        super().__init__(cfg, state, *parts, **options)
        system = self.system
        self.method = make_method(cfg.asynchronous)
        self.schedule = state.schedule = Schedule()
        self.speeds = system.speeds(cfg.seed, cfg.data.num_clients)
        self.steps = system.local_steps(self.sizes)
        self.message = len(state.model) * state.model.flat.element_size()  # the weights travel whole, float32

    def run_round(self, rnd: int) -> RoundResult:
        s, t0, began = self.schedule, time.perf_counter(), self.schedule.clock
        records, used, started, train_seconds, busy, in_a_row = [], [], 0, 0.0, 0.0, 0
        total = None  # the sum of the weighted updates used
        while len(used) < self.method.updates_per_step:
            started += self._start_clients()
            job = min(s.jobs, key=Job.key)
            s.jobs.remove(job)
            s.clock = job.finishes_at
            if job.dropout:
                size = int(self.sizes[job.client])
                records.append(ClientRecord.lost(rnd, job.client, size, "dropout", 0, model_version=job.version))
                continue
            if job.weights is None:
                t = time.perf_counter()
                self._train_in_flight(rnd, job)
                train_seconds, busy = train_seconds + time.perf_counter() - t, busy + max(self.executor.busy_seconds)
            staleness = s.version - job.version
            finite = all_finite(job.weights)
            records.append(self._arrived(rnd, job, finite, staleness))
            if not finite:
                in_a_row += 1
                self._refuse_nonfinite(rnd, job, in_a_row)
                continue
            in_a_row = 0
            used.append(records[-1])
            update = self.method.contribution(job.weights, job.start_weights, self.state.model.flat, staleness)
            total = update if total is None else total.add_(update)
        warn_dropped(rnd, [r.client for r in records if r.dropped == "nonfinite"])
        t_trained = time.perf_counter()
        self._apply(rnd, self.method.step(total, len(used)))
        s.version += 1
        t_updated = time.perf_counter()
        evaluated, scores = self.evaluate_round(rnd)
        samples = sum(r.samples for r in used)
        down, up = started * self.message, len(used) * self.message
        self.state.bytes_sent += down + up
        self.state.simulated_time = s.clock
        row = RoundRow(
            round=rnd,
            **scores,
            train_loss=sum(r.train_loss * r.samples for r in used) / samples,
            seconds=round(time.perf_counter() - t0, 4),
            clients=len(records),
            attackers=0,
            train_seconds=round(train_seconds, 4),
            worker_seconds=round(busy, 4),
            aggregate_seconds=round(t_updated - t_trained, 4),
            eval_seconds=round(time.perf_counter() - t_updated, 4),
            bytes_down=down,
            bytes_up=up,
            cumulative_bytes=self.state.bytes_sent,
            unavailable=0,
            dropped_clients=len(records) - len(used),
            stragglers=0,
            simulated_seconds=s.clock - began,
            simulated_time=s.clock,
        )
        return RoundResult(row.as_row(), records, evaluated, torch.tensor([r.client for r in used], dtype=torch.int64))

    def _arrived(self, rnd: int, job: Job, finite: bool, staleness: int) -> ClientRecord:
        """The record of a client whose work reached the server: its update's norm where finite."""
        norm = float((job.weights - job.start_weights).norm()) if finite else math.nan
        return ClientRecord(
            rnd,
            job.client,
            int(self.sizes[job.client]),
            job.loss,
            norm,
            0 if finite else "nonfinite",
            0,
            job.steps,
            model_version=job.version,
            staleness=staleness,
        )

    # ------------------------------------------------------------------ the clock

    def _start_clients(self) -> int:
        """Fill the free places with clients that start now, from the current model: a client
        drawn uniformly among those not in flight, and whether it will drop out, from the
        stream of its start. Returns how many started."""
        cfg, s = self.cfg, self.schedule
        count = 0
        while len(s.jobs) < cfg.clients_per_round:
            busy = np.zeros(cfg.data.num_clients, dtype=bool)
            busy[[job.client for job in s.jobs]] = True
            idle = np.flatnonzero(~busy)
            rng = async_start_generator(cfg.seed, s.next_number)
            client = int(idle[rng.integers(len(idle))])
            dropout = bool(rng.random() < self.system.spec.dropout)
            seconds = float(self.steps[client]) * self.system.spec.step_seconds / float(self.speeds[client])
            s.jobs.append(
                Job(
                    s.next_number,
                    client,
                    s.version,
                    s.clock,
                    s.clock + seconds,
                    dropout,
                    None if dropout else self._current_start(),
                )
            )
            s.next_number += 1
            count += 1
        return count

    def _current_start(self) -> torch.Tensor:
        """The current global weights as the clients that start now keep them: one copy per
        server update, shared by every client that starts from it."""
        for job in self.schedule.jobs:
            if job.version == self.schedule.version and job.start_weights is not None:
                return job.start_weights
        return self.state.model.flat.clone()

    def _refuse_nonfinite(self, rnd: int, job: Job, in_a_row: int) -> None:
        """``stop_on_nonfinite``, the engines' one rule, with ``clients_per_round`` clients training at
        once. It counts the non-finite arrivals since the last usable one (``in_a_row``), not those of
        this server update: a buffer that already holds a usable update must not wait forever for
        the next."""
        cfg = self.cfg
        server_lr = cfg.asynchronous.method == "fedbuff" and cfg.server_optimizer != "none"
        stop_on_nonfinite(
            cfg,
            self.state,
            rnd,
            job.client,
            in_a_row,
            cfg.clients_per_round,
            f"the last {in_a_row} client updates (clients_per_round, as many as train at once) are all",
            f"lower local.lr{' or server_lr' if server_lr else ''}, or check the model's output",
        )

    # ------------------------------------------------------------------ training and the update

    def _train_in_flight(self, rnd: int, needed: Job) -> None:
        """Train ``needed`` and every other client in flight not trained yet, in one batch (by
        start), each from the model it started from."""
        b = self.buffers
        jobs = sorted(
            [needed] + [j for j in self.schedule.jobs if j.weights is None and not j.dropout], key=lambda j: j.number
        )
        clients, k = [job.client for job in jobs], len(jobs)
        for i, job in enumerate(jobs):
            b.slot_starts[i].copy_(job.start_weights)
        b.slot_keys[:k] = torch.tensor([job.number for job in jobs], dtype=torch.int64)
        b.step_limits[:k] = -1 if self.system.max_steps is None else torch.from_numpy(self.steps[clients])
        for name, rows in self.state.client_rows(clients).items():
            b.client_state[name][:k].copy_(rows)
        self.executor.train(rnd, torch.tensor(clients, dtype=torch.int64), self.state.model.flat)
        stats = b.stats[:k].cpu()
        for i, job in enumerate(jobs):
            job.weights, job.loss, job.steps = b.client_weights[i].clone(), float(stats[i, 1]), int(stats[i, 2])

    def _apply(self, rnd: int, delta: torch.Tensor) -> None:
        """The server optimizer's step (validation leaves FedAsync only ``none``, which adds it)."""
        state = self.state
        state.step(delta)
        check_finite(
            state,
            state.model.flat,
            rnd,
            f"{self.cfg.asynchronous.method}'s update made the global weights non-finite",
            " although every client update used was finite",
            "lower local.lr or asynchronous.mixing",
        )
