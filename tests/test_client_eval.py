"""Per-client evaluation (eval_per_client with data.test_partition): the spread's definitions, the
columns and client_accuracy.csv against a direct evaluation of the run's final model, resume,
and runs without it."""

from __future__ import annotations

import csv
import math

import pytest
import torch

import fedsim
from fedsim.core.flat import FlatModel
from fedsim.data import local_test_split
from fedsim.experiment.federation import initial_model, load_federation
from fedsim.experiment.validation import load_config
from fedsim.fl.client_eval import spread
from fedsim.results.rundir import COLUMNS

CONFIG = {
    "name": "per_client",
    "seed": 5,
    "device": "cpu",
    "rounds": 3,
    "workers": 0,
    "clients_per_round": 4,
    "model": "mnist_2nn",
    "eval_per_client": True,
    "data": {"dataset": "synthetic", "num_clients": 10, "partition": "dirichlet", "alpha": 0.3, "test_partition": True},
    "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
}
SPREAD = ("client_accuracy_mean", "client_accuracy_std", "client_accuracy_p10")


def by_hand(accuracies: list[float]) -> tuple[float, float, float]:
    """Mean, standard deviation over the n clients (divided by n) and the 10th percentile,
    linear between the order statistics around rank h = 0.1 (n - 1)."""
    values = sorted(a for a in accuracies if not math.isnan(a))
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    h = 0.1 * (n - 1)
    low = math.floor(h)
    high = min(low + 1, n - 1)
    return mean, std, values[low] + (h - low) * (values[high] - values[low])


def test_spread_is_the_mean_the_deviation_over_clients_and_the_tenth_percentile():
    # 11 values: h = 1.0 exactly, so p10 is the second smallest; NaN (no test samples) is left out
    values = [0.9, 0.2, math.nan, 0.5, 0.7, 0.1, 0.8, 0.6, 0.3, 1.0, 0.4, 0.95]
    got = spread(values)
    assert got["client_accuracy_p10"] == pytest.approx(0.2, abs=1e-15)
    assert tuple(got[c] for c in SPREAD) == pytest.approx(by_hand(values), abs=1e-15)
    # 5 values: h = 0.4, 40 % of the way from the smallest to the second smallest
    assert spread([0.5, 0.0, 1.0, 0.25, 0.75])["client_accuracy_p10"] == pytest.approx(0.1, abs=1e-15)
    one = spread([0.625])
    assert (one["client_accuracy_mean"], one["client_accuracy_std"], one["client_accuracy_p10"]) == (0.625, 0.0, 0.625)
    assert all(math.isnan(v) for v in spread([math.nan, math.nan]).values())


