"""The multi-process round loop end to end, on CPU."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from support import child_pids, shm_entries, shm_left_behind

import fedsim
from fedsim.models import MODELS
from fedsim.results.rundir import COLUMNS

pytestmark = pytest.mark.slow


def test_run_learns_writes_files_and_leaves_nothing_behind(learning_config, tmp_path):
    shm_before = shm_entries()
    history = fedsim.run(learning_config, out=tmp_path / "run", quiet=True)

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
    assert shm_left_behind(shm_before) == set()


def test_metrics_do_not_depend_on_the_number_of_workers(small_config, tmp_path):
    # 4 clients per round: one worker trains all four in turn, two workers two each, and with
    # workers: 0 the server trains them itself; the second round starts from the first's aggregate
    one = fedsim.run(small_config, out=tmp_path / "w1", quiet=True, workers=1, rounds=2)
    two = fedsim.run(small_config, out=tmp_path / "w2", quiet=True, workers=2, rounds=2)
    none = fedsim.run(small_config, out=tmp_path / "w0", quiet=True, workers=0, rounds=2)
    for column in ("test_accuracy", "test_loss", "train_loss"):
        assert getattr(one, column) == getattr(two, column) == getattr(none, column), column  # bit-identical on CPU
    assert none.summary["workers"] == 0 and child_pids() == []
    # no worker process: no worker's memory, the server's own figures alone
    assert none.summary["worker_peak_memory_mb"] == [] and none.summary.get("worker_pss_mb", []) == []
    assert len(two.summary["worker_peak_memory_mb"]) == 2


def trained_on_threads(threads: int):
    """mnist_cnn that refuses to train with any other number of torch threads than ``threads``
    (a local class: pickled by value into the workers)."""

    class OnThreads(torch.nn.Module):
        def __init__(self, input_shape, num_classes):
            super().__init__()
            self.inner = MODELS.get("mnist_cnn")(input_shape, num_classes)

        def forward(self, x):
            if self.training and torch.get_num_threads() != threads:
                raise RuntimeError(f"training on {torch.get_num_threads()} threads, not {threads}")
            return self.inner(x)

    return OnThreads


def test_threads_set_each_workers_threads_and_the_numbers_stay_those_of_any_workers(small_config, tmp_path):
    """threads: 2 trains every client on two threads, in a worker or in the server (workers: 0);
    one worker or two, the same numbers and the same final weights."""
    cfg = dict(small_config, threads=2, rounds=2, model=trained_on_threads(2))
    runs = {w: fedsim.run(cfg, out=tmp_path / f"w{w}", quiet=True, workers=w) for w in (1, 2, 0)}
    for column in ("test_accuracy", "test_loss", "train_loss"):
        assert getattr(runs[1], column) == getattr(runs[2], column) == getattr(runs[0], column), column
    weights = [torch.load(tmp_path / f"w{w}" / "checkpoint.pt", weights_only=True)["global"] for w in (1, 2, 0)]
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[0], weights[2])
    assert runs[1].test_accuracy[-1] > 0.3, runs[1].test_accuracy  # it trained (chance is 0.1)


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


def test_a_simulation_takes_any_function_for_its_lines(small_config, tmp_path):
    from fedsim.results.rundir import RunDirectory
    from fedsim.runs.session import Session

    lines = []
    sim = Session(fedsim.load_config(dict(small_config, rounds=2)), log=lines.append)
    history = sim.run(RunDirectory.create(tmp_path / "run"))
    assert [line.split()[1] for line in lines if line.startswith("round")] == ["1/2", "2/2"]
    assert history.round == [1, 2] and child_pids() == []


class TrainsBadly(torch.nn.Module):
    """Fine for the probe (eval mode), broken in training."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(784, 10)

    def forward(self, x):
        if self.training:
            raise RuntimeError("no such layer")
        return self.fc(x.flatten(1))


def not_built():
    raise ValueError("weights file missing")


def test_a_failing_model_is_one_line_with_or_without_workers(small_config, tmp_path):
    from fedsim.core.errors import ConfigError, WorkerError

    with pytest.raises(WorkerError) as info:
        fedsim.run(dict(small_config, workers=0), out=tmp_path / "inline", quiet=True, model=TrainsBadly)
    assert str(info.value).endswith("in round 1 failed (RuntimeError: no such layer)")
    with pytest.raises(WorkerError) as info:
        fedsim.run(dict(small_config, workers=1), out=tmp_path / "worker", quiet=True, model=TrainsBadly)
    assert "worker 0 failed while training client" in str(info.value) and "no such layer" in str(info.value)
    with pytest.raises(ConfigError) as info:
        fedsim.run(dict(small_config, workers=0), out=tmp_path / "built", quiet=True, model=not_built)
    assert str(info.value) == (
        "keyword model: test_loop:not_built failed when it was built (ValueError: weights file missing)"
    )
    assert child_pids() == []


@pytest.mark.slow
def test_a_run_from_initial_weights_scores_its_base_as_round_0(tmp_path):
    """A fine-tuning run scores the model it starts from before any client trains: round 0 is the
    base run's last round, on the same test set, so the gain over the base is in metrics.csv."""
    cfg = {
        "name": "base",
        "seed": 1,
        "rounds": 2,
        "workers": 0,
        "clients_per_round": 2,
        "data": {"dataset": "synthetic", "num_clients": 4, "limit": 600},
        "local": {"batch_size": 32, "lr": 0.05},
    }
    base = fedsim.run(cfg, out=tmp_path / "base", quiet=True)
    tuned = fedsim.run({**cfg, "initial_weights": str(base.run_dir)}, out=tmp_path / "tuned", quiet=True)
    assert tuned.round == [0, 1, 2]
    assert tuned.test_loss[0] == base.test_loss[-1] and tuned.test_accuracy[0] == base.test_accuracy[-1]
    assert tuned.rows[0]["clients"] == 0 and tuned.test_loss[2] < tuned.test_loss[0]
    written = fedsim.load_run(tuned.run_dir)  # metrics.csv has it
    assert written.round == [0, 1, 2] and written.test_loss == tuned.test_loss
    resumed = fedsim.run({**cfg, "initial_weights": str(base.run_dir), "rounds": 1}, out=tmp_path / "part", quiet=True)
    assert fedsim.resume(resumed.run_dir, rounds=2, quiet=True).test_loss == tuned.test_loss  # scored once
