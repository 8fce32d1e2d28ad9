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
(``HogwildRunner``: train the shared weights instead of a copy) and the update strategy
(``AdoptSharedWeights``: adopt the shared weights instead of aggregating copies). Start-up,
failure detection, timeouts, restarts, interrupts, checkpoints and the results files are the
same code. What does not carry over is determinism: how the workers' steps interleave is up to
the scheduler, so with more than one worker the numbers differ from run to run and depend on
``workers``. With one worker (or ``workers: 0``) the clients are trained one after another, and
the run is exactly repeatable.
"""

from __future__ import annotations

import math

import torch

from ..algorithms import Round
from ..core.flat import FlatModel
from ..core.streams import client_seed
from ..engine.buffers import RoundBuffers
from ..engine.state import GlobalState
from ..engine.update import check_finite
from ..experiment.config import Config
from ..results.records import ClientRecord
from .runner import ClientRunner


class HogwildRunner(ClientRunner):
    """A worker's routine in hogwild mode: its model's weights are the shared global weights."""

    def flat_model(self, module: torch.nn.Module, device: torch.device) -> FlatModel:
        return FlatModel(module, device, flat=self.buffers.global_flat, base=self.base)

    def train_group(self, slots: list[int], rnd: int) -> None:
        b = self.buffers
        (slot,) = slots  # the process backend: one client per group
        client = int(b.assignment[slot])
        indices = b.client_samples(client)
        self.trainer.lr = self.config.local.round_lr(rnd, self.config.rounds)
        trained = self.trainer.train(indices, None, client_seed(self.config.seed, rnd, client))
        b.stats[slot, 0] = len(indices)
        b.stats[slot, 1].copy_(trained.loss[0])
        b.stats[slot, 2].copy_(trained.steps[0])


class AdoptSharedWeights:
    """The update strategy of hogwild: the shared weights, as the workers left them, become the
    global model."""

    def __init__(self, cfg: Config, state: GlobalState, buffers: RoundBuffers):
        self.cfg, self.state, self.buffers = cfg, state, buffers

    def message_bytes(self) -> None:
        """Nothing travels: the workers train the one shared model in this machine's memory."""
        return None

    def collect(self, rnd: int, clients: torch.Tensor) -> tuple[Round, list[ClientRecord]]:
        """One record per client. No client has an update of its own (its steps are already in the
        shared weights), so update_norm is NaN, and none can be dropped."""
        b, k = self.buffers, len(clients)
        stats = b.stats[:k].cpu()
        records = [
            ClientRecord(rnd, int(c), int(stats[i, 0]), float(stats[i, 1]), math.nan, 0, 0, int(stats[i, 2]))
            for i, c in enumerate(clients.tolist())
        ]
        round_ = Round(
            updates=b.client_weights,
            weights=b.stats[:k, 0],
            clients=clients,
            reports={},
            aggregate=None,
            global_weights=self.state.model.flat,
            num_params=self.state.model.num_params,
            num_clients=self.cfg.data.num_clients,
            number=rnd,
        )
        return round_, records

    def update(self, rnd: int, round_: Round) -> None:
        """Non-finite shared weights stop the run (whatever on_nonfinite says: there is no
        client's update to leave out)."""
        check_finite(
            self.state,
            self.buffers.global_flat,
            rnd,
            "the shared weights became non-finite",
            " during training (mode: hogwild)",
            "lower local.lr",
        )
        self.state.model.flat.copy_(self.buffers.global_flat)
