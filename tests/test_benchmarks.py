"""The benchmark scripts run end to end on tiny CPU configurations and write complete JSON.

Each script runs once as a command, on generated data with 2 rounds and 1 worker; the checks
are on the shape of the results, never on timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "--size",
    "cpu",
    "--device",
    "cpu",
    "--rounds",
    "2",
    "--set",
    "data.dataset=synthetic",
    "--set",
    "data.limit=400",
]


def run_bench(name: str, *flags: str, output: Path) -> tuple[dict, str]:
    """The script ``benchmarks/<name>`` run with ``flags``, as it must succeed: its results JSON and what it printed."""
    command = [sys.executable, str(REPO / "benchmarks" / name), *flags, "--output", str(output)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(output.read_text()), done.stdout


def run_script(name: str, *flags: str, output: Path) -> dict:
    return run_bench(name, *TINY, *flags, output=output)[0]


def assert_positive(entry: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(entry[key], (int, float)) and entry[key] > 0, (key, entry[key])


def assert_run_numbers(entry: dict) -> None:
    assert entry["status"] == "ok", entry.get("message")
    assert_positive(
        entry,
        "round1_seconds",
        "round_seconds",
        "interval_seconds",
        "samples_per_second",
        "train_seconds",
        "startup_seconds",
        "wall_seconds",
        "run_call_seconds",
    )
    assert 0 <= entry["overhead_fraction"] < 1
    assert len(entry["rows"]) == 2 and entry["measured_rounds"] == 1


def test_bench_rounds_measures_runs_and_the_command(tmp_path):
    result = run_script("bench_rounds.py", "--workload", "W1", "--workers", "1,8", output=tmp_path / "b.json")
    assert {"command", "machine", "options", "entries", "commands"} <= set(result)
    assert_positive(result["machine"], "cpu_count")
    measured, skipped = result["entries"]
    assert (measured["workload"], measured["model"], measured["workers"]) == ("W1", "mnist_cnn", 1)
    assert_run_numbers(measured)
    assert_positive(measured, "worker_peak_mb", "server_peak_mb")
    assert measured["efficiency"] == pytest.approx(1.0)
    assert skipped["status"] == "skipped" and "clients per round" in skipped["message"]
    (command,) = result["commands"]
    assert command["status"] == "ok"
    assert_positive(command, "command_seconds", "startup_seconds", "wall_seconds")


def test_sequential_baseline_with_dataloaders(tmp_path):
    result = run_script(
        "sequential_baseline.py",
        "--workload",
        "W2",
        "--models",
        "mnist_cnn",
        "--dataloader",
        output=tmp_path / "s.json",
    )
    (entry,) = result["entries"]
    assert entry["mode"] == "dataloader"
    assert_run_numbers(entry)
    assert_positive(entry, "peak_mb", "threads")
    assert 0 <= entry["final_test_accuracy"] <= 1


def test_compare_puts_both_sides_and_their_ratio_in_one_file(tmp_path):
    result = run_script(
        "compare.py", "--workload", "W2", "--models", "mnist_cnn", "--workers", "1", output=tmp_path / "c.json"
    )
    (row,) = result["ratios"]
    assert (row["workload"], row["model"], row["backend"], row["workers"]) == ("W2", "mnist_cnn", "process", 1)
    assert_positive(row, "fedsim_round_seconds", "sequential_round_seconds", "round_ratio", "run_ratio")
    assert row["round_ratio"] == pytest.approx(row["sequential_round_seconds"] / row["fedsim_round_seconds"])
    assert_run_numbers(result["fedsim"][0])
    assert_run_numbers(result["sequential"][0])


def test_profile_round_breaks_a_client_down(tmp_path):
    result = run_script(
        "profile_round.py", "--workload", "W2", "--models", "mnist_cnn", "--clients", "1", output=tmp_path / "p.json"
    )
    (entry,) = result["entries"]
    assert entry["status"] == "ok", entry.get("message")
    assert_positive(entry, "client_seconds", "step_ms", "steps_per_client", "aggregate_seconds", "evaluate_seconds")
    parts = {row["part"]: row for row in entry["breakdown"]}
    assert {"forward", "backward", "SGD step", "data gather", "host sync"} <= set(parts)
    assert parts["forward"]["host_ms"] > 0 and parts["backward"]["host_ms"] > 0
    assert entry["top_ops"]["worker"]["by_self_cpu"] and entry["top_ops"]["server"]["by_self_cpu"]
    assert "worker operators" in (tmp_path / "p.txt").read_text()


def test_bench_startup_times_the_command_and_a_sweep(tmp_path):
    # no MNIST under tmp_path: generated data
    flags = ["--repeats", "1", "--workers", "2", "--data-root", str(tmp_path)]
    result, printed = run_bench("bench_startup.py", *flags, output=tmp_path / "s.json")
    (run,), (sweep,) = result["runs"], result["sweeps"]
    assert run["status"] == "ok" and run["workers"] == 2 and run["repeats"] == 1
    assert_positive(run, "first_line_seconds", "ready_seconds", "startup_seconds", "exit_seconds")
    assert sweep["status"] == "ok" and len(sweep["startup_seconds_each"]) == sweep["runs"] == 3
    assert_positive(sweep, "seconds_per_run", "first_startup_seconds", "other_startup_seconds")
    assert "Start-up of fedsim" in printed and "A sweep of 3 one-round runs" in printed


def test_bench_sharing_times_both_copies_alone_and_beside_busy_processes(tmp_path):
    # no MNIST under tmp_path: generated data
    flags = ["--workloads", "quickstart", "--busy", "0,1", "--repeats", "1", "--source", str(REPO)]
    flags += ["--set", "rounds=1", "--set", "data.limit=2000"]
    result, printed = run_bench("bench_sharing.py", *flags, "--data-root", str(tmp_path), output=tmp_path / "s.json")
    rows = result["rows"]
    assert [(r["side"], r["busy"]) for r in rows] == [("this", 0), ("other", 0), ("this", 1), ("other", 1)]
    for row in rows:
        assert_positive(row, "median_seconds", "to_alone")
        assert len(row["seconds"]) == 1
    assert [r["to_other"] is None for r in rows] == [False, True, False, True]
    assert "Launch to exit" in printed


def test_w3_is_pfl_researchs_cifar10_benchmark(tmp_path, monkeypatch):
    """W3 as its paper's Table 1 sets it, on generated CIFAR-shaped tensors without the files."""
    import argparse

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import harness

    from fedsim.experiment.validation import load_config

    parser = argparse.ArgumentParser()
    harness.add_workload_arguments(parser)
    (run,) = harness.workload_runs(parser.parse_args(["--workload", "W3", "--data-root", str(tmp_path)]))
    cfg = load_config(run["config"], run["overrides"])
    assert (cfg.data.num_clients, cfg.clients_per_round, cfg.local.epochs, cfg.local.batch_size) == (1000, 50, 1, 10)
    assert (cfg.local.lr, cfg.server_optimizer, cfg.eval_every, cfg.model) == (0.1, "none", 10, "pfl_cnn")
    assert cfg.data.dataset == "w3data:cifar_shaped" and cfg.data.augment is False


