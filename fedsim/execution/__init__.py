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
from .pool import InlinePool, WorkerPool, kill_all_pools, slot_groups

logger = logging.getLogger("fedsim")


def new_pool(config, workers: int, device: torch.device, runner: type):
    """``workers`` processes that train with ``runner``, or the server itself when 0.
    ``config`` is the run's config as the workers get it (components.for_workers)."""
    return InlinePool(config, device, runner) if workers == 0 else WorkerPool(config, workers, device, runner)


class Restarting:
    """``on_worker_failure: restart``: a round whose workers fail is re-run on a fresh pool, up to
    three attempts. The workers change no state (see Algorithm), so a re-run changes nothing
    twice; every attempt starts from the global weights (hogwild's workers train them in place)."""

    attempts = 3

    def __init__(self, make_pool):
        self.make_pool, self.pool = make_pool, make_pool()

    @property
    def busy_seconds(self) -> list[float]:
        return self.pool.busy_seconds

    @property
    def peak_memory(self) -> list[int]:
        return self.pool.peak_memory

    def start(self, buffers) -> None:
        self.buffers = buffers
        self.pool.start(buffers)

    def train(self, rnd: int, clients: torch.Tensor, start_from: torch.Tensor, groups=None) -> None:
        for attempt in range(self.attempts):
            try:
                return self.pool.train(rnd, clients, start_from, groups)
            except WorkerError as e:
                if attempt == self.attempts - 1:
                    raise
                logger.warning(f"round {rnd}: {e}; restarting the workers and re-running the round")
                self.pool.close()
                self.pool = self.make_pool()
                self.pool.start(self.buffers)

    def agree(self, compute):
        return compute()

    def close(self) -> None:
        self.pool.close()


__all__ = ["InlinePool", "Restarting", "WorkerPool", "kill_all_pools", "new_pool", "slot_groups"]
