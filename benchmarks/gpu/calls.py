"""Run one of the prepared GPU calls (issue 29) and leave its results in the output folder.

    bash benchmarks/gpu/call.sh 1          # on the device machine: wheels, data path, then this
    python3 benchmarks/gpu/calls.py 1 --out $OUT --budget-s 280
    python3 benchmarks/gpu/calls.py 2 --out $OUT --budget-s 340
    python3 benchmarks/gpu/calls.py 3 --out $OUT --budget-s 520    # ByzFL's benchmark, a session of its own
    python benchmarks/gpu/calls.py 1 --tiny --out /tmp/gpu-dry   # the dry run: CPU, tiny sizes

Each step (benchmarks/gpu/steps.py) runs in its own process group under coreutils `timeout -k`,
which signals the whole group; the group is killed again once the step ends, so that no worker
outlives its step and holds GPU memory. After every step `call<N>.json` in the output folder is
rewritten whole (the steps so far, their outputs' tails, each benchmark's own JSON), and every
line a step prints goes to `call<N>.log` as it comes: a call cut short keeps what it measured.
Two files come back per call, well inside the device tool's limit of 8.

Exit status: 0 all steps ok; 1 call 1's gate failed (the call ends there; do not run call 2);
3 the gate passed (or there is none) but a step failed, was stopped or did not fit.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import harness  # noqa: E402
import steps as plan  # noqa: E402

SUMMARY_RESERVE_S = 5  # kept back from the budget to write the JSON and print the tables
KILL_GRACE_S = 5  # between timeout's SIGTERM and its SIGKILL
TAIL_LINES = 40
BUDGETS = {1: 280, 2: 340, 3: 520}  # seconds for each call's steps, inside call.sh's hard limits
RUNNING: dict[str, int] = {}  # the process group of the step under way, for the SIGTERM handler

STEP_COLUMNS = [
    ("step", "name", ""),
    ("status", "status", ""),
    ("s", "seconds", ".1f"),
    ("limit s", "limit_s", ".0f"),
    ("guess s", "guess_s", ".0f"),
    ("note", "note", ""),
]
SIDE_COLUMNS = [
    *harness.SIDE_BY_SIDE_COLUMNS,
    ("GPU worker MB", "gpu_worker_mb", ".0f"),
    ("GPU total MB", "gpu_total_mb", ".0f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("call", type=int, choices=tuple(BUDGETS))
    parser.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT)")
    parser.add_argument("--budget-s", type=float, help="seconds for all steps (default 280, 340, 520 for calls 1-3)")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run: tiny sizes, CUDA-only steps skipped")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("--out: name the output folder (or set OUT)")
    args.budget_s = args.budget_s or BUDGETS[args.call]
    return args


def run_command(command: list[str], limit_s: float, log) -> tuple[int | None, float, list[str]]:
    """Run in a new process group under `timeout -k`; (exit status or None if stopped, seconds, last lines)."""
    wrapped = ["timeout", "-k", str(KILL_GRACE_S), f"{limit_s:.0f}", *command]
    start = time.time()
    process = subprocess.Popen(
        wrapped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=REPO
    )
    RUNNING["pgid"] = process.pid
    tail: list[str] = []
    # a thread reads, so that a worker left holding the pipe after its step ended cannot block the call
    reader = threading.Thread(target=copy_lines, args=(process.stdout, log, tail), daemon=True)
    reader.start()
    code = process.wait()
    kill_group(RUNNING.pop("pgid"))  # whatever of the step is still alive (a worker its parent did not reap) goes too
    reader.join(timeout=KILL_GRACE_S)
    return (None if code in (124, 137) else code), time.time() - start, tail


def copy_lines(stream, log, tail: list[str]) -> None:
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)
        log.flush()
        tail.append(line.rstrip("\n"))
        del tail[:-TAIL_LINES]


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Stopped(Exception):
    """The call itself was told to stop (its outer `timeout`): end the step, keep what was measured."""


def on_sigterm(signum, frame) -> None:
    # the steps run in sessions of their own, which a signal to the driver's group does not reach
    if "pgid" in RUNNING:
        kill_group(RUNNING.pop("pgid"))
    raise Stopped


def run_step(step: plan.Step, limit_s: float, tiny: bool, log) -> dict:
    record = {"name": step.name, "kind": step.kind, "guess_s": step.guess_s, "limit_s": limit_s}
    record.update(workload=step.workload, model=step.model, what=step.what, command=" ".join(step.command))
    if step.needs_cuda and tiny:
        print(f"SKIP {step.name}: needs CUDA (dry run on the CPU)", flush=True)
        return {**record, "status": "SKIP", "note": "needs CUDA (dry run)"}
    if shutil.which(step.command[0]) is None:
        print(f"SKIP {step.name}: {step.command[0]} not found", flush=True)
        return {**record, "status": "SKIP", "note": f"{step.command[0]} not found"}
    header = f"\n===== {step.name}: limit {limit_s:.0f} s, guess {step.guess_s:.0f} s\n$ {record['command']}\n"
    print(header, end="", flush=True)
    log.write(header)
    code, seconds, tail = run_command(step.command, limit_s, log)
    status = "ok" if code == 0 else ("stopped" if code is None else f"exit {code}")
    record.update(status=status, seconds=seconds, tail=tail)
    if status == "stopped":
        record["note"] = f"stopped at its limit of {limit_s:.0f} s; see the log for what it printed"
    if step.output and Path(step.output).is_file():
        record["result"] = json.loads(Path(step.output).read_text())
    if step.kind == "env":
        record.update(read_environment(step, tail))
    return record


def read_environment(step: plan.Step, tail: list[str]) -> dict:
    if step.name == "torch probe":
        probe = [line for line in tail if line.startswith("PROBE ")]
        return {"environment": json.loads(probe[-1][6:])} if probe else {}
    rows = list(csv.DictReader(line for line in tail if "," in line))
    return {"environment": {key.strip(): value.strip() for key, value in rows[0].items()}} if rows else {}


def check_gate(record: dict, threshold: float, tiny: bool, run_dir: str) -> dict:
    """Does the default experiment reach `threshold` test accuracy after round 3, on the device asked for?"""
    metrics, summary = Path(run_dir) / "metrics.csv", Path(run_dir) / "summary.json"
    if record["status"] != "ok" or not metrics.is_file() or not summary.is_file():
        return {"gate": "FAILED", "note": f"the run did not finish ({record['status']})"}
    rows = list(csv.DictReader(metrics.open()))
    info = json.loads(summary.read_text())
    accuracy = float(rows[2]["test_accuracy"]) if len(rows) >= 3 else None
    device_ok = tiny or str(info.get("device", "")).startswith("cuda")
    passed = accuracy is not None and accuracy >= threshold and device_ok and info.get("dataset") == "mnist"
    note = (
        f"test accuracy {accuracy} after round 3 (gate {threshold}) on {info.get('device_name') or info.get('device')}"
    )
    keys = ("device", "device_name", "startup_seconds", "wall_seconds", "worker_peak_memory_mb", "torch")
    return {
        "gate": "PASSED" if passed else "FAILED",
        "note": note,
        "metrics": rows,
        "summary": {key: info.get(key) for key in keys},
    }


def write_json(path: Path, report: dict) -> None:
    """Replace the file whole, so that a call killed mid-write still leaves the previous version."""
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(report, indent=1, default=str))
    os.replace(temporary, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    work = tempfile.mkdtemp(prefix=f"fedsim-call{args.call}-")
    steps = {1: plan.call1_steps, 2: plan.call2_steps, 3: plan.call3_steps}[args.call](args.tiny, work)
    threshold = float(os.environ.get("FEDSIM_GPU_GATE", plan.TINY_GATE_ACCURACY if args.tiny else plan.GATE_ACCURACY))
    report = {"call": args.call, "tiny": args.tiny, "budget_s": args.budget_s, "steps": [], "gate": None}
    path = out / f"call{args.call}.json"
    signal.signal(signal.SIGTERM, on_sigterm)
    with open(out / f"call{args.call}.log", "a") as log:
        for index, step in enumerate(steps):
            left = deadline - time.time() - SUMMARY_RESERVE_S
            if left < 5:
                report["steps"].append({"name": step.name, "status": "not run", "note": f"{left:.0f} s of budget left"})
                continue
            try:
                record = run_step(step, min(step.cap_s, left), args.tiny, log)
            except Stopped:
                report["steps"].append({"name": step.name, "status": "stopped", "note": "the call was stopped"})
                break
            if step.kind == "gate":
                record.update(check_gate(record, threshold, args.tiny, step.extra["run_dir"]))
                report["gate"] = record["gate"]
                if record["gate"] == "FAILED":
                    record["status"] = "gate failed"
                print(f"GATE {record['gate']}: {record['note']}", flush=True)
            report["steps"].append(record)
            report["side_by_side"] = harness.side_by_side(report["steps"])
            write_json(path, report)
            if report["gate"] == "FAILED":
                skipped = [
                    {"name": later.name, "status": "not run", "note": "the gate failed"} for later in steps[index + 1 :]
                ]
                report["steps"] += skipped
                break
    shutil.rmtree(work, ignore_errors=True)
    return finish(report, path)


def finish(report: dict, path: Path) -> int:
    """Print the tables last (the device tool returns the end of the output) and choose the exit status."""
    write_json(path, report)
    env = {k: v for r in report["steps"] for k, v in r.get("environment", {}).items()}
    print(f"\n===== call {report['call']} summary{' (dry run, tiny sizes on the CPU)' if report['tiny'] else ''}")
    print(f"device: {env.get('device_name') or env.get('name') or 'cpu'}; torch {env.get('torch')}; "
          f"compute mode {env.get('compute_mode')}; MIG {env.get('mig.mode.current')}")  # fmt: skip
    print(harness.format_table(STEP_COLUMNS, report["steps"]))
    if report.get("side_by_side"):
        print("\nfedsim x = fedsim's client updates per second over the baseline's, measured in this call")
        print(harness.format_table(SIDE_COLUMNS, report["side_by_side"]))
    if report["gate"]:
        print(f"\nGATE {report['gate']}")
    print(f"wrote {path} and {path.with_suffix('.log')}")
    if report["gate"] == "FAILED":
        return 1
    return 0 if all(r["status"] in ("ok", "SKIP") for r in report["steps"]) else 3


if __name__ == "__main__":
    sys.exit(main())
