"""What a run says it ran, so that runs can be told apart: the header line, the run directory's
name, summary.json, the titles of its plots, and components recorded with their arguments."""

from __future__ import annotations

import json
import logging
import re

import pytest
from matplotlib.image import imread

import fedsim
from fedsim.core.errors import FedsimError
from fedsim.experiment.components import describe
from fedsim.experiment.config import directory_name, overrides_of
from fedsim.experiment.validation import load_config
from fedsim.results.history import History
from fedsim.results.plot import accuracy_figure, save_accuracy_plot
from fedsim.results.rundir import COLUMNS


class ServerStep(fedsim.Algorithm):
    def __init__(self, step=1.0, note="x"):
        self.step = step


def test_an_object_is_recorded_with_the_arguments_it_keeps():
    assert describe(ServerStep(0.5)) == f"{__name__}:ServerStep(step=0.5)"  # `note` is not kept: left out
    assert describe(ServerStep) == f"{__name__}:ServerStep"
    cfg = load_config("mnist_seed", {"algorithm": ServerStep(0.5)})
    assert cfg.to_dict()["algorithm"] == f"{__name__}:ServerStep(step=0.5)"


def test_the_overrides_are_the_keys_set_on_top_of_the_file_with_their_values():
    cfg = load_config("mnist_seed", ["data.dataset=synthetic", "local.lr=0.05", "device=cpu"])
    assert overrides_of(cfg) == {"data.dataset": "synthetic", "device": "cpu", "local.lr": 0.05}
    again = load_config(cfg, {"aggregator_options": {"beta": 0.2}, "aggregator": "trimmed_mean"})
    assert overrides_of(again) == {
        "aggregator": "trimmed_mean",
        "aggregator_options.beta": 0.2,
        "data.dataset": "synthetic",
        "device": "cpu",
        "local.lr": 0.05,
    }
    assert overrides_of(load_config("mnist_seed")) == {}


def test_a_run_directory_is_named_by_what_changes_the_run():
    def name(overrides):
        return directory_name(load_config("mnist_seed", overrides))

    assert name([]) == "mnist_seed"
    # where and how fast it runs is not what it computes; the seed is
    assert name(["device=cpu", "workers=2", "seed=3"]) == "mnist_seed-seed=3"
    assert name(["data.dataset=synthetic", "local.lr=0.05"]) == "mnist_seed-dataset=synthetic-lr=0.05"
    assert name({"algorithm": ServerStep(0.5)}) == "mnist_seed-algorithm=ServerStep(step=0.5)"
    long = name(
        ["data.dataset=synthetic", "local.lr=0.05", "local.momentum=0.9", "data.partition=dirichlet", "data.alpha=0.1"]
    )
    # as many keys and values as fit, then a hash of them all
    assert re.fullmatch(r"mnist_seed-alpha=0.1-dataset=synthetic-lr=0.05-[0-9a-f]{8}", long), long
    ffa = ["data.dataset=synthetic", "lora.rank=8", "lora.method=ffa", "local.lr=0.0002", "local.weight_decay=0.01"]
    fedit = name([c.replace("ffa", "fedit") for c in ffa])  # the default: not an override
    assert "-method=ffa-" in name(ffa) and "method" not in fedit and "-rank=8-" in fedit
    assert long != name(
        ["data.dataset=synthetic", "local.lr=0.05", "local.momentum=0.9", "data.partition=dirichlet", "data.alpha=0.2"]
    )


def _history(accuracies, summary):
    rows = [
        dict.fromkeys(COLUMNS, 0.5) | {"round": r, "test_accuracy": a, "test_perplexity": None}
        for r, a in enumerate(accuracies, 1)
    ]
    config = load_config("mnist_seed", ["data.dataset=synthetic"]).to_dict()
    return History(rows, config, None, summary)


def test_the_accuracy_plot_reaches_down_to_chance_and_says_what_ran(tmp_path):
    flat = _history(
        [0.109, 0.110, 0.1095], {"num_classes": 10, "overrides": {"data.dataset": "synthetic", "workers": 2}}
    )
    ax = accuracy_figure(flat).axes[0]
    low, high = ax.get_ylim()
    assert low <= 10 and high - low >= 20  # a flat line at 11 % is drawn flat, above the chance line
    assert any(line.get_ydata()[0] == 10 for line in ax.get_lines())
    name, *described = ax.get_title().split("\n")
    assert name == "mnist_seed"
    assert " ".join(described) == (
        "synthetic (contiguous, 4 clients), model mnist_cnn, aggregator fedavg, "
        "algorithm fedavg; with data.dataset=synthetic"
    )  # workers: how, not what
    climbing = accuracy_figure(_history([0.3, 0.97, 0.99], {"num_classes": 10})).axes[0]
    assert climbing.get_ylim()[0] <= 10 and climbing.get_ylim()[1] >= 99
    save_accuracy_plot(flat, tmp_path / "accuracy.png")
    assert imread(tmp_path / "accuracy.png").shape[1] == 5 * 300  # 5 inches at 300 dpi


