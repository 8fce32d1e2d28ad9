"""How many threads torch computes with, where it matters to the numbers: a matrix product split
over another number of threads may round differently, so every step whose results are kept runs
with a number the run decides, not one the process happened to start with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch computes with ``count`` threads inside, with as many as before afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def scoring_threads() -> Iterator[None]:
    """The server's scoring of a model: with every core the process may use, whatever
    OMP_NUM_THREADS or a launcher (torchrun sets 1) says, so that the scores of a run do not depend
    on how it was started. Its workers are idle meanwhile."""
    with torch_threads(available_cores()):
        yield
