"""fedsim sweep: the grid, seeds as repeats, the run names, the tables, real runs through the command
line, and the experiment files whose comments give sweep commands."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from matplotlib.collections import PolyCollection
from support import child_pids, documented_commands, start, wait_for_round, worker_pids

import fedsim
import fedsim.runs.launch
import fedsim.runs.parts
from fedsim.cli import main
from fedsim.core.errors import ConfigError, FedsimError
from fedsim.core.overrides import parse_grid
from fedsim.results.history import History
from fedsim.results.rundir import COLUMNS
from fedsim.runs.parts import check_run
from fedsim.runs.sweep import plan, sweep


@pytest.fixture
def config_file(small_config, tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(small_config))
    return path


def replace_engine(monkeypatch, start_run) -> list:
    """Runs made by ``start_run`` instead of the engine, without the checks a run makes before
    its workers start (tested with the engine below); returns the configs those checks got."""
    checked = []
    monkeypatch.setattr(fedsim.runs.launch, "start_run", start_run)
    monkeypatch.setattr(fedsim.runs.parts, "check_run", lambda cfg, datasets=None: checked.append(cfg))
    return checked


@pytest.fixture
def fake_runs(monkeypatch):
    """Replace the engine: each run 'reaches' an accuracy of seed / 10 in two rounds."""
    calls = []

    def start_run(cfg, out=None, overwrite=False, quiet=False, pools=None):
        calls.append((cfg, out))
        rows = [
            dict.fromkeys(COLUMNS, 0)
            | {"round": r, "test_accuracy": acc, "seconds": s, "elapsed_seconds": e, "test_perplexity": None}
            for r, acc, s, e in [(1, 0.5, 9.0, 9.0), (2, cfg.seed / 10, 2.0, 11.0)]
        ]
        return History(rows, cfg.to_dict(), out)

    replace_engine(monkeypatch, start_run)
    return calls


def timed_rows(rounds: dict[int, tuple[float, float]]) -> list[dict]:
    """metrics.csv rows of the evaluated rounds: round -> (its own seconds, elapsed seconds at its end)."""
    return [
        dict.fromkeys(COLUMNS, 0) | {"round": r, "seconds": s, "elapsed_seconds": e} for r, (s, e) in rounds.items()
    ]


def test_seconds_per_round_counts_the_rounds_eval_every_skips():
    from fedsim.runs.sweepruns import seconds_per_round

    # eval_every 5 over 10 rounds: rows 5 and 10; rounds 6..10 took 24.0 - 9.0 = 15 s in all, 3 s each,
    # though the scored rounds alone took 4 s (training and evaluation)
    assert seconds_per_round(History(timed_rows({5: (4.0, 9.0), 10: (4.0, 24.0)}))) == pytest.approx(3.0)
    # every round scored: all but the first (start-up), as the rows' own seconds give it
    every = {1: (5.0, 5.5), 2: (2.0, 7.5), 3: (3.0, 10.5)}
    assert seconds_per_round(History(timed_rows(every))) == pytest.approx((2.0 + 3.0) / 2)
    # one round scored, the last of 3 (eval_every past the rounds): its elapsed less start-up, over 3 rounds
    once = History(timed_rows({3: (2.5, 7.0)}), summary={"startup_seconds": 1.0})
    assert seconds_per_round(once) == pytest.approx((7.0 - 1.0) / 3)
    # a run of an older version, without elapsed seconds: its scored rounds' own, the first left out
    old = [row | {"elapsed_seconds": None} for row in timed_rows(every)]
    assert seconds_per_round(History(old)) == pytest.approx(2.5)


def test_a_bad_grid_value_is_named_as_the_grid_gave_it(tmp_path):
    config = tmp_path / "base.yaml"
    config.write_text("name: g\naggregator: trimmed_mean\n")
    with pytest.raises(
        ConfigError,
        match=r"^--grid aggregator=medain: unknown aggregator 'medain' "
        r"\(did you mean 'median'\?\)",
    ):
        plan(config, ["aggregator=median,medain"])
    with pytest.raises(ConfigError, match=r"^--grid aggregator_options.beta=0.7 \(aggregator_options\): beta must"):
        plan(config, ["aggregator_options.beta=0.1,0.7"])
    with pytest.raises(ConfigError, match=r"^--seeds -1: must be >= 0"):
        plan(config, ["aggregator=median"], seeds=[0, -1])
    with pytest.raises(ConfigError, match=r"^--set local.lr: must be > 0"):  # what --set gave stays --set
        plan(config, ["aggregator=median"], ["local.lr=0"])


def test_grid_values_are_split_on_commas():
    assert parse_grid(["aggregator=fedavg,median", "seed = 0, 1"]) == [
        ("aggregator", ["fedavg", "median"]),
        ("seed", ["0", "1"]),
    ]


@pytest.mark.parametrize(
    "spec,words",
    [("aggregator", "key=value1,value2"), ("seed=0,,1", "key=value1,value2"), ("=1,2", "key=value1,value2")],
)
def test_malformed_grid_is_refused(spec, words):
    with pytest.raises(ConfigError, match=words):
        parse_grid([spec])


def test_a_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["seed=0", "seed=1"])


def test_plan_is_the_cartesian_product_with_yaml_values_and_option_keys(config_file):
    runs = plan(config_file, ["aggregator_options.beta=0.1,0.2", "seed=0,1"], ["aggregator=trimmed_mean", "rounds=1"])
    assert [run.label for run in runs] == [
        "small-aggregator_options.beta=0.1-seed=0",
        "small-aggregator_options.beta=0.1-seed=1",
        "small-aggregator_options.beta=0.2-seed=0",
        "small-aggregator_options.beta=0.2-seed=1",
    ]
    assert [(run.config.aggregator_options["beta"], run.config.seed) for run in runs] == [
        (0.1, 0),
        (0.1, 1),
        (0.2, 0),
        (0.2, 1),
    ]
    assert all(run.config.rounds == 1 and run.config.name == run.label for run in runs)


def test_a_bad_value_fails_before_anything_runs(config_file, fake_runs, tmp_path):
    with pytest.raises(ConfigError, match="beta"):
        sweep(config_file, ["aggregator_options.beta=0.1,0.6"], ["aggregator=trimmed_mean"], out=tmp_path / "out")
    with pytest.raises(ConfigError, match="aggregator"):
        sweep(config_file, ["aggregator=median,no_such_rule"], out=tmp_path / "out")
    assert fake_runs == [] and not (tmp_path / "out").exists()


def test_sweep_runs_every_point_into_its_folder_and_tables_them(config_file, fake_runs, tmp_path):
    lines = []
    runs = sweep(config_file, ["aggregator=mean,median", "seed=6,7"], out=tmp_path / "out", log=lines.append)
    labels = [
        "small-aggregator=mean-seed=6",
        "small-aggregator=mean-seed=7",
        "small-aggregator=median-seed=6",
        "small-aggregator=median-seed=7",
    ]
    assert [out for _, out in fake_runs] == [tmp_path / "out" / label for label in labels]
    assert [cfg.aggregator for cfg, _ in fake_runs] == ["mean", "mean", "median", "median"]
    assert [run.history.final_accuracy for run in runs] == [0.6, 0.7, 0.6, 0.7]

    with open(tmp_path / "out" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["run"] for row in rows] == labels
    assert rows[1]["aggregator"] == "mean" and rows[1]["seed"] == "7"
    assert float(rows[1]["final_test_accuracy"]) == 0.7 and float(rows[1]["best_test_accuracy"]) == 0.7
    assert float(rows[1]["seconds_per_round"]) == 2.0  # the first round (start-up) is left out

    table = lines[-2].splitlines()
    assert table[0].split() == ["run", "final", "acc", "best", "acc", "s/round"]
    assert table[2].split() == ["small-aggregator=mean-seed=7", "0.7000", "0.7000", "2.00"]


def test_a_ctrl_c_in_the_python_call_says_how_to_continue_it_and_still_stops(
    config_file, fake_runs, tmp_path, monkeypatch
):
    """Where the sweep's lines go, as the command says it on stderr; the KeyboardInterrupt goes on."""
    lines = []

    def log_until(line: str) -> None:
        lines.append(line)
        if line.startswith("[2/"):
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        sweep(config_file, ["seed=1,2,3"], out=out, log=log_until)
    assert lines[-1] == (
        f"sweep interrupted; 1 of 3 runs finished, tabled in {out / 'sweep.csv'}; "
        "call fedsim.sweep again with the same arguments to continue it"
    )
    monkeypatch.chdir(tmp_path)  # no out: the sweep's own directory is named
    lines.clear()
    with pytest.raises(KeyboardInterrupt):
        sweep(config_file, ["seed=2,3"], log=log_until)
    root = Path(lines[0].removeprefix("sweep of 2 runs into "))
    assert lines[-1] == (
        f"sweep interrupted; 1 of 2 runs finished, tabled in {root / 'sweep.csv'}; "
        f"call fedsim.sweep again with out={str(root)!r} to continue it"
    )


