"""What a run is told and tells: keys fedsim fills itself refused in model_options, an impossible
class count refused when the dataset file is read, every run's traffic in summary.json (the
compression sweep's baseline), the generated-data suggestion keeping the user's --set keys, and
a resumed run's header naming the keys the run began with."""

from __future__ import annotations

import json
import logging
import shlex

import numpy as np
import pytest
import torch

import fedsim
from fedsim.cli import main
from fedsim.core.errors import ConfigError, DataError
from fedsim.experiment.validation import load_config
from fedsim.results.history import History
from fedsim.runs.sweepruns import SweepRun, format_table

TINY = [
    "--set",
    "data.dataset=synthetic",
    "--set",
    "data.limit=400",
    "--set",
    "rounds=1",
    "--set",
    "workers=0",
    "--set",
    "device=cpu",
]


def _error_line(capsys) -> tuple[str, str]:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("fedsim: error: "), captured.err
    return captured.out, captured.err


# ----------------------------------------------------------------------------- model_options


@pytest.mark.parametrize("value", ["3", "2.5", "0", "nan"])
def test_model_options_num_classes_is_refused_before_anything_loads(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "mnist_seed", *TINY, "--set", f"model_options.num_classes={value}", "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    out, err = _error_line(capsys)
    assert "--set model_options.num_classes: the number of classes comes from the dataset" in err
    assert "loading" not in out  # refused at validation, before the data
    assert not (tmp_path / "r").exists()


def test_model_options_input_shape_is_refused_too():
    with pytest.raises(ConfigError, match=r"model_options\.input_shape: the input shape comes from the dataset"):
        load_config("mnist_seed", {"model_options": {"input_shape": [1, 28, 28]}})


def test_a_builder_fedsim_calls_without_arguments_keeps_its_own_num_classes():
    def linear(num_classes=4):  # fedsim passes it no arguments: num_classes is an option like any other
        return torch.nn.Linear(784, num_classes)

    cfg = load_config("mnist_seed", {"model": linear, "model_options": {"num_classes": 4}})
    assert cfg.model_options == {"num_classes": 4}

    def named_its_own_way(shape, classes, width=8):  # fedsim fills shape and classes by position
        return torch.nn.Linear(784, classes)

    with pytest.raises(ConfigError, match=r"model_options\.classes: the number of classes comes from the dataset"):
        load_config("mnist_seed", {"model": named_its_own_way, "model_options": {"classes": 4}})
    load_config("mnist_seed", {"model": named_its_own_way, "model_options": {"width": 4}})


# ----------------------------------------------------------------------------- num_classes of a file


def _write_npz(path, num_classes) -> None:
    rng = np.random.default_rng(0)
    np.savez(
        path,
        train_x=rng.normal(size=(40, 1, 4, 4)).astype(np.float32),
        train_y=rng.integers(0, 3, 40),
        test_x=rng.normal(size=(10, 1, 4, 4)).astype(np.float32),
        test_y=rng.integers(0, 3, 10),
        num_classes=np.int64(num_classes),
    )


def test_an_impossible_num_classes_is_refused_when_the_file_is_read(tmp_path, capsys):
    path = tmp_path / "huge.npz"
    _write_npz(path, 10**12)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "mnist_seed", "--set", f"data.dataset={path}", *TINY[4:], "--set", "model=mnist_2nn"])
    assert exit_info.value.code == 2  # the file's fault, not the machine's memory
    _, err = _error_line(capsys)
    assert f"data.dataset ({path}): num_classes is 1,000,000,000,000; at most 2,147,483,647" in err
    assert "memory" not in err


def test_num_classes_bound_is_2_to_the_31_minus_1(tmp_path):
    path = tmp_path / "bound.npz"
    _write_npz(path, 2**31)
    with pytest.raises(DataError, match="num_classes is 2,147,483,648; at most 2,147,483,647"):
        fedsim.data.load_dataset(str(path), tmp_path)
    x, y = torch.zeros(4, 2), torch.tensor([0, 1, 2, 0])
    assert fedsim.data.from_tensors(x, y, x, y, num_classes=2**31 - 1).num_classes == 2**31 - 1  # checked only


# ----------------------------------------------------------------------------- traffic of every run


TRAFFIC_BASE = {
    "seed": 1,
    "device": "cpu",
    "rounds": 2,
    "workers": 0,
    "clients_per_round": 2,
    "model": "mnist_2nn",
    "data": {"dataset": "synthetic", "num_clients": 4, "limit": 400},
}


