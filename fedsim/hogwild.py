"""``mode: hogwild``: the workers train one shared model, asynchronously and without locks.

Hogwild (Recht, Re, Wright & Niu 2011, "Hogwild!: A lock-free approach to parallelizing
stochastic gradient descent"), the scheme of pytorch/examples' ``mnist_hogwild``: the model's
weights live in memory that every worker maps (shared memory on a CPU, CUDA IPC on a GPU), and
each worker's optimizer steps on them in place while the others read and write them too.
Nothing is averaged: every step of every worker lands in the one model as it is taken.

A round is one pass over every client: client ``c`` is trained by worker ``c mod W`` for
``local.epochs``, with an optimizer of its own (its momentum lives in the worker and starts at
zero for each client). The server waits for the round's workers, takes the shared weights as
the global model, evaluates them and records the round as a synchronous run does.

The engine is the synchronous one with two parts swapped: the workers' routine
(``HogwildRunner``: train the shared weights instead of a copy) and the server's update
(``HogwildSimulation``: adopt the shared weights instead of aggregating copies). Start-up,
failure detection, timeouts, restarts, interrupts, checkpoints and the results files are the
same code. What does not carry over is determinism: how the workers' steps interleave is up to
the scheduler, so with more than one worker the numbers differ from run to run and depend on
``workers``. With one worker (or ``workers: 0``) the clients are trained one after another, and
the run is exactly repeatable.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import components
from .algorithms import Round
from .config import Config
from .errors import ConfigError, NonFiniteError
from .flat import FlatModel
from .server import Simulation
from .streams import client_seed
from .workers import ClientRunner


def check_config(cfg) -> None:
    """Refuse, in one line naming the key, every setting that hogwild would silently ignore."""
    n = cfg.data.num_clients
    default = Config()
    system = [f"system.{f.name}" for f in dataclasses.fields(cfg.system)
              if getattr(cfg.system, f.name) != getattr(default.system, f.name)]
    refused = [
        ("algorithm", components.describe(cfg.algorithm) != "fedavg",
         "hogwild trains by plain local SGD, with no client term and no server update; use algorithm: fedavg"),
        ("aggregator", components.describe(cfg.aggregator) != "fedavg",
         "hogwild aggregates nothing (every step lands in the one shared model); use aggregator: fedavg"),
        ("server_optimizer", cfg.server_optimizer != "none",
         "hogwild has no aggregated update for a server optimizer to apply; use server_optimizer: none"),
        ("attack.type", cfg.attack.type != "none",
         "hogwild has no client updates for an attack to rewrite; use attack.type: none"),
        ("backend", cfg.backend != "process",
         "vmap trains copies of the weights; hogwild trains the shared weights themselves: use backend: process"),
        ("clients_per_round", cfg.clients_per_round != n,
         f"a hogwild round is one pass over every client; set it to data.num_clients ({n}), "
         f"got {cfg.clients_per_round}"),
        ("privacy", cfg.privacy is not None,
         "DP-FedAvg clips and noises client updates, which hogwild does not have; remove the privacy section"),
        ("client_sampling", cfg.client_sampling != default.client_sampling,
         "a hogwild round trains every client, so there is no sample to choose; use client_sampling: uniform"),
        ("sampling_candidates", cfg.sampling_candidates is not None,
         "a hogwild round trains every client, so there is no sample to choose; leave it unset"),
        (system[0] if system else "system", bool(system),
         "system heterogeneity is simulated for synchronous rounds only; leave the system section out"),
    ]
    for key, bad, why in refused:
        if bad:
            raise ConfigError(f"{key}: {why} (mode: hogwild)")


class HogwildRunner(ClientRunner):
    """A worker's routine in hogwild mode: its model's weights are the shared global weights."""

    def _flat_model(self, module, device: torch.device) -> FlatModel:
        return FlatModel(module, device, flat=self.shared.global_flat)

    def train_group(self, slots: list[int], rnd: int) -> None:
        s = self.shared
        (slot,) = slots  # the process backend: one client per group
        client = int(s.assignment[slot])
        indices = self._indices(client)
        trained = self.trainer.train(indices, None, client_seed(self.config.seed, rnd, client))
        s.stats[slot, 0] = len(indices)
        s.stats[slot, 1].copy_(trained.loss[0])
        s.stats[slot, 2].copy_(trained.steps[0])


class HogwildSimulation(Simulation):
    """The round loop of ``Simulation``, with the shared weights adopted instead of aggregated."""

    runner = HogwildRunner
    client_copies = False  # the clients train the shared weights: no [k, P] stack of copies

    def __init__(self, cfg, log=None, callbacks=(), ranks=None):
        if ranks is not None and ranks.world > 1:
            raise ConfigError("mode: hogwild shares one model in one machine's memory; run it as a single "
                              "process, without torchrun")
        super().__init__(cfg, log, callbacks, ranks)

    def _collect(self, rnd: int, clients: torch.Tensor) -> tuple[Round, list[dict]]:
        """One record per client. No client has an update of its own (its steps are already in the
        shared weights), so update_norm is NaN, and none can be dropped."""
        s, k = self.shared, len(clients)
        stats = s.stats[:k].cpu()
        records = [{"round": rnd, "client": int(c), "samples": int(stats[i, 0]), "train_loss": float(stats[i, 1]),
                    "update_norm": math.nan, "dropped": 0, "attacker": 0, "steps": int(stats[i, 2])}
                   for i, c in enumerate(clients.tolist())]
        round_ = Round(updates=s.local_flat, weights=s.stats[:k, 0], clients=clients, reports={},
                       aggregate=self.aggregate, global_weights=self.model.flat, num_params=self.model.num_params,
                       num_clients=self.cfg.data.num_clients)
        return round_, records

    def _update(self, rnd: int, round_: Round) -> None:
        """The shared weights, as the workers left them, become the global model; non-finite ones
        stop the run (whatever on_nonfinite says: there is no client's update to leave out)."""
        if not torch.isfinite(self.shared.global_flat).all():
            kept = (f"the checkpoint of round {self.checkpoint_round} is kept" if self.checkpoint_round
                    else "no checkpoint was written")
            raise NonFiniteError(f"round {rnd}: the shared weights became non-finite (NaN/Inf) during training "
                                 f"(mode: hogwild); nothing of this round was saved and {kept}; lower local.lr")
        self.model.flat.copy_(self.shared.global_flat)