def for_colour_images():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 30 * 30, 10))


@pytest.mark.slow
def test_every_combination_is_checked_whole_before_the_first_run(config_file, fake_runs, monkeypatch, tmp_path):
    checked = []
    monkeypatch.setattr(
        fedsim.runs.parts, "check_run", lambda cfg, datasets=None: (checked.append(cfg), check_run(cfg, datasets))
    )
    with pytest.raises(FedsimError) as info:  # the data holds fewer samples than the second run's limit
        sweep(config_file, ["data.limit=200,100000000"], out=tmp_path / "out")
    assert str(info.value).startswith("--grid data.limit=100000000: 100000000 is more than the ")
    with pytest.raises(ConfigError) as info:  # a model for 3 x 32 x 32 images, on 1 x 28 x 28
        sweep(config_file, ["model=mnist_cnn,test_sweep:for_colour_images"], out=tmp_path / "out")
    assert str(info.value).startswith(
        "--grid model=test_sweep:for_colour_images: test_sweep:for_colour_images fails on a batch of inputs of "
        "shape (1, 28, 28)"
    )
    assert [cfg.name for cfg in checked] == [
        "small-data.limit=200",
        "small-data.limit=100000000",
        "small-model=mnist_cnn",
        "small-model=test_sweep_for_colour_images",
    ]
    assert fake_runs == [] and not (tmp_path / "out").exists()


def test_another_sweep_in_the_directory_of_one_is_refused(config_file, fake_runs, tmp_path, capsys):
    sweep(config_file, ["aggregator=mean,median"], out=tmp_path / "out", log=lambda line: None)
    with pytest.raises(FedsimError) as info:
        sweep(config_file, ["aggregator=mean,median"], ["local.lr=0.5"], out=tmp_path / "out")
    difference = (
        f"holds another sweep (its run small-aggregator=mean has "
        f"local.lr: {yaml.safe_load(config_file.read_text())['local']['lr']!r}, this one 0.5)"
    )
    assert str(info.value) == (  # in fedsim.sweep's own words
        f"out {tmp_path / 'out'}: {difference}; call fedsim.sweep with the arguments that started it to "
        f"continue it, overwrite=True to replace it, or another out"
    )
    command = ["sweep", str(config_file), "--grid", "aggregator=mean,median", "--set", "local.lr=0.5"]
    with pytest.raises(SystemExit):
        main([*command, "--out", str(tmp_path / "out")])
    assert (
        f"--out {tmp_path / 'out'}: {difference}; give the command that started it to continue it, "
        f"--overwrite to replace it, or another --out"
    ) in capsys.readouterr().err
    sweep(
        config_file,
        ["aggregator=mean,median"],
        ["local.lr=0.5"],
        out=tmp_path / "out",
        overwrite=True,
        log=lambda line: None,
    )
    assert len(fake_runs) == 4


def test_a_sweep_recorded_before_a_key_was_added_is_the_same_sweep(config_file, fake_runs, tmp_path):
    """sweep.json from a fedsim without data.seed: its runs ran as the key's default does, so the
    same command goes on in the directory; a value recorded otherwise is still another sweep."""
    out, lines = tmp_path / "out", []
    sweep(config_file, ["aggregator=mean,median"], out=out, log=lambda line: None)
    recorded = json.loads((out / "sweep.json").read_text())

    def recorded_as(change) -> None:
        runs = {
            label: yaml.safe_dump(change(yaml.safe_load(text)), sort_keys=True)
            for label, text in recorded["runs"].items()
        }
        (out / "sweep.json").write_text(json.dumps({"runs": runs}))

    recorded_as(lambda keys: {k: v for k, v in keys.items() if k != "data.seed"})
    sweep(config_file, ["aggregator=mean,median"], out=out, log=lines.append)
    assert lines[0] == f"sweep of 2 runs into {out}" and len(fake_runs) == 4  # fake runs leave no files to keep
    recorded_as(lambda keys: {k: v for k, v in keys.items() if k != "data.seed"} | {"data.partition": "shards"})
    with pytest.raises(FedsimError, match="its run small-aggregator=mean has data.partition: 'shards', this one"):
        sweep(config_file, ["aggregator=mean,median"], out=out)


