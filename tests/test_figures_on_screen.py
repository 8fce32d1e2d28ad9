"""Each run's own figure where a researcher looks first: the personal models' accuracy on the
round line, in summary.json, the sweep table and accuracy.png; compression's megabytes and ratio,
privacy's epsilon and delta, async's staleness and the clients lost in summary.json and the sweep
table; each checked against the run's own metrics.csv and clients.csv, and FedAvg left as it was."""

from __future__ import annotations

import csv
import json
import logging
import re

import pytest

import fedsim
from fedsim.experiment.validation import load_config
from fedsim.results.history import History, load_run
from fedsim.results.plot import accuracy_figure
from fedsim.results.rundir import read_clients, read_metrics
from fedsim.runs.sweepruns import SweepRun, format_table, write_table

BASE = {
    "seed": 3,
    "device": "cpu",
    "rounds": 2,
    "workers": 0,
    "clients_per_round": 3,
    "model": "mnist_2nn",
    "data": {"dataset": "synthetic", "num_clients": 6, "limit": 600},
    "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
}
NEW_KEYS = {
    "final_personal_accuracy",
    "best_personal_accuracy",
    "megabytes_sent",
    "compression_ratio",
    "final_epsilon",
    "delta",
    "staleness_mean",
    "staleness_max",
    "clients_lost",
}


def run(tmp_path, name: str, **keys):
    config = {**BASE, "name": name, **keys, "data": {**BASE["data"], **keys.get("data", {})}}
    history = fedsim.run(config, out=tmp_path / name, progress=False)
    path = tmp_path / name
    summary = json.loads((path / "summary.json").read_text())
    return history, summary, read_metrics(path / "metrics.csv"), read_clients(path / "clients.csv")


def sweep_run(history) -> SweepRun:
    return SweepRun(history.name, [], load_config(history.config), history)


PERSONAL = {
    "algorithm": "ditto",
    "eval_per_client": True,
    "data": {"partition": "dirichlet", "alpha": 0.1, "test_partition": True},
}


@pytest.mark.slow
def test_personal_accuracy_on_the_line_in_the_summary_the_table_and_the_plot(tmp_path, capsys):
    history, summary, rows, _ = run(tmp_path, "ditto", **PERSONAL)
    assert summary["client_eval_model"] == "personal"
    means = [r["client_accuracy_mean"] for r in rows]
    assert summary["final_personal_accuracy"] == means[-1]
    assert summary["best_personal_accuracy"] == max(means)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert len(lines) == 2
    for line, row in zip(lines, rows):
        assert f"test acc {row['test_accuracy']:.4f}  personal acc {row['client_accuracy_mean']:.4f}  " in line

    fedavg, *_ = run(tmp_path, "fedavg")
    table = format_table([sweep_run(fedavg), sweep_run(history)]).splitlines()
    assert table[0].split() == [
        "run", "final", "global", "acc", "best", "global", "acc", "final", "personal", "acc", "best", "personal", "acc",
        "s/round",
    ]  # fmt: skip
    assert table[1].split()[3:5] == ["–", "–"]  # FedAvg has no personal models
    assert table[2].split()[3:5] == [f"{means[-1]:.4f}", f"{max(means):.4f}"]

    ax = accuracy_figure(load_run(tmp_path / "ditto")).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["global", "personal"]
    personal = [line for line in ax.lines if list(line.get_ydata()) == pytest.approx([100 * m for m in means])]
    assert len(personal) == 1


@pytest.mark.slow
def test_fedavg_looks_as_before(tmp_path, capsys):
    history, summary, rows, _ = run(tmp_path, "plain")
    # only its traffic, which every run has: all it sent, whole
    assert NEW_KEYS & set(summary) == {"megabytes_sent", "compression_ratio"}
    assert summary["megabytes_sent"] == pytest.approx(sum(r["bytes_up"] + r["bytes_down"] for r in rows) / 1e6)
    assert summary["compression_ratio"] == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    for line, row in zip(lines, rows, strict=True):
        expected = (
            rf"round {row['round']}/2  test acc {row['test_accuracy']:.4f}  test loss {row['test_loss']:.4f}  "
            rf"train loss {row['train_loss']:.4f}  \d+\.\d\d s"
            r"( \(\d+\.\d\d s scoring [\d,]+ test samples\))?"  # shown where scoring took a good part of the round
        )
        assert re.fullmatch(expected, line)
    assert format_table([sweep_run(history)]).splitlines()[0].split() == [
        "run",
        "final",
        "acc",
        "best",
        "acc",
        "s/round",
    ]
    ax = accuracy_figure(history).axes[0]
    assert ax.get_legend() is None