@pytest.mark.slow
def test_the_header_the_directory_and_the_summary_say_what_ran(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own would take fedsim's messages
    monkeypatch.chdir(tmp_path)
    cfg = {
        "name": "told",
        "seed": 1,
        "device": "cpu",
        "rounds": 2,
        "workers": 0,
        "clients_per_round": 2,
        "data": {"dataset": "synthetic", "limit": 600, "num_clients": 4},
    }
    history = fedsim.run(cfg, algorithm=ServerStep(0.5), **{"local.lr": 0.05})
    assert history.run_dir.parent.name == "runs"
    assert history.run_dir.name.startswith("told-algorithm=ServerStep_step=0.5_-lr=0.05-")  # ( ) made safe
    lines = capsys.readouterr().out.splitlines()
    what = (
        f"synthetic (iid, 4 clients), model mnist_cnn, aggregator fedavg, algorithm "
        f"{__name__}:ServerStep(step=0.5); with algorithm={__name__}:ServerStep(step=0.5), local.lr=0.05"
    )
    assert lines[:2] == [f"told: {what}", "loading synthetic on cpu"]
    assert lines[2].startswith("told: 2 rounds of 2/4 clients, 0 workers on cpu, ready in ")
    summary = json.loads((history.run_dir / "summary.json").read_text())
    assert {
        key: summary[key]
        for key in (
            "dataset",
            "partition",
            "model",
            "aggregator",
            "algorithm",
            "num_classes",
            "overrides",
            "resumed_at_round",
        )
    } == {
        "dataset": "synthetic",
        "partition": "iid",
        "model": "mnist_cnn",
        "aggregator": "fedavg",
        "algorithm": f"{__name__}:ServerStep(step=0.5)",
        "num_classes": 10,
        "resumed_at_round": None,
        "overrides": {"algorithm": f"{__name__}:ServerStep(step=0.5)", "local.lr": 0.05},
    }
    fedsim.resume(history.run_dir, rounds=3, algorithm=ServerStep(0.5))
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("told: rounds 3 to 3 (resumed from the checkpoint of round 2) of 2/4 clients")
    summary = json.loads((history.run_dir / "summary.json").read_text())
    assert summary["resumed_at_round"] == 3 and summary["overrides"]["local.lr"] == 0.05


def test_a_resume_after_a_kill_keeps_how_the_run_was_started(tmp_path):
    """A run killed before it could write summary.json (kill -9, out of memory, a hang-up): its
    resume still knows the keys set when the run began, from the run directory's own files."""
    history = fedsim.run(
        "mnist_seed",
        out=tmp_path / "run",
        quiet=True,
        rounds=2,
        workers=0,
        dataset="synthetic",
        **{"data.limit": 400, "local.lr": 0.05},
    )
    (history.run_dir / "summary.json").unlink()  # what a killed process leaves: no summary
    fedsim.resume(history.run_dir, rounds=3, quiet=True)
    summary = json.loads((history.run_dir / "summary.json").read_text())
    expected = {"data.dataset": "synthetic", "data.limit": 400, "local.lr": 0.05, "rounds": 3, "workers": 0}
    assert summary["overrides"] == expected


def test_a_resume_refuses_the_files_of_another_run_with_as_many_rows(tmp_path):
    """Each file's last row up to the checkpoint is kept in it, cell for cell: another run's
    metrics.csv or clients.csv, copied in with the same number of rows, is named in one line and
    nothing is written."""
    quick = dict(quiet=True, rounds=2, workers=0, dataset="synthetic", **{"data.limit": 400})
    mine = fedsim.run("mnist_seed", out=tmp_path / "mine", **quick).run_dir
    other = fedsim.run("mnist_seed", out=tmp_path / "other", seed=2, **quick).run_dir  # its own numbers
    for name in ("metrics.csv", "clients.csv"):
        kept = (mine / name).read_bytes()
        (mine / name).write_bytes((other / name).read_bytes())
        with pytest.raises(FedsimError) as refused:
            fedsim.resume(mine, rounds=3, quiet=True)
        assert str(refused.value).startswith(f"{mine / name}: row ") and "is another run's" in str(refused.value)
        assert "\n" not in str(refused.value) and (mine / name).read_bytes() == (other / name).read_bytes()
        (mine / name).write_bytes(kept)
    assert fedsim.resume(mine, rounds=3, quiet=True).summary["rounds"] == 3  # its own files: resumed


def test_a_lora_run_and_a_server_optimizer_are_named_in_the_runs_description():
    from fedsim.experiment.validation import load_config
    from fedsim.results.history import describe_run

    lora = {"model": "char_transformer", "lora": {"rank": 8, "method": "ffa", "target_modules": "c_attn"}}
    text = describe_run(load_config({**lora, "data": {"dataset": "shakespeare_text"}}).to_dict())
    assert "model char_transformer with LoRA ffa rank 8, aggregator fedavg, algorithm fedavg" in text
    text = describe_run(load_config({"server_optimizer": "fedadam"}).to_dict())
    assert "model mnist_cnn, aggregator fedavg, server optimizer fedadam, algorithm fedavg" in text
    assert "LoRA" not in text and "server optimizer" not in describe_run(load_config({}).to_dict())


def test_hetlora_and_flora_are_described_by_their_own_aggregation_and_long_lists_are_shortened():
    from fedsim.algorithms.flora import FLoRA
    from fedsim.algorithms.hetlora import HetLoRA
    from fedsim.experiment.validation import load_config
    from fedsim.results.history import describe_run

    ranks = {"choice": list(range(1, 65))}
    lora = {"rank": 64, "client_ranks": ranks, "target_modules": "c_attn"}
    config = load_config(
        {"model": "char_transformer", "algorithm": "hetlora", "lora": lora, "data": {"dataset": "shakespeare_text"}}
    ).to_dict()
    overrides = {f"model_options.option_{i}": "x" * 30 for i in range(6)} | {"lora.client_ranks": ranks}
    text = describe_run(config, overrides, HetLoRA().aggregation("fedavg"))
    assert (
        "model char_transformer with LoRA rank 64 (clients' ranks choice among 64 from 1 to 64), "
        "aggregation sparsity-weighted zero-padding (HetLoRA), algorithm hetlora; with " in text
    )
    assert "aggregator fedavg" not in text and "LoRA fedit" not in text
    assert len(text) < 400 and text.endswith(" and 5 more")  # whole keys only, never one cut in two
    assert HetLoRA().aggregation("median") == "sparsity-weighted median zero-padding (HetLoRA)"
    assert FLoRA().aggregation("fedavg") == "stacking merged into the base (FLoRA)"
    # a run whose algorithm keeps the rule is described as before
    assert "aggregator fedavg, algorithm fedavg" in describe_run(load_config({}).to_dict(), None, "fedavg")


def test_a_language_models_plot_title_keeps_to_a_few_lines():
    from fedsim.results.plot import TITLE_LINES, _default_title

    config = load_config({"name": "lm", "lora": {"rank": 40, "client_ranks": {"choice": list(range(1, 40))}}})
    overrides = {f"local.key_{i}": "v" * 25 for i in range(12)}
    history = History([], config.to_dict(), None, {"overrides": overrides, "aggregation": "fedavg"})
    title = _default_title([history], "test_accuracy", "round").splitlines()
    assert title[0] == "lm" and len(title) == 1 + TITLE_LINES and title[-1].endswith(" ...")
    assert all(len(line) <= 60 for line in title)


def test_the_ready_line_counts_rounds_in_words_that_agree():
    from pathlib import Path

    import torch

    from fedsim.runs.session import ready_message

    cfg = load_config({"name": "one", "rounds": 1, "clients_per_round": 2, "data": {"num_clients": 4}})
    line = ready_message(cfg, 1, 1, 0, torch.device("cpu"), 0.25, Path("runs/one"))
    assert line == "one: 1 round of 2/4 clients, 0 workers on cpu, ready in 0.2 s; writing runs/one"
    finishing = ready_message(cfg, 2, 1, 0, torch.device("cpu"), 0.25, Path("runs/one"))
    assert finishing == "one: every round done (the checkpoint of round 1); writing its summary and plot in runs/one"
