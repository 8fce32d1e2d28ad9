"""Asynchronous federated learning on the simulated clock (``mode: async``): the server does not
wait for a round's slowest client. ``clients_per_round`` clients train at once (the concurrency);
each trains on the global model as it was when it started, for ``steps x system.step_seconds /
speed`` simulated seconds (see system.py), and its update reaches the server when that time is
up. The moment a client reports (or drops out), another starts in its place.

Two ways to use the updates:

* ``fedbuff`` (Nguyen et al. 2022, "Federated learning with buffered asynchronous aggregation"):
  the server buffers updates and applies one once ``buffer_size`` (K) have arrived,
  ``x <- x + server_optimizer(1/K sum_i s(tau_i) (y_i - x_start_i))``, where y_i is client i's
  trained weights, x_start_i the model it started from and tau_i its staleness. FedBuff's
  server learning rate is the server optimizer's (``fedavgm`` with ``server_momentum: 0`` and
  ``server_lr``; ``none`` is a rate of 1).
* ``fedasync`` (Xie, Koyejo, Gupta 2019, "Asynchronous federated optimization"): every update
  is applied on arrival, ``x <- (1 - a) x + a y_i`` with ``a = mixing x s(tau_i)``.

Staleness ``tau_i``: the server updates applied between client i's start and its update's
application. ``s`` is FedAsync's family, which FedBuff's ``1 / sqrt(1 + tau)`` belongs to:
``constant`` 1, ``polynomial`` (1 + tau)^-a, ``hinge`` 1 for tau <= b, else 1 / (a (tau - b) + 1).

A "round" of an async run is one server update: ``rounds`` counts them, ``eval_every`` and
``checkpoint_every`` are in server updates, and each row of metrics.csv is one of them (its
``simulated_seconds`` the simulated time since the previous one, ``simulated_time`` since the
start). clients.csv has a row per client whose update was applied, with its staleness, and per
client that dropped out meanwhile.

Its keys, their defaults and meanings are declared once, in ``AsyncConfig`` below (``fedsim list
keys`` prints them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import Checks
from ..core.registry import Registry
from ..core.sections import option

ASYNC_METHODS = Registry("async method")
STALENESS = ("constant", "polynomial", "hinge")
_CHECKS = Checks("asynchronous")


_UNREAD = {"fedbuff": ("mixing",), "fedasync": ("buffer_size",)}
_UNREAD_BY_STALENESS = {"constant": ("staleness_a", "staleness_b"), "polynomial": ("staleness_b",), "hinge": ()}


def _unread(key: str, section: Any, config: Any) -> str | None:
    mode = getattr(config, "mode", "async")
    if mode != "async":
        return f"mode is {mode}: set mode: async to use it"
    if key in _UNREAD.get(section.method, ()) + _UNREAD_BY_STALENESS.get(section.staleness, ()):
        return f"it is not read by asynchronous.method {section.method} with staleness {section.staleness}"
    return None


@dataclass
class AsyncConfig:
    """The ``asynchronous:`` section, read in ``mode: async``."""

    method: str = option(
        "fedbuff",
        "with `mode: async`: `fedbuff` (a server update every `buffer_size` updates) or `fedasync` (every "
        "update applied on arrival; see [Asynchronous rounds](asynchronous.md))",
        unread=_unread,
    )
    buffer_size: int = option(10, "`fedbuff`: K, the updates one server update applies", unread=_unread)
    mixing: float = option(0.6, "`fedasync`: a, the weight of a fresh update, in (0, 1]", unread=_unread)
    staleness: str = option(
        "polynomial", "how a stale update is weighted: `constant`, `polynomial` or `hinge`", unread=_unread
    )
    staleness_a: float = option(0.5, "`polynomial`'s exponent, `hinge`'s slope", unread=_unread)
    staleness_b: int = option(4, "`hinge`: the staleness up to which an update counts in full", unread=_unread)

    def check(self) -> None:
        """One-line ConfigErrors naming the key."""
        _CHECKS.choice("method", self.method, ASYNC_METHODS)
        _CHECKS.at_least("buffer_size", self.buffer_size, 1)
        _CHECKS.within("mixing", self.mixing, 0, 1, "(]")
        _CHECKS.one_of("staleness", self.staleness, STALENESS)
        _CHECKS.within("staleness_a", self.staleness_a, 0, 100)
        _CHECKS.at_least("staleness_b", self.staleness_b, 0)


def staleness_weight(section: AsyncConfig, staleness: int) -> float:
    """s(tau): how much an update that is ``staleness`` server updates old counts."""
    if section.staleness == "constant":
        return 1.0
    if section.staleness == "polynomial":
        return (1.0 + staleness) ** -section.staleness_a
    if staleness <= section.staleness_b:
        return 1.0
    return 1.0 / (section.staleness_a * (staleness - section.staleness_b) + 1.0)


@ASYNC_METHODS.register(
    "fedbuff", "apply the mean of K buffered updates, each weighted by its staleness (Nguyen et al. 2022)"
)
class FedBuff:
    """A server update from ``buffer_size`` client updates: (1/K) sum_i s(tau_i) (y_i - x_start_i),
    then the server optimizer."""

    def __init__(self, section: AsyncConfig):
        self.section, self.updates_per_step = section, section.buffer_size

    def contribution(
        self, trained: torch.Tensor, start: torch.Tensor, current: torch.Tensor, staleness: int
    ) -> torch.Tensor:
        return (trained - start).mul_(staleness_weight(self.section, staleness))

    def step(self, total: torch.Tensor, count: int) -> torch.Tensor:
        return total.div_(count)


@ASYNC_METHODS.register(
    "fedasync", "mix every update into the global model on arrival, weighted by its staleness (Xie et al. 2019)"
)
class FedAsync:
    """A server update from each client update: x <- (1 - a) x + a y_i, a = mixing s(tau_i), as the
    step a (y_i - x) (server_optimizer none adds it)."""

    updates_per_step = 1

    def __init__(self, section: AsyncConfig):
        self.section = section

    def contribution(
        self, trained: torch.Tensor, start: torch.Tensor, current: torch.Tensor, staleness: int
    ) -> torch.Tensor:
        return (trained - current).mul_(self.section.mixing * staleness_weight(self.section, staleness))

    def step(self, total: torch.Tensor, count: int) -> torch.Tensor:
        return total


def make_method(section: AsyncConfig) -> FedBuff | FedAsync:
    """The ``asynchronous.method`` of ``section``, set up."""
    return ASYNC_METHODS.get(section.method)(section)