@pytest.mark.slow
def test_an_uncompressed_run_has_its_megabytes_and_a_ratio_of_1(tmp_path):
    fedsim.run({**TRAFFIC_BASE, "name": "whole"}, out=tmp_path / "whole", progress=False)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    model = fedsim.load_model(tmp_path / "whole")
    update = 4 * (sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()))
    # each round the model goes down to 2 clients and 2 updates come back, float32, whole
    assert summary["megabytes_sent"] == pytest.approx(2 * 2 * 2 * update / 1e6, rel=1e-12)
    assert summary["compression_ratio"] == 1


def _sweep_run(label: str, compression: str, summary: dict) -> SweepRun:
    config = load_config({"compression": {"type": compression}})
    rows = [{"round": 1, "test_accuracy": 0.5, "seconds": 1.0}]
    return SweepRun(label, [("compression.type", compression)], config, History(rows, {}, None, summary))


def test_the_compression_sweeps_baseline_row_shows_its_traffic():
    runs = [
        _sweep_run("none", "none", {"megabytes_sent": 52.4, "compression_ratio": 1.0}),
        _sweep_run("topk", "topk", {"megabytes_sent": 26.7, "compression_ratio": 0.51}),
    ]
    table = format_table(runs).splitlines()
    assert table[0].split()[-4:] == ["MB", "sent", "ratio", "s/round"]
    assert table[1].split()[-3:-1] == ["52.4", "1"] and table[2].split()[-3:-1] == ["26.7", "0.51"]
    # a sweep in which nothing compresses has no traffic columns, as before
    plain = format_table([_sweep_run("none", "none", {"megabytes_sent": 52.4, "compression_ratio": 1.0})])
    assert plain.splitlines()[0].split() == ["run", "final", "acc", "best", "acc", "s/round"]


# ----------------------------------------------------------------------------- the generated-data hint


def test_the_generated_data_suggestion_keeps_the_users_other_keys(tmp_path, capsys):
    empty = tmp_path / "no data"
    empty.mkdir()
    sets = [f"data.root={empty}", "data.download=false", "name=my run", "local.lr=0.05", "data.dataset=mnist"]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "mnist_seed", *(w for s in [*sets, "data.limit=1000"] for w in ("--set", s))])
    assert exit_info.value.code == 2
    _, err = _error_line(capsys)
    suggestion = err.partition("or try it now on generated data: ")[2].strip()
    assert shlex.split(suggestion) == [
        "fedsim",
        "run",
        "mnist_seed",
        *(w for s in sets[:-1] for w in ("--set", s)),  # data.dataset and data.limit are replaced
        *("--set", "data.dataset=synthetic", "--set", "data.limit=null"),
    ]
    assert f"'data.root={empty}'" in suggestion and "'name=my run'" in suggestion  # quoted for the shell


@pytest.mark.slow
def test_the_generated_data_suggestion_runs_and_is_made_only_where_it_would(tmp_path, capsys):
    """The command the error suggests is run here and finishes; where generated images cannot
    stand in (a partition by the data's own clients or coarse labels, a model of characters), the
    error suggests nothing."""
    empty = tmp_path / "no data"
    empty.mkdir()
    offline = [f"data.root={empty}", "data.download=false", f"name={tmp_path / 'run'}"]
    quick = ["rounds=1", "workers=0", "data.num_clients=4", "clients_per_round=2"]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "mnist_seed", *(w for s in [*offline, *quick] for w in ("--set", s))])
    assert exit_info.value.code == 2
    suggestion = _error_line(capsys)[1].partition("or try it now on generated data: ")[2].strip()
    command = shlex.split(suggestion)
    assert command[:3] == ["fedsim", "run", "mnist_seed"] and "data.dataset=synthetic" in command
    with pytest.raises(SystemExit) as exit_info:
        main([*command[1:], "--out", str(tmp_path / "suggested")])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "suggested" / "summary.json").read_text())["status"] == "finished"
    capsys.readouterr()
    for experiment, missing in (("leaf/shakespeare", "no LEAF JSON files"), ("adaptive/cifar100", "no CIFAR100 files")):
        with pytest.raises(SystemExit) as exit_info:
            main(["run", experiment, *(w for s in [*offline, *quick] for w in ("--set", s))])
        assert exit_info.value.code == 2
        err = _error_line(capsys)[1]
        assert missing in err and "generated data" not in err, err


