"""Executors: the ways a round's clients are trained (see engine/loop.py's Executor).

pool.py      a pool of worker processes (``workers: N``), or the server itself (``workers: 0``)
runner.py    what a worker does with its share of a round
hogwild.py   ``mode: hogwild``: the workers train the shared global weights in place
ranks.py     several ranks under torchrun: wraps one of the above on every rank
"""
from __future__ import annotations

import logging

import torch

from ..errors import WorkerError
from .pool import InlinePool, PoolKeeper, WorkerPool, Wrapper, kill_all_pools, slot_groups

logger = logging.getLogger("fedsim")


def new_pool(config, workers: int, device: torch.device, runner: type, keeper: PoolKeeper | None = None):
    """``workers`` processes that train with ``runner`` (a kept pool's, when ``keeper`` has one
    that fits), or the server itself when 0. ``config`` is the run's config as the workers get
    it (components.for_workers)."""
    if workers == 0:
        return InlinePool(config, device, runner)
    return keeper.pool(config, workers, device, runner) if keeper else WorkerPool(config, workers, device, runner)


class Restarting(Wrapper):
    """``on_worker_failure: restart``: a round whose workers fail is re-run on a fresh pool, up to
    three attempts. The workers change no state (see Algorithm), so a re-run changes nothing
    twice; every attempt starts from the global weights (hogwild's workers train them in place)."""

    attempts = 3

    def __init__(self, make_pool):
        self.make_pool, self.inner = make_pool, make_pool()

    def train(self, rnd: int, clients: torch.Tensor, start_from: torch.Tensor, groups=None) -> None:
        for attempt in range(self.attempts):
            try:
                return self.inner.train(rnd, clients, start_from, groups)
            except WorkerError as e:
                if attempt == self.attempts - 1:
                    raise
                logger.warning(f"round {rnd}: {e}; restarting the workers and re-running the round")
                self.inner.close()
                self.inner = self.make_pool()
                self.inner.start(self.buffers)

    def close(self) -> None:
        self.inner.close()


__all__ = ["InlinePool", "PoolKeeper", "Restarting", "WorkerPool", "kill_all_pools", "new_pool", "slot_groups"]
