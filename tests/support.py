"""Helpers shared by several test modules: plain functions and constants, imported as
``from support import ...`` (fixtures stay in conftest.py). No test module imports another."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import os
import pickle
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import yaml

from fedsim.core.streams import SAMPLING, words
from fedsim.data.datasets import CIFAR10_FOLDER
from fedsim.experiment.config import Config
from fedsim.results.rundir import COLUMNS


class Later:
    """A module imported where a test first uses it, not while the suite is collected: every test
    process collects every file before its first result, and peft, transformers, datasets and
    torchvision take seconds to import."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith(("_", "pytest")):  # what collection asks of every name in a test file
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def installed(*names: str) -> bool:
    """Whether the modules can be imported, found without importing them."""
    return all(importlib.util.find_spec(name) is not None for name in names)


# ----------------------------------------------------------------------------- callbacks


class Recorder:
    """A callback keeping every round's row (evaluated or not) and client records."""

    def __init__(self):
        self.rows, self.clients = [], []

    def on_round_end(self, row, clients):
        self.rows.append(dict(row))
        self.clients.extend(dict(c) for c in clients)


# ----------------------------------------------------------------------------- processes


def _processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every live (non-zombie) process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), cmdline)
    return found


def child_pids() -> list[int]:
    """Live processes that this test process started, directly or through multiprocessing's
    helpers: the resource tracker (one per parent, it exits with the parent and is what unlinks
    semaphores if the parent is killed) and the fork server (the parent of every worker, see
    fedsim/execution/processes.py) are left out, and so is nothing they started."""
    processes = _processes()
    found, parents = [], [os.getpid()]
    while parents:
        children = [pid for pid, (parent, _) in processes.items() if parent in parents]
        helpers = [
            pid
            for pid in children
            if parents == [os.getpid()]
            and (b"resource_tracker" in processes[pid][1] or b"forkserver" in processes[pid][1])
        ]
        found += [pid for pid in children if pid not in helpers]
        parents = children
    return found


def worker_pids(pids) -> list[int]:
    """The fedsim workers among ``pids``, by the name they give themselves (fedsim-worker0, ...)."""
    found = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("fedsim-worker"):
                found.append(pid)
        except OSError:
            pass
    return found


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def shm_left_behind(before: set[str], wait: float = 5.0) -> set[str]:
    """The /dev/shm entries made since ``before`` that only this process, or no process, has
    mapped: what a finished run left behind. Under pytest-xdist another test process's live run
    has entries of its own, mapped by its processes (a named semaphore is mapped as long as its
    name exists); a killed process's are unlinked by its resource tracker a moment later."""
    deadline = time.monotonic() + wait
    while True:
        mapped = _shm_inodes_mapped_by_others()
        left = {name for name in shm_entries() - before if _inode(f"/dev/shm/{name}") not in mapped}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:  # gone meanwhile
        return None


def _shm_inodes_mapped_by_others() -> set[int]:
    """By inode, not name: a named semaphore is mapped under the temporary name it was made as."""
    inodes = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if maps.parent.name == str(os.getpid()):
            continue
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        inodes.update(int(inode) for inode in re.findall(r"^\S+ \S+ \S+ \S+ (\d+) +/dev/shm/", text, re.M))
    return inodes


# ----------------------------------------------------------------------------- the real command


