"""Local training, which every client algorithm hooks into (the ``local:`` section): E epochs of
SGD (or AdamW) on a client's slice of the device-resident data.

The step works on the flat parameter and gradient tensors (see ``flat.py``), so it is the same
few kernels for any model. It matches ``torch.optim.SGD`` (weight decay added to the gradient,
then heavy-ball momentum without dampening), or with ``local.optimizer: adamw``
``torch.optim.AdamW``; the run's algorithm adds its term to the gradient before momentum
(``Algorithm.adjust_gradient``) and may ask for the mean of the raw gradients
(``keeps_mean_gradient``). Two trainers: ``LocalTrainer`` here trains clients one after
another, group.py's ``GroupTrainer`` a group of clients in lockstep; both read what ``Trainer``
holds, and neither knows any particular algorithm.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import Checks
from ..core.flat import FlatModel
from ..core.sections import option
from ..models import tasks
from .base import Algorithm


def _constant_lr(key: str, local: Any, config: Any) -> str | None:
    return None if local.lr_schedule != "constant" else "local.lr_schedule is constant"


def _not_adamw(key: str, local: Any, config: Any) -> str | None:
    return None if local.optimizer == "adamw" else f"local.optimizer is {local.optimizer}: it is adamw's"


@dataclass
class LocalConfig:
    """The ``local:`` section: how every client trains in a round."""

    epochs: int = option(1, "local epochs per round")
    steps: int | None = option(
        None,
        "the most local steps a client takes in a round (FlowerTune's `max_steps`), in each phase of a "
        "two-phase algorithm (Ditto, FedRep: see [Personal models](personal-models.md)); the simulated clock "
        "charges these; `null`: all",
    )
    batch_size: int = option(64, "local batch size")
    lr: float = option(0.01, "local learning rate (with `lr_schedule: cosine`, the one it anneals from)")
    lr_schedule: str = option(
        "constant",
        "the learning rate over the rounds: `constant`, or `cosine`: round t of T trains with lr_min + (lr - "
        "lr_min) (1 + cos(pi (t - 1) / T)) / 2, whatever `optimizer`: round 1 at lr, every round above lr_min "
        "(FlowerTune's `cosine_annealing` is this curve one round on); `rounds` cannot change on resume",
    )
    lr_min: float = option(
        0.0, "`cosine`: the learning rate it anneals toward, reached after the last round", unread=_constant_lr
    )
    momentum: float = option(0.0, "local SGD momentum (reset for every client every round)")
    weight_decay: float = option(0.0, "local weight decay: L2 in the gradient for SGD, decoupled for AdamW")
    precision: str = option(
        "fp32", "`bf16`: autocast of forward pass and loss (weights, gradients and the optimizer step stay fp32)"
    )
    optimizer: str = option(
        "sgd",
        "`sgd` (with momentum), or `adamw` (torch.optim.AdamW's step, with moments fresh for every client's "
        "round, as a client that builds its optimizer when it gets the model)",
    )
    beta1: float = option(0.9, "`adamw`'s first moment decay (torch.optim.AdamW's default)", unread=_not_adamw)
    beta2: float = option(0.999, "`adamw`'s second moment decay", unread=_not_adamw)
    eps: float = option(1e-8, "`adamw`'s epsilon", unread=_not_adamw)

    def round_lr(self, rnd: int, rounds: int) -> float:
        """The learning rate of round ``rnd`` (1-based) of ``rounds``: ``lr``, or its cosine
        annealing (Loshchilov & Hutter 2017's SGDR, one half-cycle over the run), as
        ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=rounds)`` stepped once a round gives
        it: round 1 trains at ``lr`` and the last above ``lr_min``, so that no round trains at 0
        with ``lr_min: 0`` and a 1-round run trains at ``lr``. FlowerTune's ``cosine_annealing(
        current_round, total_round, ...)``, called with Flower's rounds from 1, is the same curve a
        round on: its round t trains at the rate of round t + 1 here, and its last at lr_min."""
        if self.lr_schedule == "constant":
            return self.lr
        return self.lr_min + 0.5 * (self.lr - self.lr_min) * (1 + math.cos(math.pi * (min(rnd, rounds) - 1) / rounds))

    def check(self) -> None:
        checks = Checks("local")
        checks.at_least("epochs", self.epochs, 1)
        if self.steps is not None:
            checks.at_least("steps", self.steps, 1)
        checks.at_least("batch_size", self.batch_size, 1)
        if self.lr <= 0:
            checks.fail("lr", f"must be > 0, got {self.lr}")
        checks.one_of("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        checks.within("lr_min", self.lr_min, 0, self.lr, why=" (0 up to local.lr)")
        checks.within("momentum", self.momentum, 0, 1, "[)")
        checks.at_least("weight_decay", self.weight_decay, 0)
        checks.one_of("precision", self.precision, ("fp32", "bf16"))
        checks.one_of("optimizer", self.optimizer, ("sgd", "adamw"))
        if self.optimizer == "adamw":
            checks.within("beta1", self.beta1, 0, 1, "[)")
            checks.within("beta2", self.beta2, 0, 1, "[)")
            checks.positive("eps", self.eps)
            if self.momentum:
                checks.fail("momentum", "is SGD's; adamw's first moment decays by local.beta1: leave momentum at 0")


@dataclass
class Trained:
    """What one call of ``train`` did, for c clients (1 for ``LocalTrainer``)."""

    loss: torch.Tensor  # [c] mean training loss over the samples trained on (on the device: no host sync per step)
    steps: torch.Tensor  # [c] SGD steps taken
    mean_gradient: torch.Tensor | None  # [c, n] mean raw gradient, when the algorithm keeps it
    weights: torch.Tensor | None = None  # [P] LocalTrainer: its model's weights after training (its own tensor)


class ClientOptimizer:
    """A client's optimizer, afresh for every client's round (as a client that builds its optimizer
    when it is handed the model): SGD, whose step matches ``torch.optim.SGD`` (weight decay added to
    the gradient, heavy-ball momentum without dampening), or with ``local.optimizer: adamw``
    ``torch.optim.AdamW``'s single-tensor step (Loshchilov & Hutter 2019, "Decoupled Weight Decay
    Regularization": the decay shrinks the weights apart from the gradient, the moments are
    bias-corrected by the step count). For one client (``weights`` [n]) or a group of ``clients``
    in lockstep ([c, n]), each of which has its own state and step count."""

    def __init__(self, local: LocalConfig, like: torch.Tensor, clients: int | None = None):
        self.local = local
        self.momentum = torch.zeros_like(like) if local.momentum else None
        adamw = local.optimizer == "adamw"
        self.moments = (torch.zeros_like(like), torch.zeros_like(like)) if adamw else None
        # steps taken: a number for one client, [c, 1] for a group (a client without a step keeps its count)
        self.clients = clients
        self.count: int | torch.Tensor = 0 if clients is None else torch.zeros(clients, 1, device=like.device)

    def reset(self) -> None:
        """A new client's round (or group's): no momentum, no moments, no steps."""
        for state in (self.momentum, *(self.moments or ())):
            if state is not None:
                state.zero_()
        self.count = 0 if self.clients is None else self.count.zero_()

    def decay_in_gradient(self, grad: torch.Tensor, weights: torch.Tensor) -> None:
        """SGD's weight decay, added to the gradient before the algorithm's term sees it (AdamW's
        is decoupled: ``step`` applies it)."""
        if self.local.weight_decay and self.moments is None:
            grad.add_(weights, alpha=self.local.weight_decay)

    def step(
        self,
        weights: torch.Tensor,
        grad: torch.Tensor,
        lr: float,
        active: torch.Tensor | None = None,
        trainable: torch.Tensor | None = None,
    ) -> None:
        """One step, in place, of the clients that have it (``active``, [c, 1], 1 or 0; None: all):
        a client without it keeps its weights and its state. ``trainable`` ([n], 1 or 0): the
        coordinates that train (their gradient is already 0 elsewhere; AdamW's decay spares them)."""
        local = self.local
        if self.moments is None:
            update = grad
            if self.momentum is not None:
                if active is None:  # in place: the same operations, without two temporaries per step
                    self.momentum.mul_(local.momentum).add_(grad)
                else:
                    _keep(self.momentum, self.momentum * local.momentum + grad, active)
                update = self.momentum
            weights.sub_(update if active is None else update * active, alpha=lr)
            return
        first, second = self.moments
        self.count = self.count + 1 if active is None else self.count.add_(active)
        if local.weight_decay:
            mask = trainable if active is None else active
            weights.sub_(weights if mask is None else weights * mask, alpha=lr * local.weight_decay)
        _keep(first, first.lerp(grad, 1 - local.beta1), active)
        _keep(second, second.mul(local.beta2).addcmul_(grad, grad, value=1 - local.beta2), active)
        if active is None:  # torch.optim.AdamW's own operations, so that a client's steps are its bit for bit
            denominator = (second.sqrt() / math.sqrt(1 - local.beta2**self.count)).add_(local.eps)
            weights.addcdiv_(first, denominator, value=-lr / (1 - local.beta1**self.count))
            return
        steps = self.count.double().clamp_min(1.0)  # each client's own bias corrections
        denominator = (second.sqrt() / (1 - local.beta2**steps).sqrt().to(weights.dtype)).add_(local.eps)
        weights.sub_(first / denominator * (lr / (1 - local.beta1**steps)).to(weights.dtype) * active)


def _keep(state: torch.Tensor, new: torch.Tensor, active: torch.Tensor | None) -> None:
    """``state`` becomes ``new`` for the clients that have the step (``active``; None: every one)."""
    state.copy_(new if active is None else torch.where(active > 0, new, state))


def autocast_for(local: LocalConfig, device: torch.device) -> torch.autocast:
    """bf16 autocast of forward and loss when local.precision is bf16 (weights, gradients and
    the SGD step stay fp32); a disabled context otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=local.precision == "bf16")


def batch_on(
    x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather a batch by index where the data lives, and bring it to the compute device
    (a copy only when the data is kept in host memory, see data.placement)."""
    return x[index].to(device, non_blocking=True), y[index].to(device, non_blocking=True)


class Trainer:
    """What every trainer reads: the training data (where it lives), the ``local:`` section, this
    round's learning rate, the algorithm's hooks and the augmentation. ``model`` is what the
    trainer steps: a FlatModel (LocalTrainer) or the module itself (group.py's GroupTrainer)."""

    def __init__(
        self,
        model: FlatModel | torch.nn.Module,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        local: LocalConfig,
        *,
        num_classes: int,
        algorithm: Algorithm | None = None,
        augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.train_x, self.train_y, self.local = train_x, train_y, local
        self.num_classes, self.augment = num_classes, augment
        self.algorithm = algorithm or Algorithm()
        self.lr = local.lr  # this round's (the runner sets it where local.lr_schedule anneals it)
        self.prepare(model)

    def prepare(self, model: FlatModel | torch.nn.Module) -> None:
        """What a trainer builds once from its model."""
        raise NotImplementedError


class LocalTrainer(Trainer):
    """Trains clients one after another on one flat model; one per worker process."""

    def prepare(self, model: FlatModel) -> None:
        local = self.local
        self.model = model
        self.optimizer = ClientOptimizer(local, model.params)
        self.loss_sum = torch.zeros((), device=model.flat.device)
        self.autocast = autocast_for(local, model.flat.device)

    def train(
        self,
        indices: torch.Tensor,
        start: torch.Tensor | None,
        seed: int,
        *,
        local_state: Any = None,
        relabel: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        max_steps: int | None = None,
        epochs: int | None = None,
        trainable: torch.Tensor | None = None,
        term: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
        objective: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> Trained:
        """Train from ``start`` on the samples ``indices``; the result is left in ``model.flat``.
        ``max_steps``: stop after that many SGD steps (a partial straggler's work, see system.py);
        None: all ``local.epochs`` epochs.
        ``start`` None trains the weights the model holds as they are (Hogwild: the shared weights,
        which other workers change meanwhile; a copy onto them would undo their steps).
        ``local_state`` is what the algorithm's ``start_client`` returned for this client;
        ``relabel(labels, num_classes)`` replaces the labels it trains on (a label attack).
        ``epochs``, ``trainable``, ``term`` and ``objective``: see ``Algorithm.train_client``."""
        model, local, algorithm = self.model, self.local, self.algorithm
        torch.manual_seed(seed)  # shuffling, dropout and augmentation of this client, this round
        if start is not None:
            model.flat.copy_(start)
        model.module.train()
        params, grad = model.params, model.grad
        start_params = None if start is None else start[: model.num_params]
        self.optimizer.reset()
        self.loss_sum.zero_()
        if term is None and algorithm.has_gradient_term:
            term = lambda g, w: algorithm.adjust_gradient(g, w, start_params, local_state)  # noqa: E731
        gradient_sum = torch.zeros_like(params) if algorithm.keeps_mean_gradient else None
        steps = seen = 0

        def batches():  # an epoch is shuffled when it starts: a client stopped early draws no more
            for _ in range(local.epochs if epochs is None else epochs):
                yield from indices[torch.randperm(len(indices), device=indices.device)].split(local.batch_size)

        for batch in itertools.islice(batches(), max_steps):
            x, y = batch_on(self.train_x, self.train_y, batch, model.flat.device)
            if self.augment is not None:
                x = self.augment(x)
            if relabel is not None:
                y = relabel(y, self.num_classes)
            with self.autocast:
                loss = tasks.loss(model.module(x), y) if objective is None else objective(model.module, x, y)
            grad.zero_()
            loss.backward()
            self._descend(params, grad, gradient_sum, term, trainable)
            seen = seen + self._count_loss(loss, y)
            steps += 1
        mean_gradient = None if gradient_sum is None else (gradient_sum / steps)[None]
        return Trained(
            (self.loss_sum / seen)[None], torch.tensor([steps], device=model.flat.device), mean_gradient, model.flat
        )

    @torch.no_grad()
    def loss(
        self,
        indices: torch.Tensor,
        weights: torch.Tensor,
        relabel: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> float:
        """The mean loss of the model at ``weights`` ([P], loaded into the trainer's model) on the
        samples ``indices``, over the scored targets, in eval mode and without augmentation, in
        batches of local.batch_size in the order the client holds them: no randomness is drawn."""
        model = self.model
        model.flat.copy_(weights)
        model.module.eval()
        total = torch.zeros((), dtype=torch.float64, device=model.flat.device)
        targets = 0
        for batch in indices.split(self.local.batch_size):
            x, y = batch_on(self.train_x, self.train_y, batch, model.flat.device)
            if relabel is not None:
                y = relabel(y, self.num_classes)
            with self.autocast:
                total += tasks.loss(model.module(x), y, reduction="sum").double()
            targets += int(tasks.scored(y).sum())
        return float(total) / targets

    def _count_loss(self, loss: torch.Tensor, y: torch.Tensor) -> int | torch.Tensor:
        """Add a batch's loss to the client's sum, weighed by its scored targets; return their number
        (a tensor for a token-level task, counted on the device: no host sync per step)."""
        if y.ndim == 1:
            self.loss_sum.add_(loss.detach(), alpha=len(y))
            return len(y)
        targets = tasks.scored(y).sum()  # a sequence's loss is the mean over its scored tokens
        self.loss_sum.add_(loss.detach() * targets)
        return targets

    def _descend(
        self,
        params: torch.Tensor,
        grad: torch.Tensor,
        gradient_sum: torch.Tensor | None,
        term,
        trainable: torch.Tensor | None,
    ) -> None:
        """One step of ``params`` from the gradient ``grad`` (the model's): weight decay (SGD's), the
        algorithm's term, frozen coordinates, then the client's optimizer."""
        self.optimizer.decay_in_gradient(grad, params)
        if gradient_sum is not None:
            gradient_sum.add_(grad)
        if term is not None:
            term(grad[None], params[None])
        if trainable is not None:  # frozen coordinates keep their values exactly
            grad.mul_(trainable)
        self.optimizer.step(params, grad, self.lr, trainable=trainable)