@pytest.mark.slow
def test_an_interrupted_sweep_continues_where_it_stopped(tmp_path):
    """Ctrl-C during the first run, again during the second, then to the end: each time the same
    command continues, sweep.csv lists the finished runs only, and the message names only files
    that are there."""
    tiny = {
        "name": "tiny",
        "device": "cpu",
        "rounds": 8,
        "workers": 0,
        "clients_per_round": 2,
        "model": "mnist_2nn",
        "data": {"dataset": "synthetic", "num_clients": 4, "limit": 400},
        "local": {"batch_size": 50},
    }
    config, out = tmp_path / "tiny.yaml", tmp_path / "sweep"
    config.write_text(yaml.safe_dump(tiny))
    command = ["sweep", str(config), "--grid", "seed=1,2,3", "--out", str(out)]
    again = "run the same command again to continue it"

    def interrupted_in(run: int) -> tuple[str, str]:
        proc = start(command, uuid.uuid4().hex)
        seen = []
        while not any(f"[{run}/3]" in line for line in seen):  # the run's first line
            seen.append(proc.stdout.readline())
            assert seen[-1], seen
        seen += wait_for_round(proc, 2)
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        return "".join(seen) + stdout, err

    _, err = interrupted_in(1)
    assert err.splitlines() == [f"fedsim: sweep interrupted before any run finished; {again}"]
    assert not (out / "sweep.csv").exists()
    stdout, err = interrupted_in(2)
    assert f"continuing the sweep in {out}: 0 of 3 runs finished" in stdout
    assert "[1/3] tiny-seed=1 (resuming from its checkpoint)" in stdout
    assert err.splitlines() == [
        f"fedsim: sweep interrupted; 1 of 3 runs finished, tabled in {out / 'sweep.csv'}; {again}"
    ]
    assert [row["run"] for row in _rows(out / "sweep.csv")] == ["tiny-seed=1"]
    first = (out / "tiny-seed=1" / "metrics.csv").read_bytes()
    lines = []  # the same sweep once more, from Python this time
    sweep(config, ["seed=1,2,3"], out=out, quiet=True, log=lines.append)
    assert (
        lines[:2]
        == [f"continuing the sweep in {out}: 1 of 3 runs finished", "[2/3] tiny-seed=2 (resuming from its checkpoint)"]
        and lines[2] == "[3/3] tiny-seed=3"
    )
    assert (out / "tiny-seed=1" / "metrics.csv").read_bytes() == first
    assert [(row["run"], row["rounds"]) for row in _rows(out / "sweep.csv")] == [
        ("tiny-seed=1", "8"),
        ("tiny-seed=2", "8"),
        ("tiny-seed=3", "8"),
    ]
    whole = fedsim.run(tiny, seed=2, out=tmp_path / "whole", quiet=True)  # the resumed run, never interrupted
    assert fedsim.load_run(out / "tiny-seed=2").test_accuracy == whole.test_accuracy


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_command_runs_a_real_sweep(config_file, tmp_path):
    out = tmp_path / "sweep"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsim",
            "sweep",
            str(config_file),
            "--grid",
            "aggregator=geometric_median",
            "--set",
            "rounds=1",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert result.returncode == 0, result.stderr
    label = "small-aggregator=geometric_median"
    assert label in result.stdout and "final acc" in result.stdout
    with open(out / label / "metrics.csv") as f:
        assert [row["round"] for row in csv.DictReader(f)] == ["1"]
    with open(out / "sweep.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["run"] == label and 0 <= float(row["final_test_accuracy"]) <= 1


@pytest.mark.slow
def test_the_runs_of_a_sweep_share_one_pool_of_workers(tmp_path, monkeypatch):
    """Runs with the same device and workers take the pool the run before left, whatever their
    model; and they compute what each run computes on its own (bit for bit on a CPU)."""
    config = tmp_path / "base.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "shared",
                "seed": 2,
                "device": "cpu",
                "rounds": 2,
                "workers": 2,
                "clients_per_round": 2,
                "data": {"dataset": "synthetic", "limit": 600, "num_clients": 4},
            }
        )
    )
    seen = []  # the live worker processes, at the end of every round of every run

    class Workers:
        def on_round_end(self, row, clients):
            seen.append(sorted(worker_pids(child_pids())))

    real = fedsim.runs.launch.start_run
    monkeypatch.setattr(fedsim.runs.launch, "start_run", lambda *a, **k: real(*a, callbacks=[Workers()], **k))
    runs = sweep(
        config, ["model=mnist_cnn,mnist_2nn", "seed=2,3"], out=tmp_path / "sweep", quiet=True, log=lambda line: None
    )
    assert len(seen) == 2 * len(runs) == 8
    assert len(seen[0]) == 2 and all(pids == seen[0] for pids in seen)  # one pool of two workers for all
    assert child_pids() == []  # and the sweep stopped it
    monkeypatch.undo()
    for run in runs:
        alone = fedsim.run(run.config, out=tmp_path / "alone" / run.label, quiet=True)
        assert alone.test_accuracy == run.history.test_accuracy and alone.train_loss == run.history.train_loss


