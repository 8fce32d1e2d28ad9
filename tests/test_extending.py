"""Your own model, rule, algorithm and dataset; callbacks, clients.csv, logging."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import fedsim
from fedsim.cli import main
from fedsim.core.errors import DataError, FedsimError
from fedsim.data import from_tensors

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


@pytest.mark.slow
def test_a_model_rule_algorithm_and_dataset_from_a_scripts_main_run_in_the_workers(tmp_path):
    # everything defined in __main__: the workers get the model and the algorithm by value
    script = tmp_path / "mine.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys
        import torch
        import fedsim
        from fedsim.data import from_tensors, load_dataset

        class Net(torch.nn.Module):  # 7,850 + 0 parameters: a logistic regression
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(784, 10)

            def forward(self, x):
                return self.fc(x.flatten(1))

        calls = []

        def clipped_mean(updates, weights, bound=10.0):
            calls.append(tuple(updates.shape))
            scale = (bound / updates.norm(dim=1)).clamp(max=1.0)
            return (scale[:, None] * updates).mean(dim=0)

        pre_calls = []

        def scaled(updates, weights, generator, factor=0.5):  # a pre-aggregator
            pre_calls.append(tuple(updates.shape))
            return factor * updates, weights

        class ServerStep(fedsim.Algorithm):  # FedAvg with a server step size
            def __init__(self, step):
                self.step = step

            def server_update(self, round, server, clients):
                return self.step * round.aggregate(round.updates, round.weights)

        if __name__ == "__main__":
            synthetic = load_dataset("synthetic", "unused")
            data = from_tensors(synthetic.train_x[:1200], synthetic.train_y[:1200], synthetic.test_x, synthetic.test_y,
                                name="my data")
            cfg = {"name": "mine", "seed": 1, "device": "cpu", "rounds": 3, "workers": 2, "clients_per_round": 4,
                   "data": {"num_clients": 4}, "local": {"lr": 0.1, "batch_size": 32}, "checkpoint_every": 1}
            out = sys.argv[1]
            steps = [{scaled: {"factor": 1.0}}]
            first = fedsim.run(cfg, out=out, quiet=True, rounds=2, model=Net, aggregator=clipped_mean,
                               algorithm=ServerStep(1.0), dataset=data, pre_aggregators=steps)
            # the pre-aggregator's name in config.yaml finds it in this __main__ again
            resumed = fedsim.resume(out, quiet=True, rounds=3, model=Net, aggregator=clipped_mean,
                                    algorithm=ServerStep(1.0), dataset=data)
            print(json.dumps({"accuracy": resumed.test_accuracy, "calls": calls, "pre_calls": pre_calls,
                              "params": len(torch.load(out + "/checkpoint.pt", weights_only=True)["global"])}))
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["params"] == 7850  # the workers trained Net
    # a probe on 3 values when each run is validated, then every round's 4 updates of 7,850 weights
    assert result["calls"] == result["pre_calls"] == [[4, 3], [4, 7850], [4, 7850], [4, 3], [4, 7850]]
    assert len(result["accuracy"]) == 3 and result["accuracy"][-1] > 0.3, result  # chance is 0.1
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "model: __main__:Net" in config and "aggregator: __main__:clipped_mean" in config
    assert "algorithm: __main__:ServerStep(step=1.0)" in config and "dataset: my data" in config
    assert "pre_aggregators:\n- __main__:scaled:\n    factor: 1.0\n" in config


@pytest.mark.slow
@pytest.mark.parametrize(
    "call",
    ["fedsim.run({config!r}, out='run', quiet=True)", "fedsim.sweep({config!r}, 'seed=1,2', out='sweep', quiet=True)"],
)
def test_a_script_without_the_main_guard_gets_one_line_naming_it(tmp_path, call):
    # every worker imports the script that started the run, and would run it again
    script = tmp_path / "unguarded.py"
    script.write_text(f"import fedsim\n\n{call.format(config=dict(TINY, workers=2))}\nprint('returned')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and "returned" not in done.stdout
    assert done.stderr.splitlines() == [
        "fedsim: error: this script calls fedsim.run (or resume, or sweep) outside an `if __name__ == "
        '"__main__":` block, so every worker process, which imports the script, '
        "would start the run again; put the call under that guard"
    ]


@pytest.mark.slow
def test_components_named_by_import_path_are_imported_in_every_process(tmp_path):
    (tmp_path / "mynets.py").write_text(
        textwrap.dedent("""
        import torch

        def build(input_shape, num_classes):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, num_classes))

        def median(updates, weights):
            return updates.median(dim=0).values

        def nothing_moves(updates, weights, generator, factor=1.0):
            return factor * updates, weights

        def wrong_shape(input_shape, num_classes):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 3))
    """)
    )
    np.savez(
        tmp_path / "tensors.npz",
        train_x=np.random.default_rng(0).normal(size=(300, 1, 28, 28)),
        train_y=np.arange(300) % 10,
        test_x=np.zeros((20, 1, 28, 28)),
        test_y=np.arange(20) % 10,
    )
    config = tmp_path / "exp.yaml"
    config.write_text(
        json.dumps(
            {
                **TINY,
                "model": "mynets:build",
                "aggregator": "mynets:median",
                "pre_aggregators": [{"mynets:nothing_moves": {"factor": 0.0}}],
                "workers": 2,
                "data": {"dataset": "tensors.npz", "num_clients": 3},
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "fedsim", "run", str(config), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert len(torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["global"]) == 784 * 32 + 32 + 330
    with open(tmp_path / "run" / "metrics.csv") as f:
        losses = [row["test_loss"] for row in csv.DictReader(f)]
    assert len(losses) == 2 and len(set(losses)) == 1  # every update scaled to 0: the model never moves

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsim",
            "run",
            str(config),
            "--out",
            str(tmp_path / "bad"),
            "--set",
            "model=mynets:wrong_shape",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "fedsim: error: --set model: mynets:wrong_shape returns shape (2, 3) "
        "(torch.float32) for 2 inputs; expected class scores of shape (2, 10)"
    )


def test_a_dataset_of_tensors_is_checked_in_one_line():
    x, y = torch.zeros(10, 4), torch.arange(10) % 2
    for bad, words in [
        ((x, y.float(), x, y), "train_y must hold integer class labels"),
        ((x, y[:5], x, y), "train_x has shape (10, 4) and train_y (5,)"),
        ((x, y, torch.zeros(3, 5), y[:3]), "train inputs (4,) and test inputs (5,) differ"),
        ((x, y - 1, x, y), "labels must lie in 0 .. num_classes - 1"),
        ((x * math.nan, y, x, y), "the inputs hold NaN or Inf"),
    ]:
        with pytest.raises(DataError) as info:
            from_tensors(*bad)
        assert words in str(info.value) and "\n" not in str(info.value)
    data = from_tensors(x.numpy(), y.numpy(), x, y)
    assert data.num_classes == 2 and data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64


class EventRecorder(fedsim.Callback):
    def __init__(self):
        self.events = []

    def on_run_start(self, run):
        self.events.append(("start", run.first_round, run.run_dir.name))

    def on_round_end(self, row, clients):
        self.events.append(("round", row["round"], len(clients)))

    def on_run_end(self, history):
        self.events.append(("end", len(history)))


@pytest.mark.slow
def test_a_callback_sees_every_round_and_clients_csv_has_every_trained_client(tmp_path):
    recorder = EventRecorder()
    history = fedsim.run(TINY, out=tmp_path / "run", quiet=True, rounds=3, eval_every=2, callbacks=[recorder])
    assert recorder.events == [("start", 1, "run"), ("round", 1, 3), ("round", 2, 3), ("round", 3, 3), ("end", 2)]
    records = fedsim.load_run(tmp_path / "run").client_records
    assert records == history.client_records and len(records) == 3 * 3
    assert [r["round"] for r in records] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert sorted({r["client"] for r in records}) == [0, 1, 2]
    assert all(r["samples"] == 300 and r["dropped"] == 0 and r["update_norm"] > 0 for r in records)
    for rnd in (2, 3):  # the round's train loss is the sample-weighted mean of its clients'
        mine = [r for r in records if r["round"] == rnd]
        row = next((r for r in history.rows if r["round"] == rnd), None)
        if row:
            assert row["train_loss"] == pytest.approx(sum(r["train_loss"] for r in mine) / 3, rel=1e-6)
    frame = history.to_pandas()
    assert list(frame["round"]) == [2, 3] and len(history.to_pandas(clients=True)) == 9

    recorder = EventRecorder()
    fedsim.resume(tmp_path / "run", quiet=True, rounds=4, callbacks=[recorder])
    assert recorder.events[0] == ("start", 4, "run") and recorder.events[1] == ("round", 4, 3)
    assert len(fedsim.load_run(tmp_path / "run").client_records) == 4 * 3


class CountsSteps(fedsim.Algorithm):
    """FedAvg whose clients report the steps they took, recorded in clients.csv."""

    recorded_reports = ("my_steps",)

    def report_shapes(self, num_params):
        return {"my_steps": (1,)}

    def client_report(self, result, local):
        return {"my_steps": result.steps.float()[:, None]}


@pytest.mark.slow
def test_an_algorithm_names_the_reports_clients_csv_records(tmp_path):
    history = fedsim.run(TINY, algorithm=CountsSteps(), out=tmp_path / "run", quiet=True, rounds=2)
    header = (tmp_path / "run" / "clients.csv").read_text().splitlines()[0]
    assert header.endswith(",staleness,my_steps")
    records = fedsim.load_run(tmp_path / "run").client_records
    assert records == history.client_records
    assert all(r["my_steps"] == r["steps"] > 0 for r in records)


def test_a_failing_callback_stops_the_run_in_one_line(tmp_path, capsys):
    class Broken(fedsim.Callback):
        def on_round_end(self, row, clients):
            raise ValueError("no room")

    with pytest.raises(FedsimError) as info:
        fedsim.run(TINY, out=tmp_path / "run", quiet=True, callbacks=[Broken()])
    assert str(info.value) == "callback Broken.on_round_end failed in round 1 (ValueError: no room)"


@pytest.mark.slow
def test_messages_go_through_logging(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a program that has not set up logging
    fedsim.run(TINY, out=tmp_path / "a", rounds=1, data={"alpha": 0.1})
    err = capsys.readouterr().err
    assert "fedsim: warning: data.alpha is 0.1 but data.partition iid does not use it" in err
    logger = logging.getLogger("fedsim")
    logger.setLevel(logging.ERROR)
    try:
        fedsim.run(TINY, out=tmp_path / "b", rounds=1, data={"alpha": 0.1})
    finally:
        logger.setLevel(logging.NOTSET)
    captured = capsys.readouterr()
    assert "warning" not in captured.err and "rounds of 3/3 clients" not in captured.out
    assert "round 1/1" in captured.out  # the round lines are not messages (quiet=True silences those)


@pytest.mark.slow
def test_tensorboard_writes_every_metric(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tmp_path / "exp.yaml"
    config.write_text(json.dumps(TINY))
    with pytest.raises(SystemExit) as info:
        main(["run", str(config), "--out", str(tmp_path / "run"), "--tensorboard", "--quiet"])
    assert info.value.code == 0
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert {"test_accuracy", "train_loss", "seconds"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("test_accuracy")] == [1, 2]
    assert {"clients/train_loss", "clients/update_norm"} <= set(events.Tags()["histograms"])
