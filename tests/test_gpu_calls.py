"""The prepared GPU calls (benchmarks/gpu/): their commands parse, the gate reads a run's
files right, the side-by-side ratios are the quotients of the measured rates, and a step's process
group is gone when the step ends, also when it is stopped at its limit."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / "benchmarks" / "gpu"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def calls():
    sys.path[:0] = [str(GPU), str(GPU.parent)]
    try:
        yield load(GPU / "calls.py", "gpu_calls")
    finally:
        sys.path.remove(str(GPU))
        sys.path.remove(str(GPU.parent))


@pytest.mark.parametrize("tiny", [False, True])
def test_every_benchmark_step_parses_its_flags(calls, tiny, tmp_path):
    plans = (calls.plan.call1_steps, calls.plan.call2_steps, calls.plan.call3_steps)
    steps = [step for plan in plans for step in plan(tiny, str(tmp_path))]
    benches = [s for s in steps if s.kind == "bench"]
    assert len(benches) == 12
    for step in benches:
        script = REPO / step.command[1]
        module = load(script, script.stem)
        args = module.parse_args(step.command[2:])
        assert args.output == step.output
        if not tiny and hasattr(args, "size"):
            assert (args.device, args.size) == ("cuda", "full")
        if getattr(args, "budget_s", None):  # bench_byzfl stops its sweeps in time to write its JSON
            assert args.budget_s < step.cap_s - 10
    # pfl runs first in call 2, right after the environment, in its own invocation
    call2 = calls.plan.call2_steps(tiny, str(tmp_path))
    assert [s.kind for s in call2[:3]] == ["env", "env", "bench"] and call2[2].what == "pfl"


def test_the_steps_guesses_fit_their_calls(calls, tmp_path):
    """The guesses, summed, leave room in each call's budget; every limit is above its guess."""
    for steps, budget in (
        (calls.plan.call1_steps(False, str(tmp_path)), 280),
        (calls.plan.call2_steps(False, "w"), 340),
        (calls.plan.call3_steps(False, "w"), 520),
    ):
        assert sum(s.guess_s for s in steps) < budget - calls.SUMMARY_RESERVE_S
        assert all(s.cap_s > s.guess_s for s in steps)


def write_run(folder: Path, accuracies: list[float], device: str = "cuda:0", dataset: str = "mnist") -> None:
    folder.mkdir()
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "test_accuracy", "test_loss"])
        writer.writerows([i + 1, a, 0.1] for i, a in enumerate(accuracies))
    summary = {"device": device, "device_name": "NVIDIA H100 80GB HBM3", "dataset": dataset}
    (folder / "summary.json").write_text(json.dumps(summary))


@pytest.mark.parametrize(
    ("accuracies", "device", "dataset", "tiny", "verdict"),
    [
        ([0.80, 0.90, 0.9213], "cuda:0", "mnist", False, "PASSED"),
        ([0.80, 0.93, 0.9199], "cuda:0", "mnist", False, "FAILED"),  # round 3 counts, not the best round
        ([0.80, 0.90, 0.95], "cpu", "mnist", False, "FAILED"),  # the GPU run fell back to the CPU
        ([0.80, 0.90, 0.95], "cuda:0", "synthetic", False, "FAILED"),  # not real MNIST
        ([0.80, 0.95], "cuda:0", "mnist", False, "FAILED"),  # stopped after round 2
        ([0.1, 0.2, 0.3783], "cpu", "mnist", True, "PASSED"),
    ],
)
def test_the_gate(calls, tmp_path, accuracies, device, dataset, tiny, verdict):
    write_run(tmp_path / "gate", accuracies, device, dataset)
    threshold = calls.plan.TINY_GATE_ACCURACY if tiny else calls.plan.GATE_ACCURACY
    result = calls.check_gate({"status": "ok"}, threshold, tiny, str(tmp_path / "gate"))
    assert result["gate"] == verdict


def test_a_run_that_did_not_finish_fails_the_gate(calls, tmp_path):
    assert calls.check_gate({"status": "stopped"}, 0.92, False, str(tmp_path / "absent"))["gate"] == "FAILED"


def test_side_by_side_divides_fedsims_fastest_rate_by_each_baselines(calls):
    def record(what, rates, **extra):
        entries = [{"client_updates_per_second": r, "round_seconds": 50 / r, **extra} for r in rates]
        return {"workload": "W3", "model": "pfl_cnn", "what": what, "status": "ok", "result": {"entries": entries}}

    records = [
        record("pfl", [40.0, 55.0], procs=3),
        record("fedsim", [120.0, 165.0], backend="process", workers=8),
        record("sequential", [33.0], mode="tensors"),
        {"workload": "W2", "model": "fedavg_cnn", "what": "sequential", "status": "stopped"},
    ]
    rows = {(r["workload"], r["what"]): r for r in calls.harness.side_by_side(records)}
    assert rows[("W3", "fedsim")]["client_updates_per_second"] == 165.0
    assert rows[("W3", "pfl")]["ratio"] == pytest.approx(165.0 / 55.0)
    assert rows[("W3", "sequential")]["ratio"] == pytest.approx(165.0 / 33.0)
    assert rows[("W2", "sequential")]["config"] == "stopped" and "ratio" not in rows[("W2", "sequential")]


@pytest.mark.slow
def test_a_step_leaves_no_process_behind(calls, tmp_path):
    marker = tmp_path / "child.pid"
    leave_child = f"sleep 60 & echo $! > {marker}; echo started"
    with open(tmp_path / "log", "w") as log:
        code, seconds, tail = calls.run_command(["bash", "-c", leave_child], 30, log)
        assert (code, tail) == (0, ["started"]) and seconds < 5
        assert not alive(int(marker.read_text()))
        code, seconds, tail = calls.run_command(["bash", "-c", f"{leave_child}; sleep 60"], 2, log)
        assert code is None and tail == ["started"] and 2 <= seconds < 10  # stopped at its limit
        assert not alive(int(marker.read_text()))
    assert (tmp_path / "log").read_text() == "started\nstarted\n"


def alive(pid: int) -> bool:
    time.sleep(0.2)  # the kill is asynchronous
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"  # a zombie is dead, awaiting its reaper
