"""Choosing a run's pool of workers, and restarting one whose workers fail."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..core.errors import WorkerError
from ..engine.buffers import RoundBuffers
from ..engine.loop import Executor
from ..experiment.config import Config
from .pool import InlinePool, PoolKeeper, WorkerPool

logger = logging.getLogger("fedsim")


def new_pool(
    config: Config, workers: int, device: torch.device, runner: type, keeper: PoolKeeper | None = None
) -> InlinePool | WorkerPool:
    """``workers`` processes that train with ``runner`` (a kept pool's, when ``keeper`` has one
    that fits), or the server itself when 0. ``config`` is the run's config as the workers get
    it (components.for_workers)."""
    if workers == 0:
        return InlinePool(config, device, runner)
    return keeper.pool(config, workers, device, runner) if keeper else WorkerPool(config, workers, device, runner)


class Wrapper(Executor):
    """An executor around another, ``inner``, whose workers do the training."""

    @property
    def busy_seconds(self) -> list[float]:
        return self.inner.busy_seconds

    @property
    def peak_memory(self) -> list[int]:
        return self.inner.peak_memory

    @property
    def pss_memory(self) -> list[int]:
        return self.inner.pss_memory

    @property
    def server_pss(self) -> int:
        return self.inner.server_pss

    def read_pss(self) -> None:
        self.inner.read_pss()

    def start(self, buffers: RoundBuffers) -> None:
        self.buffers = buffers
        self.inner.start(buffers)

    def agree(self, compute: Callable[[], object]) -> object:
        return self.inner.agree(compute)


class Restarting(Wrapper):
    """``on_worker_failure: restart``: a round whose workers fail is re-run on a fresh pool, up to
    three attempts. The workers change no state (see Algorithm), so a re-run changes nothing
    twice; every attempt starts from the global weights (hogwild's workers train them in place)."""

    attempts = 3

    def __init__(self, make_pool: Callable[[], Executor]):
        self.make_pool, self.inner = make_pool, make_pool()

    def train(
        self, rnd: int, clients: torch.Tensor, start_from: torch.Tensor, groups: list[list[int]] | None = None
    ) -> None:
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

    def close(self, finished: bool = True, ended_by: BaseException | None = None) -> None:
        self.inner.close(finished, ended_by)
