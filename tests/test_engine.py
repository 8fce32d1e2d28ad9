"""The multi-process round loop end to end, on CPU."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

import fedsim
from fedsim.results import COLUMNS

from conftest import child_pids, shm_entries


def test_run_learns_writes_files_and_leaves_nothing_behind(small_config, tmp_path):
    shm_before = shm_entries()
    history = fedsim.run(small_config, out=tmp_path / "run", quiet=True)

    assert history.round == [1, 2, 3]
    assert history.test_accuracy[-1] > 0.5, history.test_accuracy  # chance is 0.1
    assert history.test_accuracy[-1] > history.test_accuracy[0]
    assert history.train_loss[-1] < history.train_loss[0]

    run_dir = tmp_path / "run"
    for name in ("config.yaml", "metrics.csv", "summary.json", "accuracy.png", "checkpoint.pt"):
        assert (run_dir / name).is_file(), name
    with open(run_dir / "metrics.csv") as f:
        header = next(csv.reader(f))
    assert header[:5] == ["round", "test_accuracy", "test_loss", "train_loss", "seconds"]
    assert tuple(header) == COLUMNS
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_test_accuracy"] == history.test_accuracy[-1]
    assert summary["best_test_accuracy"] == max(history.test_accuracy)
    assert summary["rounds"] == 3 and summary["workers"] == 2 and summary["device"] == "cpu"
    assert summary["wall_seconds"] > 0
    resolved = fedsim.load_config(run_dir / "config.yaml")
    assert resolved.workers == 2 and resolved.device == "cpu" and resolved.local.lr == 0.05

    assert child_pids() == []
    assert shm_entries() <= shm_before


def test_metrics_do_not_depend_on_the_number_of_workers(small_config, tmp_path):
    # 4 clients per round: one worker trains all four in turn, two workers two each
    one = fedsim.run(small_config, out=tmp_path / "w1", quiet=True, workers=1)
    two = fedsim.run(small_config, out=tmp_path / "w2", quiet=True, workers=2)
    for column in ("test_accuracy", "test_loss", "train_loss"):
        assert getattr(one, column) == getattr(two, column), column  # bit-identical on CPU


def test_more_clients_per_round_than_workers_and_eval_every(small_config, tmp_path):
    cfg = dict(small_config, rounds=4, eval_every=3, clients_per_round=5, workers=2)
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    assert history.round == [3, 4]  # evaluated rounds, and always the last one
    assert all(c == 5 for c in history.clients)


def test_contiguous_split_matches_the_seed(small_config, tmp_path):
    cfg = dict(small_config, rounds=1, clients_per_round=3, workers=3)
    cfg["data"] = dict(cfg["data"], partition="contiguous", num_clients=3)
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    assert len(history) == 1 and history.test_accuracy[0] > 0.1


@pytest.mark.cuda
def test_cuda_run_matches_contract(small_config, tmp_path):
    cfg = dict(small_config, device="cuda")
    one = fedsim.run(cfg, out=tmp_path / "w1", quiet=True, workers=1)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    assert one.test_accuracy[-1] > 0.5
    assert one.summary["device"].startswith("cuda")
    # the same seeds on the same device; cuDNN may pick other kernels per process, so compare closely
    assert max(abs(a - b) for a, b in zip(one.test_accuracy, two.test_accuracy)) < 0.02
    assert child_pids() == []