def fork_server_of(pid: int) -> list[int]:
    """The fork server that ``pid`` started (it imports torch for the workers; see processes.py)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                if (
                    int(stat[stat.rindex(")") + 2 :].split()[1]) == pid
                    and b"multiprocessing.forkserver" in (entry / "cmdline").read_bytes()
                ):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


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


# the commands started by start(); conftest's kill_leftovers fixture ends them after each test
_started: list[tuple[subprocess.Popen, str]] = []

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
        [sys.executable, *launcher, "-m", "fedsim", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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


# ------------------------------------------------------------------- faulty runs (test_reliability, test_cuda)

BASE = {
    "name": "reliability",
    "seed": 5,
    "device": "cpu",
    "rounds": 3,
    "workers": 2,
    "clients_per_round": 4,
    "data": {"dataset": "synthetic", "num_clients": 8, "limit": 1600},  # learned in 3 rounds, as learning_config
    "local": {"lr": 0.05, "momentum": 0.9, "batch_size": 32},
}


def write_config(tmp_path, **changes) -> Path:
    cfg = {**BASE, **changes}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def sample_clients(seed: int, rnd: int, num_clients: int, k: int) -> torch.Tensor:
    """Round ``rnd``'s uniform sample with every client online, written out here: ``k`` clients
    drawn without replacement from the stream SAMPLING of (seed, rnd), sorted."""
    rng = np.random.default_rng(np.random.SeedSequence(words(SAMPLING, seed, rnd)))
    return torch.from_numpy(np.sort(rng.choice(num_clients, size=k, replace=False)))


def client_of(worker: int, rnd: int, cfg: dict = BASE) -> int:
    """The first client ``worker`` trains in round ``rnd``: slot s of a round goes to worker s mod W."""
    clients = sample_clients(cfg["seed"], rnd, cfg["data"]["num_clients"], cfg["clients_per_round"])
    return int(clients[worker :: cfg["workers"]][0])


def write_faulty_config(
    tmp_path, kind: str, rnd: int, worker: int, once: Path | None = None, **changes
) -> tuple[Path, int]:
    """A config whose algorithm (tests/faulty.py: FedAvg plus one fault) strikes when ``worker``
    trains its first client of round ``rnd``; returns the config's path and that client."""
    client = client_of(worker, rnd, {**BASE, **changes})
    options = {"kind": kind, "round": rnd, "client": client, **({"once": str(once)} if once else {})}
    return write_config(tmp_path, algorithm="faulty:Faulty", algorithm_options=options, **changes), client


# ----------------------------------------------------------------------------- fabricated files


def write_fake_cifar(root, per_batch=4, test_size=3):
    """A tiny copy of torchvision's cifar-10-batches-py: five training batches, a test batch
    and batches.meta, pickled as the real ones (rows of 1024 red, 1024 green, 1024 blue bytes)."""
    folder = root / CIFAR10_FOLDER
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    batches = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test_size)]:
        batches[name] = {
            "batch_label": name,
            "labels": rng.integers(0, 10, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(n)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batches[name], f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(
            {
                "label_names": [
                    "airplane",
                    "automobile",
                    "bird",
                    "cat",
                    "deer",
                    "dog",
                    "frog",
                    "horse",
                    "ship",
                    "truck",
                ],
                "num_cases_per_batch": per_batch,
                "num_vis": 3072,
            },
            f,
        )
    return batches


def write_run(path, name="run", seed=0, accuracies=(0.5, 0.7, 0.8), summary=True, settings=None, clusters=None):
    """A run directory as the server writes it: config.yaml, metrics.csv, summary.json.

    ``settings``: config keys to change from the defaults, dotted for sections (``"data.alpha"``).
    ``clusters``: a clustered algorithm's number of clusters in each round (None: empty, as other runs write it).
    """
    path.mkdir(parents=True)
    cfg = Config(name=name, seed=seed, device="cpu", workers=2).to_dict()
    for key, value in (settings or {}).items():
        *sections, field = key.split(".")
        section = cfg
        for part in sections:
            section = section[part]
        section[field] = value
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    with open(path / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, restval="0.5")  # 0.5 s for the timing columns not set here
        writer.writeheader()
        for rnd, acc in enumerate(accuracies, start=1):
            writer.writerow(
                {
                    "round": rnd,
                    "test_accuracy": acc,
                    "test_loss": 2.0 - acc,
                    "test_perplexity": "",  # empty, as a classification run writes it (not restval)
                    "train_loss": 1.9 - acc,
                    "seconds": 1.5,
                    "elapsed_seconds": 1.5 * rnd + seed,
                    "clients": 4,
                    "dropped_clients": 0,
                    "attackers": 0,
                    "unavailable": 0,
                    "stragglers": 0,
                    "bytes_down": 1000,
                    "bytes_up": 500,
                    "cumulative_bytes": 1500 * rnd,
                    "test_samples": 1000,
                    "clusters": "" if clusters is None else clusters[rnd - 1],
                }
            )
    if summary:
        (path / "summary.json").write_text(
            json.dumps(
                {"name": name, "final_test_accuracy": accuracies[-1], "wall_seconds": 1.5 * len(accuracies) + seed}
            )
        )
    return path


# ----------------------------------------------------------------------------- experiment files


def documented_commands(path: Path) -> list[list[str]]:
    """The `fedsim ...` commands written in an experiment file's leading comment."""
    text = "\n".join(line[1:] for line in path.read_text().splitlines() if line.startswith("#"))
    return [
        shlex.split(command.replace("\\\n", " "))
        for command in re.findall(r"^\s+(fedsim (?:.*\\\n)*.*)$", text, re.MULTILINE)
    ]