# ----------------------------------------------------------------------------- a resumed run's header


@pytest.mark.slow
def test_a_resumed_runs_header_names_the_keys_it_began_with(tmp_path, caplog):
    out, headers = tmp_path / "run", []
    for argv in (
        ["run", "mnist_seed", *TINY, "--set", "local.lr=0.05", "--out", str(out)],
        ["run", "--resume", str(out), "--set", "rounds=2"],
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedsim"), pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        headers.append(caplog.messages[0])
    first, resumed = headers
    assert first.endswith(
        "; with data.dataset=synthetic, data.limit=400, device=cpu, local.lr=0.05, rounds=1, workers=0"
    )
    assert resumed == first.replace("rounds=1", "rounds=2")  # its own --set joins them


@pytest.mark.parametrize(
    "options, words",
    [
        ({"hidden": 3}, "model_options: mnist_cnn takes no option 'hidden'; it takes no options"),
        ({"layers": 2, "depth": 3}, "model_options: char_transformer takes no option 'depth'; it takes: "),
    ],
)
def test_a_model_option_the_builder_does_not_take_is_refused_before_anything_loads(options, words):
    from fedsim.experiment.components import check_model_options

    model = "char_transformer" if "layers" in options else "mnist_cnn"
    with pytest.raises(ConfigError) as error:
        check_model_options(model, options)
    assert str(error.value).startswith(words), error.value
    check_model_options("char_transformer", {"layers": 2})  # one it takes


def test_personal_models_that_nothing_scores_are_warned_about():
    from fedsim.experiment.validation import unused_settings

    base = {"name": "p", "data": {"dataset": "synthetic", "num_clients": 4}, "clients_per_round": 2}
    warned = "algorithm ditto trains a model per client, which only eval_per_client: true"

    def warnings(**changes):
        return " | ".join(unused_settings(load_config({**base, **changes})))

    assert warned in warnings(algorithm="ditto")
    scored = {"eval_per_client": True, "data": {**base["data"], "test_partition": True}}
    assert "trains a model per client" not in warnings(algorithm="ditto", **scored)
    assert "trains a model per client" not in warnings(algorithm="fedavg")


def test_the_final_line_gives_each_features_figure():
    from fedsim.results.progress import final_line

    base = {"final_test_accuracy": 0.91234, "rounds": 30, "wall_seconds": 76.94}
    assert final_line(base, "runs/r") == "final test accuracy 0.9123 after round 30 (76.9 s); results in runs/r"
    everything = {
        **base,
        "best_test_accuracy": 0.9201,
        "final_personal_accuracy": 0.5274,
        "best_personal_accuracy": 0.5312,
        "personal_clients": 100,
        "personal_untrained_clients": 7,
        "megabytes_sent": 1.78208,
        "compression_ratio": 0.5104,
        "final_epsilon": 1.9171,
        "delta": 1e-5,
        "staleness_mean": 0.8567,
        "staleness_max": 5,
        "clients_lost": 95,
    }
    assert final_line(everything, "runs/r") == (
        "final test accuracy 0.9123 (the global model on the test set; best 0.9201), personal accuracy 0.5274 (the "
        "mean of 100 clients' own models on their own test splits, 7 of them never trained and scored as they would "
        "start; best 0.5312) after round 30 (76.9 s); 1.78 MB sent, 0.51 of "
        "uncompressed; epsilon 1.92 at delta 1e-05; staleness 0.86 on average, 5 at most; 95 sampled clients' "
        "work lost; results in runs/r"
    )
    prototypes = {**everything, "global_model_trained": False, "personal_untrained_clients": 0}
    assert final_line(prototypes, "runs/r").startswith(
        "final test accuracy 0.9123 (the global model on the test set, never trained: no weights are exchanged; best "
        "0.9201), personal accuracy 0.5274 (the mean of 100 clients' own models on their own test splits; best 0.5312)"
    )
    unscored = {**base, "global_model_trained": False}  # no eval_per_client: the global model alone
    assert final_line(unscored, "runs/r").startswith(
        "final test accuracy 0.9123 (the global model, never trained: no weights are exchanged; eval_per_client: "
        "true scores the clients' own models) after round 30"
    )
    uncompressed = {**base, "megabytes_sent": 3.5, "compression_ratio": 1.0, "clients_lost": 0}
    assert final_line(uncompressed, "runs/r") == final_line(base, "runs/r")  # nothing to compare, nothing lost