def test_bench_personal_scoring_scores_each_client_two_ways_alike(tmp_path):
    flags = ["--clients", "4,500", "--repeats", "1", "--model", "mnist_2nn", "--data-root", ""]  # generated data
    rows = run_bench("bench_personal_scoring.py", *flags, output=tmp_path / "p.json")[0]["rows"]
    assert [row["clients"] for row in rows] == [4, 500] and all(row["same_accuracies"] for row in rows)
    for row in rows:
        assert_positive(row, "global_seconds", "personal_seconds", "one_by_one_seconds", "personal_ratio")


def test_bench_scoring_scores_alike_in_every_batch_size(tmp_path):
    flags = ["--models", "mnist_cnn", "--batches", "64,300", "--samples", "300", "--repeats", "1"]
    small, whole = run_bench("bench_scoring.py", *flags, output=tmp_path / "s.json")[0]["entries"]
    assert (small["batch"], whole["batch"], whole["ratio"]) == (64, 300, 1.0)
    assert small["accuracy"] == whole["accuracy"]
    assert small["loss"] == pytest.approx(whole["loss"], rel=1e-6)  # float32 sums of 64 and of 300 losses
    assert_positive(small, "seconds", "ratio")


def test_bench_aggregation_times_both_pipelines_on_the_same_aggregate(tmp_path):
    pytest.importorskip("byzfl")
    flags = ["--rows", "11,14", "--values", "3000", "--repeats", "1", "--sort", "3,129"]
    results = run_bench("bench_aggregation.py", *flags, output=tmp_path / "a.json")[0]
    assert [s["rows"] for s in results["sorts"]] == [3, 129]  # the sort agreed with torch.sort on both
    entries = results["entries"]
    assert [(e["rows"], e["f"], e["rule"]) for e in entries] == [
        (11, 1, "trimmed_mean"),
        (11, 1, "geometric_median"),
        (14, 4, "trimmed_mean"),
        (14, 4, "geometric_median"),
    ]
    for entry in entries:
        assert entry["max_difference"] < 1e-6  # coordinates below 0.05 in float32: a few ulps are under 1e-8
        assert_positive(entry, "fedsim_ms", "byzfl_ms", "ratio")