@pytest.mark.slow
def test_compression_megabytes_and_ratio_against_the_same_run_uncompressed(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fedsim"):
        packed, summary, rows, _ = run(tmp_path, "topk", compression={"type": "topk", "ratio": 0.05})
    model = fedsim.load_model(tmp_path / "topk")
    n = sum(p.numel() for p in model.parameters())
    length = n + sum(b.numel() for b in model.buffers())
    sent_update = 8 * round(0.05 * n) + 4 * (length - n)  # a value and an index per kept coordinate
    assert f"an update travels as {sent_update} of its {4 * length} bytes" in caplog.text
    whole, whole_summary, whole_rows, _ = run(tmp_path, "whole")
    sent = sum(r["bytes_up"] + r["bytes_down"] for r in rows)
    assert summary["megabytes_sent"] == pytest.approx(sent / 1e6, rel=1e-12)
    # the same seed samples the same clients: the uncompressed run is the ratio's denominator
    uncompressed = sum(r["bytes_up"] + r["bytes_down"] for r in whole_rows)
    assert summary["compression_ratio"] == pytest.approx(sent / uncompressed, rel=1e-12)
    assert 0 < summary["compression_ratio"] < 1
    # the uncompressed run, the baseline, has its traffic too, at a ratio of 1
    assert whole_summary["megabytes_sent"] == pytest.approx(uncompressed / 1e6, rel=1e-12)
    assert whole_summary["compression_ratio"] == 1
    table = format_table([sweep_run(packed), sweep_run(whole)]).splitlines()
    assert "MB sent" in table[0] and "ratio" in table[0]
    assert f"{sent / 1e6:.3g}" in table[1] and f"{sent / uncompressed:.3g}" in table[1]
    assert table[2].split()[-3:-1] == [f"{uncompressed / 1e6:.3g}", "1"]


@pytest.mark.slow
def test_privacy_epsilon_and_delta(tmp_path):
    privacy = {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-5}
    _, summary, rows, _ = run(tmp_path, "dp", client_sampling="poisson", privacy=privacy)
    assert summary["final_epsilon"] == rows[-1]["epsilon"] > 0
    assert summary["delta"] == 1e-5


def test_async_staleness_of_the_updates_used(tmp_path):
    asynchronous = {"mode": "async", "rounds": 3, "system": {"speed": {"lognormal": 1.0}, "step_seconds": 0.5}}
    history, summary, _, clients = run(tmp_path, "async", **asynchronous)
    used = [r["staleness"] for r in clients if r["dropped"] == 0]
    assert used
    assert summary["staleness_mean"] == pytest.approx(sum(used) / len(used), rel=1e-12)
    assert summary["staleness_max"] == max(used)
    assert "staleness" in format_table([sweep_run(history)]).splitlines()[0]


def test_clients_lost_to_dropouts_and_the_deadline(tmp_path):
    system = {"dropout": 0.3, "deadline": 8.0, "speed": {"lognormal": 1.0}, "step_seconds": 0.5}
    _, summary, rows, clients = run(tmp_path, "lossy", rounds=3, clients_per_round=4, system=system)
    lost = sum(1 for r in clients if r["dropped"] in ("dropout", "straggler"))
    assert summary["clients_lost"] == lost > 0
    assert lost == sum(r["dropped_clients"] for r in rows)  # no non-finite updates here


def test_sweep_under_seeds_takes_each_figures_mean(tmp_path):
    config = load_config({"compression": {"type": "topk"}})
    rows = [{"round": 1, "test_accuracy": 0.5, "seconds": 1.0}]
    runs = [
        SweepRun(f"c-s{seed}", [], config, History(rows, {}, None, {"megabytes_sent": mb}), seed, "c")
        for seed, mb in ((0, 1.0), (1, 2.5))
    ]
    table = format_table(runs).splitlines()
    assert table[0].split()[-2:] == ["sent", "s/round"] and table[1].split()[-2] == "1.75"
    write_table(runs, tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv") as f:
        assert float(next(csv.DictReader(f))["megabytes_sent"]) == 1.75
