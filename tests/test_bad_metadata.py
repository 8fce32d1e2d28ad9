"""Metadata that cannot be, and a rule's output that cannot be a step: a rule that returns the
wrong length, dtype or device, or no tensor at all, on round 1's real updates (its probe sees 3
values on the CPU), fails the run in one line naming it; a dataset whose ``num_classes`` is not an
integer, or whose own tensors contradict each other, is refused in one line naming it, exit 2,
before the model is built."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import yaml

from fedsim.cli import main
from fedsim.core.errors import DataError
from fedsim.data import from_tensors, load_dataset
from fedsim.data.tensors import Dataset

TINY = {
    "name": "meta",
    "seed": 4,
    "device": "cpu",
    "rounds": 1,
    "workers": 0,
    "clients_per_round": 3,
    "data": {"dataset": "synthetic", "num_clients": 3, "limit": 900},
    "local": {"lr": 0.05, "batch_size": 32},
}


def cli(capsys, tmp_path, *settings) -> tuple[int, str]:
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(TINY))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(config), "--out", str(tmp_path / "run"), *(a for s in settings for a in ("--set", s))])
    return exit_info.value.code, capsys.readouterr().err


# rules that pass the probe's 3 values on the CPU and go wrong on the model's real updates
def short(updates, weights):
    return updates.mean(0)[:3]


def double(updates, weights):
    return updates.mean(0).double() if updates.shape[1] > 3 else updates.mean(0)


def always_double(updates, weights):
    return updates.mean(0).double()


def on_meta(updates, weights):
    return torch.zeros(updates.shape[1], device="meta")


def as_list(updates, weights):
    return updates.mean(0).tolist() if updates.shape[1] > 3 else updates.mean(0)


def fails_naming_the_rule(capsys, tmp_path, rule: str, got: str, updates: int, *settings: str) -> int:
    """Runs the rule ``rule`` of this file; the run fails in one line naming it, what it returned
    (``got``, a pattern) for ``updates`` updates and what was expected. Returns the updates' length,
    which the line gives twice."""
    code, err = cli(capsys, tmp_path, f"aggregator=test_bad_metadata:{rule}", *settings)
    lines = [line for line in err.splitlines() if not line.startswith("fedsim: warning")]
    assert code == 1 and len(lines) == 1, err
    pattern = (
        rf"fedsim: error: aggregator test_bad_metadata:{rule} returned {got} in round 1 for {updates} updates of "
        r"(\d+) values; expected a tensor of shape \((\d+),\), torch\.float32 on cpu, as the updates"
    )
    match = re.fullmatch(pattern, lines[0])
    assert match, lines[0]
    sizes = {int(n) for n in match.groups() if n is not None}
    assert len(sizes) == 1
    return sizes.pop()


@pytest.mark.parametrize(
    "rule, got",
    [
        ("short", r"shape \(3,\), torch\.float32 on cpu"),
        ("double", r"shape \((\d+),\), torch\.float64 on cpu"),
        ("on_meta", r"shape \((\d+),\), torch\.float32 on meta"),
        ("as_list", "list"),
    ],
)
def test_a_rule_whose_output_is_no_step_fails_the_run_in_one_line(tmp_path, capsys, rule, got):
    assert fails_naming_the_rule(capsys, tmp_path, rule, got, 3) > 3  # the model's parameters, each time
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds"] == 0


@pytest.mark.parametrize(
    "rule, got",
    [("short", r"shape \(3,\), torch\.float32 on cpu"), ("double", r"shape \((\d+),\), torch\.float64 on cpu")],
)
def test_a_rule_whose_output_is_no_step_is_named_in_an_attacks_search(tmp_path, capsys, rule, got):
    """The optimal attack tries the rule first, after NNM has run on the updates' coordinates in
    their span: the rule reads the rows they stand for, and is held to their shape."""
    settings = ["pre_aggregators=[nnm]", "attack.type=optimal_ipm", "attack.count=1"]
    assert fails_naming_the_rule(capsys, tmp_path, rule, got, 4, *settings) > 4


def test_a_rule_of_the_wrong_dtype_on_the_probe_is_refused_before_the_run(tmp_path, capsys):
    code, err = cli(capsys, tmp_path, "aggregator=test_bad_metadata:always_double")
    assert code == 2 and not (tmp_path / "run").exists(), err
    assert err.splitlines() == [
        "fedsim: error: --set aggregator: test_bad_metadata:always_double returns shape (3,) (torch.float64) for 3 "
        "updates of 3 values; expected shape (3,) (torch.float32), as the updates"
    ]


def three_classes(**changes) -> Dataset:
    """A dataset of 12 training and 6 test samples of 4 values, labels 0..2, with ``changes``."""
    y = torch.arange(12) % 3
    fields = dict(train_x=torch.randn(12, 4), train_y=y, test_x=torch.randn(6, 4), test_y=y[:6], num_classes=3)
    return Dataset(**{**fields, **changes}, name="three")


BUILT = {
    "float_classes": (dict(num_classes=3.0), "num_classes is 3.0 (float); expected an integer"),
    "text_classes": (dict(num_classes="3"), "num_classes is '3' (str); expected an integer"),
    "too_few_classes": (
        dict(num_classes=2),
        "labels must lie in 0 .. num_classes - 1 with at least 2 classes; the train labels span 0 .. 2 for "
        "num_classes 2",
    ),
    "one_class": (
        dict(train_y=torch.zeros(12, dtype=torch.int64), test_y=torch.zeros(6, dtype=torch.int64), num_classes=1),
        "labels must lie in 0 .. num_classes - 1 with at least 2 classes; the train labels span 0 .. 0 for "
        "num_classes 1",
    ),
    "lengths_differ": (
        dict(train_y=torch.arange(10) % 3),
        "train_x has shape (12, 4) and train_y (10,); expected [N, ...] inputs and [N] labels, N > 0",
    ),
    "negative_label": (
        dict(test_y=torch.tensor([0, 1, 2, -1, 0, 1])),
        "labels must lie in 0 .. num_classes - 1 with at least 2 classes; the test labels span -1 .. 2 for "
        "num_classes 3",
    ),
    "empty_test": (
        dict(test_x=torch.zeros(0, 4), test_y=torch.zeros(0, dtype=torch.int64)),
        "test_x has shape (0, 4) and test_y (0,); expected [N, ...] inputs and [N] labels, N > 0",
    ),
    "client_ids_short": (
        dict(train_clients=torch.zeros(11, dtype=torch.int64), client_names=("a",)),
        "train_clients has shape (11,); expected one value per sample, (12,)",
    ),
}
for _name, (_changes, _) in BUILT.items():
    globals()[_name] = lambda changes=_changes: three_classes(**changes)

MODELS_BUILT = []


def recording_model(input_shape, num_classes):
    MODELS_BUILT.append(num_classes)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))


@pytest.mark.parametrize("function", list(BUILT))
def test_a_dataset_built_with_impossible_metadata_is_refused_before_the_model(tmp_path, capsys, function):
    code, err = cli(
        capsys, tmp_path, f"data.dataset=test_bad_metadata:{function}", "model=test_bad_metadata:recording_model"
    )
    assert code == 2, err
    assert err.splitlines() == [f"fedsim: error: data.dataset (test_bad_metadata:{function}): {BUILT[function][1]}"]
    assert MODELS_BUILT == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("classes", [10.0, "10", True, np.float64(10), torch.tensor(10.0)])
def test_from_tensors_refuses_a_num_classes_that_is_not_an_integer(classes):
    x, y = torch.randn(6, 2), torch.arange(6) % 3
    with pytest.raises(DataError, match=r"^data\.dataset \(tensors\): num_classes is .+; expected an integer$"):
        from_tensors(x, y, x, y, num_classes=classes)


@pytest.mark.parametrize("classes", [np.int64(4), np.array(4, dtype=np.int32), torch.tensor(4)])
def test_integers_of_numpy_and_torch_are_counts_of_classes(classes):
    x, y = torch.randn(6, 2), torch.arange(6) % 3
    for data in (from_tensors(x, y, x, y, num_classes=classes), load_dataset(three_classes(num_classes=classes), ".")):
        assert type(data.num_classes) is int and data.num_classes == 4


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
@pytest.mark.parametrize("classes, says", [(10.5, "10.5"), ("ten", "'ten'")])
def test_a_dataset_file_with_an_impossible_num_classes_is_refused_in_one_line(tmp_path, capsys, suffix, classes, says):
    path = tmp_path / f"mine{suffix}"
    y = np.arange(12) % 3
    arrays = {"train_x": np.ones((12, 4), np.float32), "train_y": y, "test_x": np.ones((3, 4), np.float32)}
    arrays |= {"test_y": y[:3], "num_classes": np.array(classes)}
    if suffix == ".npz":
        np.savez(path, **arrays)
    else:
        torch.save(
            {**{k: torch.as_tensor(v) for k, v in arrays.items() if k != "num_classes"}, "num_classes": classes}, path
        )
    code, err = cli(capsys, tmp_path, f"data.dataset={path}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"fedsim: error: data.dataset ({path}): num_classes is {says} ("), err
    assert err.endswith("; expected an integer\n"), err


def test_a_class_count_far_above_the_labels_whose_model_does_not_fit_is_named(tmp_path, capsys):
    """A dataset file that declares a billion classes for labels 0..9: the model's output layer
    cannot be allocated, and the one line says that num_classes is why, not only that memory ran out."""
    path = tmp_path / "billion.pt"
    x, y = torch.randn(40, 1, 28, 28), torch.arange(40) % 10
    torch.save({"train_x": x, "train_y": y, "test_x": x[:10], "test_y": y[:10], "num_classes": 10**9}, path)
    code, err = cli(capsys, tmp_path, f"data.dataset={path}", "data.limit=null", "model=mnist_cnn")
    assert code == 2, err
    assert err.splitlines() == [
        f"fedsim: error: data.dataset ({path}): num_classes is 1,000,000,000 but the labels present go up to 9; the "
        "model's output layer for so many classes does not fit in memory: set num_classes to the classes there are "
        "(or leave it out: 10 from the labels)"
    ]
