"""Shared fixtures: real MNIST when FEDSIM_DATA points at it, generated data otherwise."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch


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


def child_pids() -> list[int]:
    """Live (non-zombie) processes whose parent is this test process, leaving out
    multiprocessing's resource tracker (one per parent, it exits with the parent and is
    what unlinks semaphores if the parent is killed)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == me and fields[0] != "Z":
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if "resource_tracker" not in cmdline:
                found.append(int(entry.name))
    return found


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------- the real command


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries FEDSIM_TEST_TAG=tag."""
    needle = f"FEDSIM_TEST_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes() and "Z" not in (entry / "stat").read_text().split()[2]:
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


_started: list[tuple[subprocess.Popen, str]] = []


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


TESTS_DIR = str(Path(__file__).resolve().parent)


def _pythonpath() -> str:
    """PYTHONPATH with the tests directory first: a run (and its workers) can then import the
    helpers kept here by import path, e.g. ``algorithm: faulty:Faulty``."""
    existing = os.environ.get("PYTHONPATH")
    return os.pathsep.join([TESTS_DIR, existing]) if existing else TESTS_DIR


def start(args, tag, popen_options=None, launcher=(), **env):
    """``python [LAUNCHER] -m fedsim ARGS`` with FEDSIM_TEST_TAG=tag in its environment (and its
    workers'), and the tests directory on PYTHONPATH. ``launcher``: e.g. ``("-m",
    "torch.distributed.run", "--nproc-per-node=2")`` for torchrun."""
    proc = subprocess.Popen(
        [sys.executable, *launcher, "-m", "fedsim", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "FEDSIM_TEST_TAG": tag, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(), **env},
        **(popen_options or {}),
    )
    _started.append((proc, tag))
    return proc


def run_cli(args, timeout=60, popen_options=None, **env):
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = start(args, tag, popen_options, **env)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, time.monotonic() - t0, tag


def wait_for_round(proc, rnd: int, timeout: float = 60) -> list[str]:
    """Read stdout until the line of round ``rnd`` appears; return the lines read."""
    pattern = re.compile(rf"^round\s+{rnd}/")
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if pattern.match(line):
            return lines
    raise AssertionError(f"never saw round {rnd}; got {lines}")


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("fedsim: warning")]
    assert len(lines) == 1, err
    assert lines[0].startswith("fedsim: error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
