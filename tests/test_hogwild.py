"""mode: hogwild: the workers train one shared model lock-free (see fedsim/execution/hogwild.py)."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import time
import uuid

import pytest
import torch
import torch.nn.functional as F
import yaml
from support import (
    assert_one_line_error,
    child_pids,
    shm_entries,
    shm_left_behind,
    start,
    tagged_processes,
    wait_for_round,
    worker_pids,
)

import fedsim
from fedsim.core.errors import ConfigError
from fedsim.core.streams import client_seed
from fedsim.experiment.federation import initial_model, load_federation


@pytest.fixture
def hogwild(small_config):
    """small_config (MNIST-limited or generated data) as Hogwild: every client every round, and a
    milder momentum (every worker's steps land in one model, so its FedAvg setting overshoots)."""
    return {
        **small_config,
        "name": "hogwild",
        "mode": "hogwild",
        "clients_per_round": 4,
        "data": {**small_config["data"], "num_clients": 4},
        "local": {**small_config["local"], "momentum": 0.5},
    }


@pytest.mark.slow
def test_hogwild_learns_writes_the_results_and_leaves_nothing_behind(hogwild, tmp_path):
    shm_before = shm_entries()
    history = fedsim.run(hogwild, out=tmp_path / "run", quiet=True)

    assert history.round == [1, 2, 3]
    assert history.test_accuracy[-1] > 0.5, history.test_accuracy  # chance is 0.1
    assert history.train_loss[-1] < history.train_loss[0]
    run_dir = tmp_path / "run"
    for name in ("config.yaml", "metrics.csv", "clients.csv", "summary.json", "accuracy.png", "checkpoint.pt"):
        assert (run_dir / name).is_file(), name
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["mode"] == "hogwild"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_test_accuracy"] == history.test_accuracy[-1]
    with open(run_dir / "clients.csv", newline="") as f:
        clients = list(csv.DictReader(f))
    assert [(int(c["round"]), int(c["client"])) for c in clients] == [(r, c) for r in (1, 2, 3) for c in range(4)]
    assert all(math.isnan(float(c["update_norm"])) and c["dropped"] == "0" for c in clients)
    batch = hogwild["local"]["batch_size"]
    assert all(int(c["steps"]) == -(-int(c["samples"]) // batch) for c in clients)  # one epoch each
    assert (
        sum(int(c["samples"]) for c in clients if c["round"] == "1") == fedsim.load_config(hogwild).data.limit
        or hogwild["data"]["dataset"] == "synthetic"
    )

    assert child_pids() == []
    assert shm_left_behind(shm_before) == set()


def sequential_sgd(cfg, rounds: int) -> torch.Tensor:
    """What Hogwild with one worker must compute, written as plain PyTorch: each round, client 0
    then client 1 train the one model in turn, each with a fresh torch.optim.SGD."""
    federation = load_federation(cfg)
    data, model = federation.data, initial_model(cfg, federation.data)
    model.train()
    for rnd in range(1, rounds + 1):
        for client, indices in enumerate(federation.parts):
            torch.manual_seed(client_seed(cfg.seed, rnd, client))  # the client's shuffling and dropout
            optimizer = torch.optim.SGD(model.parameters(), lr=cfg.local.lr, momentum=cfg.local.momentum)
            for batch in indices[torch.randperm(len(indices))].split(cfg.local.batch_size):
                optimizer.zero_grad()
                F.cross_entropy(model(data.train_x[batch]), data.train_y[batch]).backward()
                optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.slow
def test_one_worker_is_plain_sequential_sgd_on_one_model(tmp_path):
    cfg = {
        "name": "sequential",
        "seed": 4,
        "device": "cpu",
        "rounds": 2,
        "mode": "hogwild",
        "clients_per_round": 2,
        "model": "mnist_cnn",
        "data": {"dataset": "synthetic", "num_clients": 2, "limit": 600},
        "local": {"batch_size": 32, "lr": 0.05, "momentum": 0.5},
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker computes: the same float reductions
    try:
        expected = sequential_sgd(fedsim.load_config(cfg), rounds=2)
    finally:
        torch.set_num_threads(threads)
    for workers in (1, 0):  # a worker process, and the server itself
        fedsim.run(cfg, out=tmp_path / f"w{workers}", quiet=True, workers=workers)
        trained = torch.load(tmp_path / f"w{workers}" / "checkpoint.pt", weights_only=True)["global"]
        assert torch.allclose(trained, expected, rtol=0, atol=1e-6), (trained - expected).abs().max()
    fedsim.run(cfg, out=tmp_path / "fedavg", quiet=True, workers=1, mode="sync")
    averaged = torch.load(tmp_path / "fedavg" / "checkpoint.pt", weights_only=True)["global"]
    assert (averaged - expected).abs().max() > 1e-3  # FedAvg of the same clients is another model
    assert child_pids() == []


@pytest.mark.slow
def test_a_hogwild_run_resumes_and_mode_cannot_change(hogwild, tmp_path):
    one = dict(hogwild, workers=0, rounds=2)  # no worker process: deterministic, so resuming must give the same numbers
    full = fedsim.run(one, out=tmp_path / "full", quiet=True)
    fedsim.run(one, out=tmp_path / "part", quiet=True, rounds=1)
    with pytest.raises(ConfigError, match="keyword mode: cannot change when resuming"):
        fedsim.resume(tmp_path / "part", quiet=True, mode="sync")
    resumed = fedsim.resume(tmp_path / "part", quiet=True, rounds=2)
    assert resumed.test_accuracy == full.test_accuracy and resumed.train_loss == full.train_loss
    assert child_pids() == []


@pytest.mark.slow
def test_a_killed_hogwild_worker_ends_the_run_with_one_line(hogwild, tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump({**hogwild, "rounds": 200}))
    tag = uuid.uuid4().hex
    proc = start(["run", str(config), "--out", str(tmp_path / "run")], tag)
    wait_for_round(proc, 1)
    workers = worker_pids(tagged_processes(tag))
    assert len(workers) == 2
    t0 = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and time.monotonic() - t0 < 30
    assert_one_line_error(err, "worker ", "killed by SIGKILL")
    assert tagged_processes(tag) == []


@pytest.mark.parametrize(
    "change, key",
    [
        ({"aggregator": "median"}, "aggregator"),
        ({"algorithm": "fedprox", "algorithm_options": {"mu": 0.01}}, "algorithm"),
        ({"server_optimizer": "fedadam"}, "server_optimizer"),
        ({"attack": {"type": "sign_flip", "fraction": 0.25}}, "attack.type"),
        ({"backend": "vmap", "workers": 1}, "backend"),
        ({"clients_per_round": 2}, "clients_per_round"),
        ({"privacy": {"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}}, "privacy"),
        ({"client_sampling": "by_size"}, "client_sampling"),
        ({"system": {"availability": 1.0, "dropout": 0.1}}, "system.dropout"),
    ],
)
def test_settings_hogwild_would_ignore_are_refused_naming_the_key(hogwild, change, key):
    with pytest.raises(ConfigError) as info:
        fedsim.load_config({**hogwild, **change})
    message = str(info.value)
    assert message.startswith(f"config: {key}: ") and "(mode: hogwild)" in message and "\n" not in message


def test_an_unknown_mode_is_one_line(hogwild):
    with pytest.raises(ConfigError, match=r"^config: mode: must be one of sync, async, hogwild, got 'lockfree'$"):
        fedsim.load_config({**hogwild, "mode": "lockfree"})


def test_hogwild_refuses_several_ranks(hogwild):
    from fedsim.execution.distributed import Ranks
    from fedsim.runs.session import Session

    ranks = Ranks()
    ranks.world = 2  # as torchrun would make it; refused before anything starts
    with pytest.raises(ConfigError, match="^mode: hogwild shares one model in one machine's memory"):
        Session(fedsim.load_config(hogwild), ranks=ranks)
    assert child_pids() == []


@pytest.mark.slow
@pytest.mark.cuda
def test_hogwild_on_cuda_learns_and_leaves_nothing_behind(hogwild, tmp_path):
    history = fedsim.run(dict(hogwild, device="cuda"), out=tmp_path / "run", quiet=True)  # weights over CUDA IPC
    assert history.test_accuracy[-1] > 0.5, history.test_accuracy
    assert history.summary["device"].startswith("cuda") and child_pids() == []
