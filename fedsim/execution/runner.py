"""What a worker does with its share of a round: train the clients of some slots from the
global weights into their rows of the round's buffers. The same code runs in a worker process
and, with ``workers: 0``, in the server itself."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from ..algorithms import Clients, LocalResult
from ..algorithms.group import GroupTrainer
from ..algorithms.local import LocalTrainer, Trained
from ..core.flat import FlatModel
from ..core.streams import client_seed, group_seed
from ..data.augment import augmentation_for
from ..engine.buffers import RoundBuffers
from ..experiment import components
from ..experiment.config import Config
from ..fl.attacks import checked_relabel, make_attack
from .resources import peak_rss_bytes


class ClientRunner:
    """Per-worker state: the model, the trainer, the algorithm and the attack."""

    def __init__(self, config: Config, buffers: RoundBuffers, device: torch.device):
        self.config, self.buffers, self.device = components.from_server(config), buffers, device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        input_shape = tuple(buffers.train_x.shape[1:])
        # a frozen base is the server's, placed once: the model is built without values of its own
        with torch.device("meta") if buffers.base else contextlib.nullcontext():
            module = components.run_model(config, input_shape, buffers.num_classes)
        # a copy of the base per worker, as simulators that load the model in every client do
        self.base = buffers.base if config.lora.share_base else {k: t.clone() for k, t in buffers.base.items()}
        self.algorithm = components.algorithm(config.algorithm, config.algorithm_options)
        self.algorithm.setup(config)
        self.algorithm.bind(module)
        self.attack = make_attack(config.attack)
        self.relabel = checked_relabel(self.attack, components.describe(config.attack.type))
        options = dict(
            num_classes=buffers.num_classes,
            algorithm=self.algorithm,
            augment=augmentation_for(config.data, input_shape),
        )
        self.model = self.flat_model(module, device)  # the frozen base placed, where there is one
        if config.backend == "vmap":
            self.trainer = GroupTrainer(self.model.module, buffers.train_x, buffers.train_y, config.local, **options)
        else:
            self.trainer = LocalTrainer(self.model, buffers.train_x, buffers.train_y, config.local, **options)

    def flat_model(self, module: torch.nn.Module, device: torch.device) -> FlatModel:
        """The model the clients train: a copy of the global weights, this worker's own, on the
        frozen base (if any)."""
        return FlatModel(module, device, base=self.base)

    def train_group(self, slots: list[int], rnd: int) -> None:
        cfg, b = self.config, self.buffers
        self.trainer.lr = cfg.local.round_lr(rnd, cfg.rounds)
        clients = [int(b.assignment[slot]) for slot in slots]
        rows = slice(slots[0], slots[-1] + 1)
        ids = torch.tensor(clients, device=b.global_flat.device)
        local_state = self.algorithm.start_client(
            Clients(ids, rnd, b.server_state, {name: state[rows].clone() for name, state in b.client_state.items()})
        )
        indices = [b.client_samples(c) for c in clients]
        attacked = b.attackers[clients]
        relabel = self.relabel if self.attack.relabels and bool(attacked.any()) else None
        limits = [None if limit < 0 else limit for limit in b.step_limits[rows].tolist()]
        keys = b.slot_keys[rows].tolist()  # the round, or an async run's starts
        # the weights the slots start from: the round's global ones, or (async) each slot's own
        async_ = len(b.slot_starts) > 0
        start = b.slot_starts[rows] if async_ else b.global_flat
        if cfg.backend == "vmap":
            weights, trained = self.trainer.train(
                indices,
                start,
                [client_seed(cfg.seed, key, c) for key, c in zip(keys, clients)],
                group_seed(cfg.seed, keys[0], slots[0]),
                local_state=local_state,
                relabel=relabel,
                attacked=attacked.to(self.device),
                max_steps=limits,
            )
            b.client_weights[rows].copy_(weights)
        else:
            start = start[0] if async_ else start
            trained = self.train_phases(
                indices[0],
                start,
                client_seed(cfg.seed, keys[0], clients[0]),
                limits[0],
                local_state=local_state,
                relabel=relabel,
            )
            b.client_weights[rows].copy_(self.model.flat)
        sizes = torch.tensor([len(ix) for ix in indices], dtype=b.stats.dtype)
        b.stats[rows, 0] = sizes
        b.stats[rows, 1].copy_(trained.loss)
        b.stats[rows, 2].copy_(trained.steps)
        reports = self.algorithm.client_report(
            LocalResult(start, b.client_weights[rows], trained.steps, sizes, trained.mean_gradient), local_state
        )
        for name, value in reports.items():
            b.reports[name][rows].copy_(value)

    def train_phases(
        self, indices: torch.Tensor, start: torch.Tensor, seed: int, limit: int | None, **options: Any
    ) -> Trained:
        """One client's training on the process trainer, however many phases (``fit`` calls) the
        algorithm runs: each phase takes at most its own cap (``Algorithm.phase_steps``: under
        local.steps a first phase must not spend the steps of the phase whose weights are sent), a
        partial straggler's ``limit`` is one budget for all of them, spent in the order they run (a
        phase gets what the phases before it left), and the steps reported are those of every
        phase, as the simulated clock charges them (fl/system.py)."""
        taken: list[torch.Tensor] = []
        caps = self.algorithm.phase_steps(self.config.local.steps)

        def fit(start, **phase):
            left = None if limit is None else limit - sum(int(steps.item()) for steps in taken)
            cap = caps[len(taken)] if len(taken) < len(caps) else None
            most = min((m for m in (left, cap) if m is not None), default=None)
            trained = self.trainer.train(indices, start, seed, max_steps=most, **options, **phase)
            taken.append(trained.steps)
            return trained

        fit.loss = lambda weights: self.trainer.loss(indices, weights, options.get("relabel"))

        trained = self.algorithm.train_client(fit, start, options["local_state"])
        if len(taken) > 1:
            trained = dataclasses.replace(trained, steps=torch.stack(taken).sum(0))
        return trained

    def peak_memory(self) -> int:
        """Bytes: the allocator's peak on a GPU (the CUDA context comes on top), peak RSS on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