@pytest.mark.slow
def test_columns_and_table_agree_with_a_direct_evaluation_of_the_final_model(tmp_path):
    history = fedsim.run(CONFIG, out=tmp_path / "run", quiet=True)
    run_dir = tmp_path / "run"

    # the run's data, split as it was, and its final global model from the checkpoint
    cfg = load_config(run_dir / "config.yaml")
    federation = load_federation(cfg)
    data = federation.data
    tests = local_test_split(data.train_y, federation.parts, data.test_y, cfg.seed)
    model = FlatModel(initial_model(cfg, data), "cpu")
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["round"] == 3
    model.flat.copy_(state["global"])
    model.module.eval()
    accuracies, sizes = [], []
    with torch.no_grad():
        for index in tests:  # one client at a time, its whole split in one batch
            right = (model.module(data.test_x[index]).argmax(dim=1) == data.test_y[index]).sum().item()
            sizes.append(len(index))
            accuracies.append(right / len(index) if len(index) else math.nan)

    with open(run_dir / "client_accuracy.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["round", "client", "client_name", "model", "samples", "accuracy", "trained"]
    assert {(r["model"], r["trained"]) for r in rows} == {("global", "")}  # fedavg has no personal models
    assert len(rows) == 3 * 10 and [int(r["round"]) for r in rows] == [1] * 10 + [2] * 10 + [3] * 10
    last = rows[-10:]
    assert [int(r["client"]) for r in last] == list(range(10))
    assert [int(r["samples"]) for r in last] == sizes and sum(sizes) == len(data.test_y)
    assert [float(r["accuracy"]) for r in last] == accuracies  # the same counts over the same sizes

    final = history.rows[-1]
    mean, std, p10 = by_hand(accuracies)
    assert final["client_accuracy_mean"] == pytest.approx(mean, abs=1e-12)
    assert final["client_accuracy_std"] == pytest.approx(std, abs=1e-12)
    assert final["client_accuracy_p10"] == pytest.approx(p10, abs=1e-12)
    assert std > 0 and p10 < mean  # label-skewed clients do not fare alike
    # the same from the run directory, and the table through History
    loaded = fedsim.load_run(run_dir)
    for column in SPREAD:
        assert getattr(loaded, column) == getattr(history, column)
    assert loaded.client_accuracy == history.client_accuracy
    assert [r["accuracy"] for r in loaded.client_accuracy[-10:]] == accuracies
    assert loaded.epsilon == [None, None, None]  # no privacy section


@pytest.mark.slow
def test_scoring_the_clients_changes_nothing_else_and_survives_a_resume(tmp_path):
    full = fedsim.run(CONFIG, out=tmp_path / "full", quiet=True)
    without = fedsim.run({**CONFIG, "eval_per_client": False}, out=tmp_path / "without", quiet=True)
    for column in ("test_accuracy", "test_loss", "train_loss"):
        assert getattr(full, column) == getattr(without, column), column
    assert without.client_accuracy_mean == [None] * 3 and without.client_accuracy == []
    assert not (tmp_path / "without" / "client_accuracy.csv").exists()
    with open(tmp_path / "without" / "metrics.csv", newline="") as f:
        assert tuple(next(csv.reader(f))) == COLUMNS  # the columns are there, empty

    # stopped after round 2, resumed to 3: the same table as the run that went straight through
    fedsim.run({**CONFIG, "rounds": 2}, out=tmp_path / "resumed", quiet=True)
    (tmp_path / "resumed" / "client_accuracy.csv").write_text(
        (tmp_path / "resumed" / "client_accuracy.csv").read_text() + "3,0,,global,1,0.5\n"
    )  # a row the checkpoint lacks
    resumed = fedsim.resume(tmp_path / "resumed", quiet=True, rounds=3)
    assert (tmp_path / "resumed" / "client_accuracy.csv").read_text() == (
        tmp_path / "full" / "client_accuracy.csv"
    ).read_text()
    assert resumed.client_accuracy_p10 == full.client_accuracy_p10


def test_eval_per_client_needs_the_test_partition():
    from fedsim.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^config: eval_per_client: needs data.test_partition: true"):
        load_config({**CONFIG, "data": {**CONFIG["data"], "test_partition": False}})


def test_a_run_directory_from_before_these_columns_still_loads(tmp_path):
    old = (
        "round",
        "test_accuracy",
        "test_loss",
        "train_loss",
        "seconds",
        "elapsed_seconds",
        "clients",
        "dropped_clients",
        "attackers",
        "train_seconds",
        "worker_seconds",
        "aggregate_seconds",
        "eval_seconds",
    )
    (tmp_path / "metrics.csv").write_text(",".join(old) + "\n" + "1,0.5,1.2,1.3,2.0,2.0,4,0,0,1.0,0.9,0.1,0.2\n")
    history = fedsim.load_run(tmp_path)
    assert history.test_accuracy == [0.5] and history.epsilon == [None]
    assert all(getattr(history, column) == [None] for column in SPREAD) and history.client_accuracy == []


def test_a_client_without_test_samples_is_left_out_and_warned_about():
    from fedsim.fl.client_eval import ClientEvaluation

    x = torch.tensor([[1.0], [-1.0], [2.0], [-3.0], [0.5]])
    y = torch.tensor([1, 1, 1, 0, 0])
    model = torch.nn.Linear(1, 2)
    with torch.no_grad():  # class 1 for positive inputs, class 0 for negative ones
        model.weight.copy_(torch.tensor([[-1.0], [1.0]]))
        model.bias.zero_()
    parts = [torch.tensor([0, 1]), torch.tensor([], dtype=torch.int64), torch.tensor([2, 3, 4])]
    evaluation = ClientEvaluation(parts, torch.device("cpu"))
    assert evaluation.warning().startswith("eval_per_client: 1 of 3 clients get no test sample")
    got = evaluation.score(model, x, y, batch_size=2, rnd=7)  # batches that straddle clients
    # client 0: right on 0, wrong on 1; client 2: right on 2 and 3, wrong on 4 (0.5 > 0 gives class 1)
    assert [(r["round"], r["client"], r["samples"]) for r in evaluation.last] == [(7, 0, 2), (7, 1, 0), (7, 2, 3)]
    assert evaluation.last[0]["accuracy"] == 0.5 and math.isnan(evaluation.last[1]["accuracy"])
    assert evaluation.last[2]["accuracy"] == 2 / 3
    assert got == spread([0.5, 2 / 3]) and ClientEvaluation(parts[:1], torch.device("cpu")).warning() is None


@pytest.mark.parametrize("model, shape", [("mnist_2nn", (1, 28, 28)), ("cifar_cnn_bn", (3, 32, 32))])
def test_each_client_is_scored_with_its_own_model_in_a_group_or_alone(model, shape):
    """score_personal's groups (vmap over the clients' stacked weights, batch-norm statistics
    included) and its one-at-a-time path give each client the hits of its own model on its own
    split, as a plain forward pass of that model counts them; a client not trained is marked so."""
    from fedsim.fl.client_eval import ClientEvaluation
    from fedsim.models import build_model

    torch.manual_seed(0)
    flat_model = FlatModel(build_model(model, shape, 10), "cpu")
    sizes = [0, 1, 3, 3, 5, 8, 13, 40]  # up to 8 in groups; 13 and 40 alone, 40 in three batches of 16
    x, y = torch.randn(sum(sizes), *shape), torch.randint(0, 10, (sum(sizes),))
    parts = list(torch.randperm(sum(sizes)).split(sizes))
    own = flat_model.flat + 0.05 * torch.randn(len(sizes), len(flat_model.flat))
    own[:, flat_model.num_params :] = (
        flat_model.flat[flat_model.num_params :].abs() + 0.5
    )  # buffers: positive variances
    evaluation = ClientEvaluation(parts, torch.device("cpu"))
    columns = evaluation.score_personal(
        flat_model, flat_model.module, lambda clients: own[clients], x, y, 16, rnd=3, trained={2, 5}
    )
    module = build_model(model, shape, 10).eval()
    expected = []
    for client, part in enumerate(parts):
        FlatModel(module, "cpu").flat.copy_(own[client])
        with torch.no_grad():
            hits = (module(x[part]).argmax(1) == y[part]).sum().item() if len(part) else 0
        expected.append(hits / len(part) if len(part) else math.nan)
    got = [r["accuracy"] for r in evaluation.last]
    assert [math.isnan(a) for a in got] == [math.isnan(a) for a in expected]
    assert [a for a in got if not math.isnan(a)] == [a for a in expected if not math.isnan(a)]
    assert [r["trained"] for r in evaluation.last] == [0, 0, 1, 0, 0, 1, 0, 0]
    assert columns["client_accuracy_mean"] == pytest.approx(sum(expected[1:]) / 7, abs=1e-12)
