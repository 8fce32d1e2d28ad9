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

Experiment file (every key optional; shown with its default)::

    mode: async
    asynchronous:
      method: fedbuff           # fedbuff | fedasync
      buffer_size: 10           # fedbuff: K, the updates one server update applies
      mixing: 0.6               # fedasync: a, the weight of a fresh update (0, 1]
      staleness: polynomial     # constant | polynomial | hinge: s(tau)
      staleness_a: 0.5          # polynomial's exponent, hinge's slope
      staleness_b: 4            # hinge: the staleness up to which an update counts in full
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.checks import Checks
from ..core.registry import Registry

ASYNC_METHODS = Registry("async method")
STALENESS = ("constant", "polynomial", "hinge")
_CHECKS = Checks("asynchronous")


@dataclass
class AsyncConfig:
    """The ``asynchronous:`` section, read in ``mode: async``."""

    method: str = "fedbuff"  # fedbuff | fedasync
    buffer_size: int = 10  # fedbuff: K updates per server update
    mixing: float = 0.6  # fedasync: the mixing weight of an update of staleness 0
    staleness: str = "polynomial"  # constant | polynomial | hinge
    staleness_a: float = 0.5  # polynomial: s = (1 + tau)^-a; hinge: the slope a
    staleness_b: int = 4  # hinge: s = 1 up to this staleness


def check(section: AsyncConfig) -> None:
    """One-line ConfigErrors naming the key."""
    _CHECKS.choice("method", section.method, ASYNC_METHODS)
    _CHECKS.at_least("buffer_size", section.buffer_size, 1)
    _CHECKS.within("mixing", section.mixing, 0, 1, "(]")
    _CHECKS.one_of("staleness", section.staleness, STALENESS)
    _CHECKS.within("staleness_a", section.staleness_a, 0, 100)
    _CHECKS.at_least("staleness_b", section.staleness_b, 0)


def unused_options(section: AsyncConfig) -> list[str]:
    """Keys set to other than their default that the chosen method or staleness does not read."""
    default = AsyncConfig()
    unread = {"fedbuff": ["mixing"], "fedasync": ["buffer_size"]}[section.method] + {
        "constant": ["staleness_a", "staleness_b"],
        "polynomial": ["staleness_b"],
        "hinge": [],
    }[section.staleness]
    return [
        f"asynchronous.{key} is {getattr(section, key)!r} but it is not read by asynchronous.method "
        f"{section.method} with staleness {section.staleness}"
        for key in unread
        if getattr(section, key) != getattr(default, key)
    ]


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