@pytest.mark.slow
def test_the_command_needs_a_grid(config_file):
    result = subprocess.run(
        [sys.executable, "-m", "fedsim", "sweep", str(config_file)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert result.returncode == 2 and "--grid" in result.stderr


# ----------------------------------------------------------------------------- seeds as repeats


def sample_sd(values):
    """The sample standard deviation, written out (not statistics.stdev, which the code uses)."""
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def test_seeds_repeat_every_point_under_one_name(config_file):
    runs = plan(config_file, ["aggregator=mean,median"], ["rounds=1"], seeds="0, 1,2")
    assert [run.label for run in runs] == [
        f"small-aggregator={rule}-seed={seed}" for rule in ("mean", "median") for seed in (0, 1, 2)
    ]
    assert [(run.config.aggregator, run.config.seed, run.seed) for run in runs[:4]] == [
        ("mean", 0, 0),
        ("mean", 1, 1),
        ("mean", 2, 2),
        ("median", 0, 0),
    ]
    # the seeds of a point share its name, so plots and results tables pool them
    assert {run.config.name for run in runs[:3]} == {run.configuration for run in runs[:3]} == {"small-aggregator=mean"}
    assert all(run.point == [("aggregator", run.config.aggregator)] for run in runs)

    alone = plan(config_file, [], seeds=[4, 5])
    assert [(run.label, run.config.name, run.config.seed) for run in alone] == [
        ("small-seed=4", "small", 4),
        ("small-seed=5", "small", 5),
    ]


@pytest.mark.parametrize(
    "grid, seeds, words",
    [
        (["seed=0,1"], "2,3", "--seeds and --grid seed"),
        ([], "0,x", "expected integers"),
        ([], "1,2,1", "listed twice"),
        ([], "0,-1", "seed"),  # the config's own check: seeds are >= 0
        ([], 3, r"^seeds: expected a list of integers or a string such as 0,1,2, got int 3$"),  # as the call names it
        ([], {0: 1}, "^seeds: expected a list of integers"),
        ([], [0.5], r"^seeds \[0.5\]: expected integers"),
    ],
)
def test_bad_seeds_are_refused_before_anything_runs(config_file, fake_runs, tmp_path, grid, seeds, words):
    with pytest.raises(ConfigError, match=words):
        sweep(config_file, grid, seeds=seeds, out=tmp_path / "out")
    assert fake_runs == [] and not (tmp_path / "out").exists()


def test_numpy_seeds_are_seeds(config_file):
    import numpy as np

    assert [run.config.seed for run in plan(config_file, [], seeds=np.arange(2))] == [0, 1]


def test_the_file_s_seeds_are_named_as_the_file_s(config_file):
    config_file.write_text(config_file.read_text() + "sweep: {seeds: 3}\n")
    with pytest.raises(ConfigError, match=rf"^{config_file}: sweep.seeds: expected a list of integers"):
        plan(config_file, [])
    config_file.write_text(config_file.read_text().replace("{seeds: 3}", "{seeds: [0.5]}"))
    with pytest.raises(ConfigError, match=rf"^{config_file}: sweep.seeds \[0.5\]: expected integers"):
        plan(config_file, [])


@pytest.mark.parametrize(
    "arguments, words",
    [
        (
            {"grid": {"aggregator": ["mean"]}},
            r"^grid: expected a list of strings such as \['aggregator=fedavg,median'\], got dict",
        ),
        ({"grid": None}, "^grid: expected a list of strings"),
        ({"grid": [("aggregator", "mean")]}, "^grid: expected a list of strings"),
        (
            {"grid": ["aggregator=mean"], "overrides": {"rounds": 1}},
            r"^overrides: expected a list of strings such as \['rounds=20'\], got dict",
        ),
        ({"grid": ["aggregator=mean"], "config": 5}, "^config: expected an experiment file, .*, got int 5$"),
        ({"grid": ["aggregator=mean"], "config": None}, "^config: expected an experiment file"),
    ],
)
def test_the_python_call_names_an_argument_of_a_wrong_type(config_file, fake_runs, tmp_path, arguments, words):
    arguments = {"config": config_file, **arguments}
    with pytest.raises(ConfigError, match=words):
        sweep(arguments.pop("config"), out=tmp_path / "out", **arguments)
    assert fake_runs == [] and not (tmp_path / "out").exists()


def test_the_python_call_takes_one_string_as_one_flag_and_a_pivot_as_a_pair(config_file, fake_runs, tmp_path):
    runs = sweep(config_file, "aggregator=mean,median", "local.lr=0.5", out=tmp_path / "one", log=lambda line: None)
    assert [(run.config.aggregator, run.config.local.lr) for run in runs] == [("mean", 0.5), ("median", 0.5)]
    grid = ["aggregator=mean,median", "local.momentum=0,0.5"]
    sweep(config_file, grid, pivot=("aggregator", "local.momentum"), out=tmp_path / "two", log=lambda line: None)
    assert (tmp_path / "two" / "pivot.csv").is_file()


def test_overwrite_replaces_the_runs_and_tables_an_earlier_sweep_or_run_left(config_file, fake_runs, tmp_path):
    out = tmp_path / "out"
    sweep(config_file, ["aggregator=mean,median"], out=out, log=lambda line: None)
    for run in ("small-aggregator=mean", "small-aggregator=median"):  # as the engine leaves them
        (out / run).mkdir(exist_ok=True)
        (out / run / "config.yaml").write_text("name: small\n")
    (out / "notes.txt").write_text("mine")
    (out / "metrics.csv").write_text("round\n")  # a run's own file, left there earlier
    sweep(config_file, ["aggregator=trimmed_mean"], out=out, overwrite=True, log=lambda line: None)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sweep.csv", "sweep.json"]  # runs: fake_runs'
    assert "small-aggregator=mean" not in (out / "sweep.csv").read_text()


def test_files_missing_whatever_the_point_are_the_sweep_s_not_a_grid_value_s(config_file, tmp_path):
    from fedsim.core.errors import DataError
    from fedsim.runs.sweep import prepare

    nowhere = ["data.dataset=mnist", "data.download=false", f"data.root={tmp_path / 'nowhere'}"]
    with pytest.raises(DataError) as info:
        prepare(config_file, ["aggregator=mean,median"], nowhere, out=tmp_path / "out")
    assert info.value.missing and str(info.value).startswith("--set data.root: no MNIST files")
    with pytest.raises(DataError, match=r"^--grid data.dataset=mnist: "):  # the grid chose the data
        prepare(config_file, ["data.dataset=mnist"], nowhere[1:], out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_configuration_the_grid_replaces_in_every_run_need_not_be_valid_alone(config_file, fake_runs, tmp_path):
    # more clients a round than the file has clients: no run of the sweep uses that value
    runs = sweep(config_file, ["clients_per_round=2,4"], ["clients_per_round=100"], out=tmp_path / "out", log=print)
    assert [run.config.clients_per_round for run in runs] == [2, 4] and len(fake_runs) == 2
    with pytest.raises(ConfigError, match="clients_per_round: must be <= data.num_clients"):  # runs that use it
        sweep(config_file, ["local.lr=0.1,0.2"], ["clients_per_round=100"], out=tmp_path / "other")


def test_a_bad_target_is_refused(config_file, fake_runs, tmp_path, capsys):
    for target in (0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="^target: must be a test accuracy"):
            sweep(config_file, [], seeds=[0], target=target, out=tmp_path / "out")
    with pytest.raises(SystemExit):
        main(["sweep", str(config_file), "--seeds", "0", "--target", "1.5", "--out", str(tmp_path / "out")])
    assert "--target: must be a test accuracy, a fraction in (0, 1], got 1.5" in capsys.readouterr().err
    assert fake_runs == []


# Test accuracy per round of each (aggregator, seed): the fake engine below returns these.
CURVES = {
    ("mean", 0): [0.2, 0.5, 0.8],
    ("mean", 1): [0.3, 0.7, 0.75],
    ("mean", 2): [0.1, 0.3, 0.6],
    ("median", 0): [0.1, 0.2, 0.3],
    ("median", 1): [0.2, 0.4, 0.2],
    ("median", 2): [0.1, 0.1, 0.25],
}


@pytest.fixture
def curve_runs(monkeypatch):
    def start_run(cfg, out=None, overwrite=False, quiet=False, pools=None):
        rows = [
            dict.fromkeys(COLUMNS, 0)
            | {
                "round": r,
                "test_accuracy": acc,
                "seconds": 1.0 + cfg.seed,
                "elapsed_seconds": r * (1.0 + cfg.seed),
                "test_perplexity": None,
            }
            for r, acc in enumerate(CURVES[cfg.aggregator, cfg.seed], start=1)
        ]
        return History(rows, cfg.to_dict(), out)

    replace_engine(monkeypatch, start_run)


@pytest.mark.parametrize("how", [{"target": 0.7}, {"overrides": ["stop_at_accuracy=0.7"]}])
def test_seeds_table_gives_mean_sd_and_rounds_to_target_per_configuration(config_file, curve_runs, tmp_path, how):
    lines = []
    sweep(
        config_file,
        ["aggregator=mean,median"],
        how.get("overrides", []),
        seeds="0,1,2",
        target=how.get("target"),
        out=tmp_path / "out",
        log=lines.append,
    )

    with open(tmp_path / "out" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["configuration"] for row in rows] == ["small-aggregator=mean", "small-aggregator=median"]
    for row, rule in zip(rows, ("mean", "median")):
        finals = [CURVES[rule, s][-1] for s in range(3)]
        bests = [max(CURVES[rule, s]) for s in range(3)]
        assert row["aggregator"] == rule and row["seeds"] == "0 1 2" and row["runs"] == "3"
        assert float(row["final_test_accuracy"]) == pytest.approx(sum(finals) / 3)
        assert float(row["final_test_accuracy_std"]) == pytest.approx(sample_sd(finals))
        assert float(row["best_test_accuracy"]) == pytest.approx(sum(bests) / 3)
        assert float(row["best_test_accuracy_std"]) == pytest.approx(sample_sd(bests))
        assert float(row["target"]) == 0.7
        assert float(row["seconds_per_round"]) == pytest.approx(2.0)  # seeds 0, 1, 2: 1, 2 and 3 s a round
    # mean: seed 0 first reaches 0.7 in round 3, seed 1 in round 2, seed 2 never
    assert (rows[0]["rounds_to_target"], rows[0]["reached_target"]) == ("2.5", "2")
    assert float(rows[0]["rounds_to_target_std"]) == pytest.approx(sample_sd([3, 2]))
    assert (rows[1]["rounds_to_target"], rows[1]["rounds_to_target_std"], rows[1]["reached_target"]) == ("", "", "0")

    with open(tmp_path / "out" / "runs.csv") as f:  # and one row per run beside it
        per_run = list(csv.DictReader(f))
    assert [(r["run"], r["seed"], r["rounds_to_target"]) for r in per_run[:3]] == [
        ("small-aggregator=mean-seed=0", "0", "3"),
        ("small-aggregator=mean-seed=1", "1", "2"),
        ("small-aggregator=mean-seed=2", "2", ""),
    ]

    table = lines[-2].splitlines()
    assert table[0].split() == [
        "configuration",
        "seeds",
        "final",
        "acc",
        "best",
        "acc",
        "rounds",
        "to",
        "0.7",
        "s/round",
    ]
    finals = [CURVES["mean", s][-1] for s in range(3)]
    assert table[1].split() == [
        "small-aggregator=mean",
        "3",
        f"{sum(finals) / 3:.4f}",
        "±",
        f"{sample_sd(finals):.4f}",
        f"{(0.8 + 0.75 + 0.6) / 3:.4f}",
        "±",
        f"{sample_sd([0.8, 0.75, 0.6]):.4f}",
        "2.5",
        "±",
        f"{sample_sd([3, 2]):.1f}",
        "(2/3)",
        "2.00",
    ]
    assert table[2].split()[-3:] == ["–", "(0/3)", "2.00"]
    assert lines[-1].endswith(f"runs, sweep.csv and runs.csv in {tmp_path / 'out'}")


def test_without_seeds_a_target_adds_rounds_to_the_per_run_table(config_file, curve_runs, tmp_path):
    lines = []
    sweep(config_file, ["aggregator=mean", "seed=0,2"], target=0.7, out=tmp_path / "out", log=lines.append)
    table = lines[-2].splitlines()
    assert table[0].split() == ["run", "final", "acc", "best", "acc", "rounds", "to", "0.7", "s/round"]
    assert table[1].split() == ["small-aggregator=mean-seed=0", "0.8000", "0.8000", "3", "1.00"]
    assert table[2].split() == ["small-aggregator=mean-seed=2", "0.6000", "0.6000", "not", "reached", "3.00"]
    with open(tmp_path / "out" / "sweep.csv") as f:
        assert [(r["run"], r["target"], r["rounds_to_target"]) for r in csv.DictReader(f)] == [
            ("small-aggregator=mean-seed=0", "0.7", "3"),
            ("small-aggregator=mean-seed=2", "0.7", ""),
        ]
    assert not (tmp_path / "out" / "runs.csv").exists()


@pytest.mark.slow
def test_the_command_repeats_over_seeds_and_plots_them_as_one_band(config_file, tmp_path):
    """A real sweep --seeds, in-process training (workers: 0) on generated data: the directories,
    the grouped table and sweep.csv (checked against the runs' own metrics.csv), and fedsim plot
    and results_table on its output, which pool the seeds of a configuration."""
    out = tmp_path / "sweep"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsim",
            "sweep",
            str(config_file),
            "--seeds",
            "0,1",
            "--target",
            "0.15",
            "--set",
            "rounds=2",
            "--set",
            "workers=0",
            "--set",
            "data.limit=800",
            "--set",
            "model=simple_cnn",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "runs.csv",
        "small-seed=0",
        "small-seed=1",
        "sweep.csv",
        "sweep.json",
    ]

    histories = [fedsim.load_run(out / f"small-seed={seed}") for seed in (0, 1)]
    assert [h.config["seed"] for h in histories] == [0, 1] and {h.name for h in histories} == {"small"}
    finals = [h.test_accuracy[-1] for h in histories]
    reached = [next((r["round"] for r in h.rows if r["test_accuracy"] >= 0.15), None) for h in histories]
    reached = [r for r in reached if r is not None]

    with open(out / "sweep.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["configuration"] == "small" and row["seeds"] == "0 1" and row["runs"] == "2"
    assert float(row["final_test_accuracy"]) == pytest.approx(sum(finals) / 2)
    assert float(row["final_test_accuracy_std"]) == pytest.approx(sample_sd(finals))
    assert int(row["reached_target"]) == len(reached)
    if reached:
        assert float(row["rounds_to_target"]) == pytest.approx(sum(reached) / len(reached))

    header, line = result.stdout.splitlines()[-3:-1]
    assert header.split()[:2] == ["configuration", "seeds"] and "rounds to 0.15" in header
    assert line.split()[:5] == ["small", "2", f"{sum(finals) / 2:.4f}", "±", f"{sample_sd(finals):.4f}"]
    assert line.split()[-2] == f"({len(reached)}/2)"

    fig = fedsim.plot_runs(str(out / "small-seed=*"))
    (ax,) = fig.axes
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(ax.lines) == 1 and len(bands) == 1  # one mean line, one min-max band over the two seeds
    assert list(ax.lines[0].get_ydata()) == pytest.approx(
        [100 * (a + b) / 2 for a, b in zip(*(h.test_accuracy for h in histories))]
    )
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["small", "min–max over 2 seeds"]

    (pooled,) = fedsim.results_table(histories)
    assert pooled["runs"] == 2 and pooled["final_accuracy"] == pytest.approx(sum(finals) / 2)


# ----------------------------------------------------------------------------- experiment files

NIID_BENCH = sorted(Path("experiments/niid_bench").glob("*.yaml"))


def test_niid_bench_files_keep_the_paper_setting_and_their_sweep_plans():
    assert [p.name for p in NIID_BENCH] == [
        "fmnist_dirichlet.yaml",
        "fmnist_one_class.yaml",
        "mnist_dirichlet.yaml",
        "mnist_one_class.yaml",
    ]
    from fedsim.algorithms.fedprox import FedProx
    from fedsim.cli import build_parser

    assert FedProx().mu == 0.01  # the files rely on it: NIID-Bench's mu
    for path in NIID_BENCH:
        text = path.read_text()
        assert text.startswith("# NIID-Bench") and "Li, Diao, Chen, He" in text and "ICDE 2022" in text
        cfg = fedsim.load_config(path)
        assert (cfg.rounds, cfg.clients_per_round, cfg.data.num_clients, cfg.model, cfg.algorithm) == (
            50,
            10,
            10,
            "simple_cnn",
            "fedavg",
        )
        assert (cfg.local.epochs, cfg.local.batch_size, cfg.local.lr, cfg.local.momentum, cfg.local.weight_decay) == (
            10,
            64,
            0.01,
            0.9,
            1e-5,
        )
        assert cfg.data.dataset == ("mnist" if path.name.startswith("mnist") else "fashion_mnist")
        if "dirichlet" in path.name:
            assert (cfg.data.partition, cfg.data.alpha, cfg.data.min_samples, cfg.data.balanced) == (
                "dirichlet",
                0.5,
                10,
                True,
            )
        else:
            assert (cfg.data.partition, cfg.data.classes_per_client) == ("label_k", 1)

        commands = documented_commands(path)
        assert [c[:2] for c in commands] == [["fedsim", "sweep"], ["fedsim", "run"]]
        args = build_parser().parse_args(commands[0][1:])
        runs = plan(args.config, args.grid, args.set, args.seeds)
        assert [(r.config.algorithm, r.seed) for r in runs] == [
            (a, s) for a in ("fedavg", "fedprox", "scaffold", "fednova") for s in (0, 1, 2)
        ]
        assert {r.config.aggregator for r in runs} == {"fedavg"}  # NIID-Bench's, SCAFFOLD's too
        fedprox = build_parser().parse_args(commands[1][1:])
        assert fedsim.load_config(fedprox.config, fedprox.set).algorithm_options == {"mu": 0.01}


def test_every_file_that_names_niid_bench_splits_as_niid_bench():
    named = [p for p in sorted(Path("experiments").rglob("*.yaml")) if "NIID-Bench" in p.read_text()]
    assert len(named) == 6  # the four NIID-Bench files, cifar10_dirichlet and moon
    for path in named:
        cfg = fedsim.load_config(path)
        if cfg.data.partition == "dirichlet":
            assert cfg.data.balanced and cfg.data.min_samples == 10, path


def test_seed_article_file_is_the_articles_run_as_fedavg():
    from fedsim.cli import build_parser

    path = Path("experiments/seed_article.yaml")
    text = path.read_text()
    assert text.startswith("# ") and "93.2 %" in text and "Hogwild" in text and "97 / 98 / 98 %" in text
    modes = []
    for command in documented_commands(path):  # the commands the comment gives, each a valid run
        args = build_parser().parse_args(command[1:])
        modes.append(fedsim.load_config(args.config, args.set).mode)
    assert modes == ["sync", "hogwild", "hogwild"]
    cfg = fedsim.load_config(path)
    assert (cfg.rounds, cfg.workers, cfg.clients_per_round, cfg.model, cfg.algorithm) == (
        3,
        4,
        4,
        "mnist_cnn",
        "fedavg",
    )
    assert (cfg.data.dataset, cfg.data.partition, cfg.data.num_clients) == ("mnist", "contiguous", 4)
    assert (cfg.local.epochs, cfg.local.batch_size, cfg.local.lr, cfg.local.momentum) == (1, 64, 0.01, 0.5)


def test_a_sweep_of_private_runs_tables_the_epsilon_they_spent(config_file, monkeypatch, tmp_path):
    """The column is there once a run has a privacy section: its last row's epsilon (over seeds,
    the mean, which is the same value unless a run stopped early)."""

    def start_run(cfg, out=None, overwrite=False, quiet=False, pools=None):
        z = cfg.privacy.noise_multiplier
        rows = [
            dict.fromkeys(COLUMNS, 0)
            | {"round": r, "test_accuracy": 0.5, "seconds": 1.0, "epsilon": r / z, "test_perplexity": None}
            for r in (1, 2)
        ]
        return History(rows, cfg.to_dict(), out)

    replace_engine(monkeypatch, start_run)
    lines = []
    sweep(
        config_file,
        ["privacy.noise_multiplier=0.5,4"],
        ["privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.delta=1e-5", "client_sampling=poisson"],
        out=tmp_path / "out",
        log=lines.append,
    )
    table = lines[-2].splitlines()
    assert table[0].split() == ["run", "final", "acc", "best", "acc", "epsilon", "s/round"]
    assert [row.split()[-2] for row in table[1:]] == ["4", "0.5"]
    with open(tmp_path / "out" / "sweep.csv") as f:
        assert [float(r["epsilon"]) for r in csv.DictReader(f)] == [4.0, 0.5]


# final accuracy of each (aggregator, attack, seed), as the fake engine below returns it
PIVOT = {
    ("median", "ipm", 0): 0.8,
    ("median", "ipm", 1): 0.6,
    ("median", "alie", 0): 0.5,
    ("median", "alie", 1): 0.3,
    ("mean", "ipm", 0): 0.2,
    ("mean", "ipm", 1): 0.4,
    ("mean", "alie", 0): 0.9,
    ("mean", "alie", 1): 0.7,
}


def test_a_pivot_puts_one_grid_key_down_and_another_across_with_the_worst(config_file, monkeypatch, tmp_path):
    def start_run(cfg, out=None, overwrite=False, quiet=False, pools=None):
        accuracy = PIVOT[cfg.aggregator, cfg.attack.type, cfg.seed] + cfg.attack.count / 100
        row = dict.fromkeys(COLUMNS, 0) | {"round": 1, "test_accuracy": accuracy, "seconds": 1.0}
        return History([row | {"test_perplexity": None}], cfg.to_dict(), out)

    replace_engine(monkeypatch, start_run)
    grid = ["aggregator=median,mean", "attack.type=ipm,alie", "attack.count=1,2"]
    lines = []
    sweep(config_file, grid, seeds="0,1", out=tmp_path / "out", log=lines.append, pivot="aggregator,attack.type")
    blocks = lines[-2].split("\n\n")
    assert len(blocks) == 2  # one per attack.count
    first = blocks[0].splitlines()
    assert first[0] == "final test accuracy, attack.count=1"
    assert first[1].split() == ["aggregator", "\\", "attack.type", "ipm", "alie", "worst"]
    # median: ipm 0.71 ± 0.14, alie 0.41 ± 0.14 (each + 0.01 for count 1); worst the lower mean
    assert first[2].split() == ["median", "0.7100", "±", "0.1414", "0.4100", "±", "0.1414", "0.4100"]
    assert first[3].split() == ["mean", "0.3100", "±", "0.1414", "0.8100", "±", "0.1414", "0.3100"]
    assert blocks[1].splitlines()[0] == "final test accuracy, attack.count=2"
    with open(tmp_path / "out" / "pivot.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["attack.count"], r["aggregator"]) for r in rows] == [
        ("1", "median"),
        ("1", "mean"),
        ("2", "median"),
        ("2", "mean"),
    ]
    assert float(rows[3]["ipm"]) == pytest.approx(0.32) and float(rows[3]["worst"]) == pytest.approx(0.32)


@pytest.mark.parametrize(
    "pivot, words",
    [
        ("aggregator", "give two grid keys as ROW,COLUMN"),
        ("aggregator,seed", "seed is not a --grid key of this sweep; its grid keys: aggregator, local.lr"),
    ],
)
def test_a_bad_pivot_is_refused_before_anything_runs(config_file, fake_runs, tmp_path, pivot, words):
    with pytest.raises(ConfigError, match=words):
        sweep(config_file, ["aggregator=mean,median", "local.lr=0.1,0.2"], out=tmp_path / "o", pivot=pivot)
    assert fake_runs == []


SWEEP_SECTION = """
sweep:
  grid:
    rule:
      tm: {aggregator: trimmed_mean}
      gm: {aggregator: geometric_median, aggregator_options: {eps: 0.01, max_iter: 3, tol: 0, init: zero}}
    attack.type: [ipm, alie]
  seeds: [0, 1]
attack: {count: 1}
"""


def test_the_file_s_sweep_section_is_the_grid_with_named_values(config_file):
    config_file.write_text(config_file.read_text() + SWEEP_SECTION)
    runs = plan(config_file, [])
    assert [(run.label, run.seed) for run in runs[:3]] == [
        ("small-rule=tm-attack.type=ipm-seed=0", 0),
        ("small-rule=tm-attack.type=ipm-seed=1", 1),
        ("small-rule=tm-attack.type=alie-seed=0", 0),
    ]
    gm = next(run for run in runs if dict(run.point)["rule"] == "gm")
    assert gm.config.aggregator == "geometric_median"
    assert gm.config.aggregator_options == {"eps": 0.01, "max_iter": 3, "tol": 0, "init": "zero"}
    assert runs[0].config.aggregator == "trimmed_mean" and runs[0].config.aggregator_options == {}
    assert len(runs) == 8
    # the command line picks named values, replaces an axis, adds one, and replaces the seeds
    runs = plan(config_file, ["rule=gm", "attack.type=sign_flip", "local.lr=0.1,0.2"], seeds="5")
    assert [run.label for run in runs] == [
        "small-rule=gm-attack.type=sign_flip-local.lr=0.1-seed=5",
        "small-rule=gm-attack.type=sign_flip-local.lr=0.2-seed=5",
    ]
    assert runs[1].config.local.lr == 0.2 and runs[1].config.attack.type == "sign_flip"
    # fedsim run runs the file's configuration, without its grid
    assert fedsim.load_config(config_file).aggregator == "fedavg"


@pytest.mark.parametrize(
    "section, words",
    [
        ("sweep: [a]", "sweep: expected a mapping of grid and seeds"),
        ("sweep: {grids: {}}", "sweep: expected a mapping of grid and seeds"),
        ("sweep: {grid: {attack.type: ipm}}", "sweep.grid.attack.type: expected a list of values"),
        ("sweep: {grid: {rule: {tm: aggregator}}}", "sweep.grid.rule: expected a list of values"),
        ("sweep: {grid: {rule: {tm: {aggregator: trimmed_mean}}}}\n", None),
    ],
)
def test_a_bad_sweep_section_is_refused_in_one_line(config_file, section, words):
    config_file.write_text(config_file.read_text() + section)
    if words is None:
        with pytest.raises(ConfigError, match="--grid rule=gm: the file's axis rule has no value gm; it has tm"):
            plan(config_file, ["rule=gm"])
    else:
        with pytest.raises(ConfigError, match=words):
            plan(config_file, [])


@pytest.mark.slow
def test_a_warning_or_hint_is_said_once_per_sweep_not_once_per_run(tmp_path, caplog):
    import logging

    from fedsim.results.progress import said_once

    cfg = {
        "name": "told",
        "seed": 1,
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 2,
        "data": {"dataset": "synthetic", "num_clients": 4, "limit": 400},
        "attack": {"fraction": 0.2},  # no attack.type: a setting nothing reads, warned of
    }
    with caplog.at_level(logging.INFO, logger="fedsim"):
        sweep(cfg, ["local.lr=0.01,0.02,0.05"], out=tmp_path / "sweep", quiet=True, log=lambda text: None)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attack.fraction is 0.2")]
    assert said == ["attack.fraction is 0.2 but attack.type is none"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedsim"):
        fedsim.run(cfg, out=tmp_path / "alone", quiet=True)
        fedsim.run(cfg, out=tmp_path / "again", quiet=True)  # outside a sweep, every run says it
    assert sum(r.getMessage().startswith("attack.fraction is 0.2") for r in caplog.records) == 2
    # a hint whose figures differ from run to run is said once too: its kind is the key
    caplog.clear()
    logger = logging.getLogger("fedsim")
    with caplog.at_level(logging.INFO, logger="fedsim"), said_once():
        for size in (30, 40):
            logger.info(f"--set eval_subset={size} scores ...", extra={"once": "eval_subset hint"})
    assert [r.getMessage() for r in caplog.records] == ["--set eval_subset=30 scores ..."]


NAMED_RULE = {"rule": {"tm": {"aggregator": "trimmed_mean"}, "gm": {"aggregator": "geometric_median"}}}


@pytest.mark.parametrize(
    "file_grid, grid, words",
    [
        (NAMED_RULE, ["aggregator=median"], "axes rule and aggregator both set aggregator,"),
        (
            {**NAMED_RULE, "opts": {"x": {"aggregator": "median", "aggregator_options": {}}}},
            [],
            "axes rule and opts both set aggregator,",
        ),
        ({}, ["data.alpha=0.1", "data={alpha: 1, gamma: 0}"], "axes data.alpha and data both set data.alpha,"),
        ({}, ["data=null", "data.gamma=0"], "axes data and data.gamma both set data.gamma,"),
        (
            {},
            ["aggregator_options={beta: 0.1}", "aggregator_options.beta=0.2"],
            "axes aggregator_options and aggregator_options.beta both set aggregator_options.beta,",
        ),
    ],
)
def test_axes_that_set_the_same_key_are_refused_naming_both_and_the_key(config_file, file_grid, grid, words):
    # a run would keep one axis's value and be named (and tabled, and pivoted) by the other's too
    if file_grid:
        config_file.write_text(
            config_file.read_text() + yaml.safe_dump({"sweep": {"grid": file_grid}}, sort_keys=False)
        )
    with pytest.raises(ConfigError) as info:
        plan(config_file, grid)
    assert str(info.value).startswith(f"--grid: {words} so a run would keep only one of their values")
    assert "\n" not in str(info.value)


def test_axes_that_set_different_keys_of_a_section_or_of_a_rule_go_together(config_file):
    runs = plan(config_file, ["data={alpha: 0.5}", "data.gamma=0,1"])
    assert [(run.config.data.alpha, run.config.data.gamma) for run in runs] == [(0.5, 0), (0.5, 1)]
    config_file.write_text(config_file.read_text() + yaml.safe_dump({"sweep": {"grid": NAMED_RULE}}, sort_keys=False))
    runs = plan(config_file, ["aggregator_options={}"], seeds=[0])  # aggregator is not a section of aggregator_options
    assert [run.config.aggregator for run in runs] == ["trimmed_mean", "geometric_median"]


@pytest.mark.parametrize(
    "overrides, grid, seeds, message",
    [
        (["aggregator=median"], ["aggregator=mean,krum"], None, "--set aggregator: the grid's axis aggregator sets it"),
        (["data={alpha: 1}"], ["data.alpha=0.1,0.5"], None, "--set data.alpha: the grid's axis data.alpha sets it"),
        (["seed=4"], ["aggregator=mean"], [0, 1], "--set seed: --seeds gives every run its seed in its place"),
    ],
)
def test_a_set_that_the_grid_replaces_is_said(config_file, caplog, overrides, grid, seeds, message):
    runs = plan(config_file, grid, [*overrides, "local.lr=0.2"], seeds=seeds)
    assert [r.message for r in caplog.records] == [message + (" in every run, in its place" if seeds is None else "")]
    assert {run.config.local.lr for run in runs} == {0.2} and len(runs) == 2


def test_a_named_axis_that_sets_the_seed_is_refused_beside_seeds(config_file):
    config_file.write_text(config_file.read_text() + "sweep: {grid: {start: {a: {seed: 1}, b: {seed: 2}}}}\n")
    with pytest.raises(ConfigError, match=r"^--seeds and the axis start both give seeds"):
        plan(config_file, [], seeds=[0])


def test_every_error_in_checking_a_grid_point_names_the_grid_values_it_came_from(config_file):
    raw = yaml.safe_load(config_file.read_text())
    config_file.write_text(
        yaml.safe_dump({**raw, "aggregator": "trimmed_mean", "attack": {"type": "sign_flip", "count": 1}})
    )
    # a value that is bad only beside the file's: the whole point, then the error as the file names it
    with pytest.raises(ConfigError) as info:
        plan(config_file, ["attack.count=1,20", "local.lr=0.1"])
    assert str(info.value).startswith(
        f"--grid attack.count=20 --grid local.lr=0.1: {config_file}: aggregator_options: f = 20 is too large"
    )
    with pytest.raises(ConfigError) as info:
        plan(config_file, ["attack.fraction=0.25"])
    assert str(info.value).startswith(f"--grid attack.fraction=0.25: {config_file}: attack.count: set fraction")
    # a key inside the grid's value, and a key that a named axis's value sets
    with pytest.raises(ConfigError, match=r"^--grid pre_aggregators=\[foo\] \(pre_aggregators\[0\]\): unknown pre-agg"):
        plan(config_file, ["pre_aggregators=[nnm],[foo]"])
    named = {"rule": {"tm": {"aggregator": "trimmed_mean"}, "gm": {"aggregator_options": {"eps": -1}}}}
    config_file.write_text(config_file.read_text() + yaml.safe_dump({"sweep": {"grid": named}}))
    with pytest.raises(ConfigError, match=r"^--grid rule=gm \(aggregator_options\): eps must be a number > 0"):
        plan(config_file, [], ["aggregator=geometric_median"])


def test_a_file_axis_holds_list_values_as_grid_does(config_file):
    values = [[{"arc": {"f": 1}}], [{"nnm": {"f": 1}}], ["nnm"], ["arc"]]
    raw = yaml.safe_load(config_file.read_text())
    config_file.write_text(yaml.safe_dump({**raw, "sweep": {"grid": {"pre_aggregators": values}}}))
    runs = plan(config_file, [])
    assert [run.point for run in runs] == [
        [("pre_aggregators", text)] for text in ("[{arc: {f: 1}}]", "[{nnm: {f: 1}}]", "[nnm]", "[arc]")
    ]
    assert [run.config.pre_aggregators for run in runs] == values
    # as the command line gives them
    assert [run.config.pre_aggregators for run in plan(config_file, ["pre_aggregators=[nnm],[arc]"])] == values[2:]


@pytest.mark.slow
def test_a_sweep_of_a_file_s_list_valued_axis_runs_each_value(tmp_path):
    values = [[{"arc": {"f": 1}}], [{"nnm": {"f": 1}}], ["nnm"], ["arc"]]
    cfg = {
        "name": "pre",
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 4,
        "data": {"dataset": "synthetic", "num_clients": 4, "limit": 400},
        "aggregator": "median",
        "attack": {"type": "sign_flip", "count": 1},
        "sweep": {"grid": {"pre_aggregators": values}},
    }
    (tmp_path / "pre.yaml").write_text(yaml.safe_dump(cfg))
    runs = sweep(tmp_path / "pre.yaml", [], out=tmp_path / "out", quiet=True, log=lambda text: None)
    written = sorted(path.parent.name for path in (tmp_path / "out").glob("*/config.yaml"))
    assert len(runs) == len(written) == 4
    assert [
        yaml.safe_load((tmp_path / "out" / run.label / "config.yaml").read_text())["pre_aggregators"] for run in runs
    ] == values


# what the fake engine below returns per algorithm: the global model's final test accuracy, the mean
# accuracy on the clients' own test splits per round, and the model those splits were scored with
CLIENT_SCORES = {
    "fedavg": (0.45, (0.11, 0.46), "global"),
    "ditto": (0.45, (0.28, 0.58), "personal"),
    "fedproto": (0.07, (0.47, 0.54), "personal"),  # its global model never trains
}


def test_fedavg_and_personal_runs_share_the_client_accuracy_column_and_pivot(config_file, monkeypatch, tmp_path):
    def start_run(cfg, out=None, overwrite=False, quiet=False, pools=None):
        test, clients, model = CLIENT_SCORES[cfg.algorithm]
        lr = cfg.local.lr
        rows = [
            dict.fromkeys(COLUMNS, 0)
            | {"round": r, "test_accuracy": test + lr, "seconds": 1.0, "test_perplexity": None}
            | {"client_accuracy_mean": mean + lr}
            for r, mean in zip((1, 2), clients)
        ]
        summary = {
            "client_eval_model": model,
            **({"global_model_trained": False} if cfg.algorithm == "fedproto" else {}),
        }
        return History(rows, cfg.to_dict(), out, summary)

    replace_engine(monkeypatch, start_run)
    lines = []
    grid = ["algorithm=fedavg,ditto,fedproto", "local.lr=0.01,0.02"]
    sweep(config_file, grid, out=tmp_path / "out", log=lines.append, pivot="algorithm,local.lr")
    table = [line.split() for line in lines[-3].splitlines()]
    assert table[0] == [
        "run", "final", "global", "acc", "best", "global", "acc", "final", "client", "acc", "best", "client", "acc",
        "clients", "use", "s/round",
    ]  # fmt: skip
    # FedAvg's clients scored with the global model, beside Ditto's and FedProto's own models
    assert table[1][:6] == ["small-algorithm=fedavg-local.lr=0.01", "0.4600", "0.4600", "0.4700", "0.4700", "global"]
    assert table[3][1:6] == ["0.4600", "0.4600", "0.5900", "0.5900", "personal"]
    # FedProto's global model is the initial one: its accuracy is no result of the run
    assert table[5][1:9] == ["0.0800", "(never", "trained)", "0.0800", "(never", "trained)", "0.5500", "0.5500"]
    with open(tmp_path / "out" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["final_client_accuracy"]) for r in rows] == pytest.approx([0.47, 0.48, 0.59, 0.60, 0.55, 0.56])
    assert [r["client_eval_model"] for r in rows] == ["global"] * 2 + ["personal"] * 4
    assert float(rows[0]["best_client_accuracy"]) == pytest.approx(0.47)
    assert [r["global_model_trained"] for r in rows] == ["True"] * 4 + ["False"] * 2

    client, test = (block.splitlines() for block in lines[-2].split("\n\n"))
    assert client[0] == (
        "final client accuracy (each client's model on its own test split: the global one or its own, as marked)"
    )
    assert client[1].split() == ["algorithm", "\\", "local.lr", "0.01", "0.02", "worst"]
    assert client[2].split() == ["fedavg", "0.4700", "(global)", "0.4800", "(global)", "0.4700", "(global)"]
    assert client[4].split() == ["fedproto", "0.5500", "(personal)", "0.5600", "(personal)", "0.5500", "(personal)"]
    assert test[0] == "final test accuracy (the global model on the whole test set)"
    assert test[2].split() == ["fedavg", "0.4600", "0.4700", "0.4600"]
    assert test[4].split()[-3:] == ["0.0800", "(never", "trained)"]
    with open(tmp_path / "out" / "pivot.csv") as f:
        pivot = list(csv.DictReader(f))
    assert [(r["figure"], r["algorithm"]) for r in pivot] == [
        (figure, algorithm)
        for figure in ("final_client_accuracy", "final_test_accuracy")
        for algorithm in ("fedavg", "ditto", "fedproto")
    ]
    assert float(pivot[1]["0.02"]) == pytest.approx(0.60) and float(pivot[1]["worst"]) == pytest.approx(0.59)
    assert [r["never_trained"] for r in pivot] == ["", "", "", "", "", "0.01 0.02"]


def test_a_sweep_whose_every_client_score_is_personal_names_it_so(config_file, monkeypatch, tmp_path):
    def start_run(cfg, out=None, overwrite=False, quiet=False, pools=None):
        row = dict.fromkeys(COLUMNS, 0) | {"round": 1, "test_accuracy": 0.4, "seconds": 1.0, "test_perplexity": None}
        return History([row | {"client_accuracy_mean": 0.6}], cfg.to_dict(), out, {"client_eval_model": "personal"})

    replace_engine(monkeypatch, start_run)
    lines = []
    sweep(config_file, ["algorithm=ditto,fedper"], out=tmp_path / "out", log=lines.append)
    table = [line.split() for line in lines[-2].splitlines()]
    assert table[0][7:13] == ["final", "personal", "acc", "best", "personal", "acc"] and "use" not in table[0]
    assert table[1][1:5] == ["0.4000", "0.4000", "0.6000", "0.6000"]
