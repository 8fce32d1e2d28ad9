"""Shared fixtures: real MNIST when FEDSIM_DATA points at it, generated data otherwise."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Before torch (and its OpenMP) is loaded, here and in every process a test starts: the test
# processes share the cores with the runs they start, and an OpenMP thread that spins while it
# waits for work takes a core another process needs (the suite took 12.5 minutes so, 8 without)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every command a test starts imports fedsim from its sources. Where the environment forbids
# bytecode files, each would compile all of fedsim again, a fifth of a second of a core a process
# over hundreds of processes: the ones tests start keep them (in __pycache__, which git ignores)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from support import _started, tagged_processes  # noqa: E402


def _real_mnist_root() -> str | None:
    root = os.environ.get("FEDSIM_DATA")
    if root and (Path(root) / "MNIST" / "raw").is_dir():
        return root
    return None


@pytest.fixture(scope="session")
def mnist_root():
    """The data root holding real MNIST; tests that need it skip without it."""
    root = _real_mnist_root()
    if root is None:
        pytest.skip("real MNIST not found (set FEDSIM_DATA to a folder with MNIST/raw)")
    return root


@pytest.fixture
def small_config():
    """A quick multi-process experiment: real MNIST (a few thousand samples) when it is
    available, the generated dataset otherwise."""
    root = _real_mnist_root()
    data = {"dataset": "mnist", "root": root, "limit": 4000} if root else {"dataset": "synthetic"}
    return {
        "name": "small",
        "seed": 3,
        "device": "cpu",
        "rounds": 3,
        "workers": 2,
        "clients_per_round": 4,
        "model": "mnist_cnn",
        "data": {**data, "partition": "iid", "num_clients": 8},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
    }


@pytest.fixture
def learning_config(small_config):
    """small_config for tests that watch accuracy rise from round to round: the generated data is
    cut to 1,600 samples, of which mnist_cnn learns all 10 classes in its first round otherwise
    (measured: 0.39, 0.87, 0.94 over 3 rounds, as real MNIST's 4,000 give about 0.3 to 0.9)."""
    if small_config["data"]["dataset"] != "synthetic":
        return small_config
    return {**small_config, "data": {**small_config["data"], "limit": 1600}}


if os.environ.get("PYTEST_XDIST_WORKER"):
    # two test processes per two cores: torch's default of a thread per core in each would make
    # them wait on each other (runs started as commands keep the default)
    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (setup.cfg): one test process per core, at most 4. Many tests start a run of
    their own with a server and two workers, so more would only queue for the cores and the memory."""
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 4))


def pytest_report_header(config):
    """Said as the suite starts: what the first seconds, with no result shown, go to."""
    workers = getattr(config.option, "numprocesses", None)
    who = "each test process" if workers else "the test process"
    return f"fedsim: {who} first imports torch and collects every test file; results follow in seconds"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------- the real command


@pytest.fixture(autouse=True)
def kill_leftovers():
    """A failing test must not leave its run (or that run's workers) behind."""
    yield
    while _started:
        proc, tag = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def own_signal_handlers():
    """A command run in-process (``main([...])``) installs its own Ctrl-C and SIGTERM handlers (and
    unraisable hook): a later test that sends itself a signal must meet the interpreter's, not a
    finished command's."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    sys.unraisablehook = hook
