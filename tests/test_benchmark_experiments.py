"""The federated benchmarks' experiment files: each checks as written, and runs its quick
version end to end on files in the datasets' published formats (generated here, as nobody has
FEMNIST, LEAF's Shakespeare or CIFAR-100 offline) or, for the play texts, on the real ones."""

import os
from pathlib import Path

import pytest
from test_cifar100 import write_fake_cifar100
from test_leaf import femnist_files, shakespeare_files, write_leaf

import fedsim
from fedsim.core.yamlfile import shipped_experiments
from fedsim.experiment.validation import load_config

BENCHMARKS = ["leaf/femnist", "leaf/shakespeare", "leaf/shakespeare_plays", "adaptive/cifar100", "adaptive/shakespeare"]
QUICK = {"rounds": 2, "eval_every": 1, "device": "cpu", "workers": 0}


def test_every_benchmark_is_shipped_and_checks_as_written():
    shipped = shipped_experiments()
    for name in BENCHMARKS:
        assert name in shipped and shipped[name], name  # listed by fedsim list, with what it asks
        cfg = load_config(name)
        assert cfg.data.partition in ("natural", "pachinko") and cfg.rounds >= 80


def quick(name, root, tmp_path, **overrides):
    history = fedsim.run(name, out=tmp_path / "run", quiet=True, **{"data.root": str(root), **QUICK, **overrides})
    assert history.summary["status"] == "finished" and history.summary["rounds"] == 2
    return history


@pytest.mark.slow
def test_femnist_runs_on_leafs_files(tmp_path):
    files = femnist_files()
    for split in ("train", "test"):
        write_leaf(tmp_path, "femnist", split, files[split])
    writers = {w for users in files["train"] for w in users}
    history = quick("leaf/femnist", tmp_path, tmp_path, **{"data.num_clients": len(writers), "clients_per_round": 2})
    assert 0 <= history.test_accuracy[-1] <= 1
    assert {r["client"] for r in history.client_records} <= set(range(len(writers)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["leaf/shakespeare", "adaptive/shakespeare"])
def test_shakespeare_runs_on_leafs_files(name, tmp_path):
    files = shakespeare_files()
    for split in ("train", "test"):
        write_leaf(tmp_path, "shakespeare", split, files[split])
    quick(name, tmp_path, tmp_path, **{"data.num_clients": 3, "clients_per_round": 2, "local.batch_size": 2})


@pytest.mark.slow
def test_cifar100_runs_with_the_pachinko_split(tmp_path):
    write_fake_cifar100(tmp_path, sizes=(("train", 200), ("test", 40)))
    history = quick(
        "adaptive/cifar100",
        tmp_path,
        tmp_path,
        **{"data.num_clients": 10, "clients_per_round": 2, "model": "cifar_cnn"},
    )
    assert history.client_records and all(r["samples"] == 20 for r in history.client_records)  # 200 over 10


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FEDSIM_DATA"), reason="needs the play texts (FEDSIM_DATA)")
def test_shakespeare_plays_learns_from_the_real_texts(tmp_path):
    """Two roles, one round of FedAvg with LEAF's settings: the character LSTM already scores far
    above 1/80 (chance) on the roles' own test windows."""
    root = Path(os.environ["FEDSIM_DATA"])
    history = fedsim.run(
        "leaf/shakespeare_plays",
        out=tmp_path / "run",
        quiet=True,
        **{
            "data.root": str(root),
            "data.num_clients": 2,
            "clients_per_round": 2,
            "rounds": 1,
            "device": "cpu",
            "workers": 0,
        },
    )
    assert history.test_accuracy[-1] > 5 / 80
