"""A group of a round's clients trained in lockstep, one batched forward and backward per step:
``torch.func.vmap`` over the stacked client weights, or, for a model whose trained parameters are
LoRA adapters, batched adapters: the group's rows through the frozen base once, each through its
own client's adapters. Each client keeps what local.py's trainer gives it: its own samples,
shuffling, step limit, optimizer state and loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..models import lora, tasks
from .local import ClientOptimizer, Trained, Trainer, autocast_for, batch_on


class GroupTrainer(Trainer):
    """Trains a group of clients in lockstep: one batched forward and backward per step for
    the whole group, with ``torch.func.vmap`` over the stacked ``[c, P]`` client weights.

    Each step does for every client what ``LocalTrainer`` does for one. Clients whose epoch is
    shorter (fewer samples) are masked out of the steps they do not have, and a short last
    batch is padded with zero-weight samples, so every client still takes exactly its own
    ceil(n / B) steps per epoch over its own shuffled samples. A client with a step limit (a
    partial straggler) has the samples of the batches past its limit masked out the same way.
    Only models without buffers (no batch-norm statistics) can be trained this way.
    """

    def prepare(self, module: torch.nn.Module) -> None:
        from torch.func import functional_call, grad_and_value, vmap

        local = self.local
        self.device = next(module.parameters()).device  # compute; the data may stay in host memory
        self.data_device = self.train_x.device
        module.train()
        # the trained parameters are batched, one copy per client; a frozen base (LoRA) is not:
        # every client's rows pass through the one base, each through its own adapters
        self.shapes = {name: p.shape for name, p in module.named_parameters() if p.requires_grad}

        autocast = autocast_for(local, self.device)
        if lora.groupable(module):
            self.step = self._grouped_step(module, autocast)
            return

        def batch_loss(params, x, y, weight):
            with autocast:
                scores = functional_call(module, params, (x,))
                per_target = tasks.loss(scores, y, reduction="none").view(y.shape)
            counted = tasks.counted(y, weight)
            # the mean over the real samples' scored targets, as the process trainer's loss is
            return (per_target * counted).sum() / counted.sum().clamp_min(1.0)

        # randomness="different": each client of the group draws its own dropout masks
        vectorised = vmap(grad_and_value(batch_loss), randomness="different")
        self.step = lambda params, x, y, weight, rows: vectorised(params, x, y, weight)  # padded: fixed shapes

    @staticmethod
    def _grouped_step(module: torch.nn.Module, autocast: torch.autocast) -> Callable:
        """The step of a model whose trained parameters are LoRA adapters: the group's sequences
        stacked into one batch pass through the frozen base once, each row through its own
        client's adapters (``lora.grouped_adapters``); the sum of the clients' losses is
        differentiated, so each client's gradient is that of its own loss. Only each client's
        real rows (``rows[i]``, the first of its padded batch) are stacked: a client with a short
        batch, or none this step, costs the base nothing for the rows it lacks."""

        def step(params, x, y, weight, rows):
            c = len(rows)
            x, y, weight = (torch.cat([t[i, :k] for i, k in enumerate(rows)]) for t in (x, y, weight))
            leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
            uneven = rows if len(set(rows)) > 1 else None
            with lora.grouped_adapters(module, leaves, uneven), autocast:
                scores = module(x)
                per_target = tasks.loss(scores, y, reduction="none").view(y.shape)
            counted = tasks.counted(y, weight)
            owner = torch.repeat_interleave(torch.arange(c, device=x.device), torch.tensor(rows, device=x.device))
            sums = per_target.new_zeros(c).index_add_(0, owner, (per_target * counted).flatten(1).sum(dim=1))
            counts = counted.new_zeros(c).index_add_(0, owner, counted.flatten(1).sum(dim=1))
            losses = sums / counts.clamp_min(1.0)
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
            return dict(zip(leaves, grads)), losses.detach()

        return step

    def _views(self, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
        views, offset = {}, 0
        for name, shape in self.shapes.items():
            n = shape.numel()
            views[name] = stacked[:, offset : offset + n].view(len(stacked), *shape)
            offset += n
        return views

    def _epoch_plan(self, clients_indices, generators, used: list[int]):
        """Sample indices [steps, c, B] and weights (1 real, 0 padding) for one epoch in which
        client i trains on the first ``used[i]`` samples of its shuffled order."""
        b = self.local.batch_size
        steps = max(-(-n // b) for n in used)
        index = torch.zeros(len(clients_indices), steps * b, dtype=torch.int64, device=self.data_device)
        weight = torch.zeros(len(clients_indices), steps * b, device=self.device)
        for i, (ix, g, n) in enumerate(zip(clients_indices, generators, used)):
            index[i, :n] = ix[torch.randperm(len(ix), device=self.data_device, generator=g)][:n]
            weight[i, :n] = 1.0
        shape = (len(clients_indices), steps, b)
        return index.view(shape).transpose(0, 1), weight.view(shape).transpose(0, 1)

    def train(
        self,
        clients_indices: list[torch.Tensor],
        start: torch.Tensor,
        client_seeds: list[int],
        group_seed: int,
        *,
        local_state: Any = None,
        relabel: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        attacked: torch.Tensor | None = None,
        max_steps: list[int | None] | None = None,
    ) -> tuple[torch.Tensor, Trained]:
        """Train the group from ``start``; return its ``[c, P]`` weights and what it did.
        ``relabel`` replaces the labels of the clients marked in ``attacked`` ([c] bool);
        ``max_steps[i]``: client i stops after that many steps (None: all its epochs)."""
        local, algorithm, c = self.local, self.algorithm, len(clients_indices)
        b, sizes = local.batch_size, [len(ix) for ix in clients_indices]
        # every client's steps and samples, known before training: no host sync per step
        full = [local.epochs * -(-n // b) for n in sizes]
        left = [f if m is None else min(m, f) for f, m in zip(full, max_steps or [None] * c)]
        steps = list(left)
        seen = torch.zeros(c, device=self.device)  # scored targets trained on
        torch.manual_seed(group_seed)  # dropout and augmentation of this group, this round
        generators = [torch.Generator(self.data_device).manual_seed(s) for s in client_seeds]
        weights = start.expand(c, -1).clone()
        params = self._views(weights)
        start_params = start[: weights.shape[1]]
        optimizer = ClientOptimizer(local, weights, c)  # each client's own state and steps
        loss_sum = torch.zeros(c, device=self.device)
        gradient_sum = torch.zeros_like(weights) if algorithm.keeps_mean_gradient else None
        for _ in range(local.epochs):
            used = [min(n, s * b) for n, s in zip(sizes, left)]  # what each client trains on this epoch
            if not any(used):
                break  # every client of the group has reached its step limit
            left = [s - -(-u // b) for s, u in zip(left, used)]
            index, sample_weight = self._epoch_plan(clients_indices, generators, used)
            for t, (batch, w) in enumerate(zip(index, sample_weight)):
                rows = [max(0, min(b, u - t * b)) for u in used]  # each client's real samples, its first
                x, y = batch_on(self.train_x, self.train_y, batch, self.device)  # [c, B, ...], [c, B]
                if self.augment is not None:
                    x = self.augment(x.flatten(0, 1)).view_as(x)
                if relabel is not None:
                    y = torch.where(attacked[:, None], relabel(y, self.num_classes), y)
                grads, losses = self.step(params, x, y, w, rows)
                grad = torch.cat([grads[name].reshape(c, -1) for name in self.shapes], dim=1)
                active = (w.sum(dim=1) > 0).to(weights.dtype)[:, None]  # clients that have this step
                self._descend(grad, weights, active, optimizer, gradient_sum, (start_params, local_state))
                targets = tasks.counted(y, w).flatten(1).sum(dim=1)
                loss_sum.add_(losses * targets)
                seen.add_(targets)
        steps = torch.tensor(steps, device=self.device)
        mean_gradient = None if gradient_sum is None else gradient_sum / steps[:, None].to(weights.dtype)
        return weights, Trained(loss_sum / seen, steps, mean_gradient)

    def _descend(self, grad, weights, active, optimizer, gradient_sum, term_arguments: tuple) -> None:
        """One step of every client that has it (``active``, [c, 1]): weight decay (SGD's), the
        algorithm's term, then the clients' optimizer; a client without this step keeps its
        weights and optimizer state. ``term_arguments``: the start and the clients' own state,
        for ``adjust_gradient``."""
        optimizer.decay_in_gradient(grad, weights)
        if gradient_sum is not None:
            gradient_sum.add_(grad * active)
        if self.algorithm.has_gradient_term:
            self.algorithm.adjust_gradient(grad, weights, *term_arguments)
        optimizer.step(weights, grad, self.lr, active=active)
