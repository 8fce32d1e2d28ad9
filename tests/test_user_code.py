"""Code the user brings (a rule, an algorithm, a model, a dataset function) that fails: the run
fails, in one line naming the component and the exception, and summary.json says so; an
OSError of theirs is theirs, not an output failure; sys.exit() in it is a failure too."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import yaml

import fedsim
from fedsim.cli import main

TINY = {
    "name": "own",
    "seed": 4,
    "device": "cpu",
    "rounds": 2,
    "workers": 0,
    "clients_per_round": 3,
    "data": {"dataset": "synthetic", "num_clients": 3, "limit": 900},
    "local": {"lr": 0.05, "batch_size": 32},
}


def rule_that_fails_on_real_updates(updates, weights):
    if updates.shape[1] > 3:  # passes the probe (3 values), then meets the model's
        raise OSError(5, "Input/output error", "/mnt/rules/table.bin")
    return updates.mean(0)


class UpdateFails(fedsim.Algorithm):
    def server_update(self, round, server, clients):
        raise ZeroDivisionError("the clients' weights sum to zero")


class FailsInEvaluation(torch.nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), num_classes))

    def forward(self, x):
        if not self.training and len(x) > 2:  # passes the probe's two inputs, then meets the test set
            raise ValueError("no kernel for this batch")
        return self.net(x)


def exits(input_shape, num_classes):
    sys.exit(3)


def nan_scores(input_shape, num_classes):
    layer = torch.nn.Linear(math.prod(input_shape), num_classes)
    torch.nn.init.constant_(layer.weight, math.nan)
    return torch.nn.Sequential(torch.nn.Flatten(), layer)


def missing_file():
    raise OSError(2, "No such file or directory", "/data/mine.npz")


def cli(capsys, tmp_path, *settings) -> tuple[int, str]:
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(TINY))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(config), "--out", str(tmp_path / "run"), *(a for s in settings for a in ("--set", s))])
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "aggregator=test_user_code:rule_that_fails_on_real_updates",
            "aggregator test_user_code:rule_that_fails_on_real_updates failed in round 1 (OSError: [Errno 5] "
            "Input/output error: '/mnt/rules/table.bin')",
        ),
        (
            "algorithm=test_user_code:UpdateFails",
            "algorithm test_user_code:UpdateFails: server_update failed in round 1 (ZeroDivisionError: the clients' "
            "weights sum to zero)",
        ),
        (
            "model=test_user_code:FailsInEvaluation",
            "model test_user_code:FailsInEvaluation failed in the evaluation of round 1 "
            "(ValueError: no kernel for this batch)",
        ),
        (
            "local.lr=1e30",  # every client's weights overflow
            "round 1: every client's update (3) is non-finite (NaN/Inf); nothing of this round was saved and no "
            "checkpoint was written; lower local.lr, or check the model's output",
        ),
    ],
    ids=["a rule's OSError", "server_update", "evaluation", "every update non-finite"],
)
def test_code_that_fails_during_the_run_fails_it_in_one_line(tmp_path, capsys, setting, message):
    code, err = cli(capsys, tmp_path, setting)
    lines = [line for line in err.splitlines() if not line.startswith("fedsim: warning")]
    assert code == 1 and lines == [f"fedsim: error: {message}"], err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == message and summary["rounds"] == 0


@pytest.mark.parametrize(
    "setting, message",
    [
        ("model=test_user_code:exits", "model: test_user_code:exits failed when it was built (it called sys.exit(3))"),
        (
            "model=test_user_code:nan_scores",
            "model: test_user_code:nan_scores returns non-finite class scores (NaN/Inf) for 2 inputs with its initial "
            "weights",
        ),
        (
            "data.dataset=test_user_code:missing_file",
            "data.dataset: test_user_code:missing_file failed (FileNotFoundError: [Errno 2] No such file or directory: "
            "'/data/mine.npz')",
        ),
    ],
    ids=["sys.exit in a model builder", "a model whose scores are NaN", "a dataset function's OSError"],
)
def test_code_that_fails_before_the_run_is_refused_in_one_line(tmp_path, capsys, setting, message):
    code, err = cli(capsys, tmp_path, setting)
    assert code == 2 and err.splitlines() == [f"fedsim: error: --set {message}"], err
    assert not (tmp_path / "run").exists()
