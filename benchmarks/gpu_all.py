"""Issue 20's side-by-side matrix in one command that keeps within a time budget.

    python benchmarks/gpu_all.py --budget-s 540 --workload W1,W2 --output $OUT/gpu_all-w12.json
    python benchmarks/gpu_all.py --budget-s 420 --workload W3 --output $OUT/gpu_all-w3.json
    python benchmarks/gpu_all.py --size cpu --device cpu --workload W1,W3 --rounds 2 --workers 1,2

For each workload, in this order: fedsim (bench_rounds.py, the process backend then the vmap
backend, workers 1/2/4/8/16), the sequential loop with device-resident data and with a DataLoader
(sequential_baseline.py), the seed article's scheme (seed_scheme.py; W1 and W2) and pfl-research
(peer_pfl.py; W3). Each step runs as its own command with what is left of the budget as its
limit; a step is stopped at the budget's end, and the steps after it are listed as not run. The
STEPS estimates are guesses (nothing has timed them on a GPU) and never skip a step.
benchmarks/gpu/ holds the two prepared device calls (issue 29), which supersede this matrix there.
Prints one table per workload and model: fedsim's fastest configuration, each
baseline, and the ratio of client updates per second (fedsim / baseline; above 1 fedsim is
faster); writes every step's results and the table to one JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
# (step, workloads it applies to, script, extra flags, guessed seconds on an H100 per workload and model)
STEPS = [
    ("fedsim process", "W1 W2 W3", "bench_rounds.py", ["--backends", "process"], {"W1": 60, "W2": 90, "W3": 100}),
    ("fedsim vmap", "W1 W2 W3", "bench_rounds.py", ["--backends", "vmap", "--no-cli"], {"W1": 40, "W2": 60, "W3": 90}),
    ("sequential", "W1 W2 W3", "sequential_baseline.py", [], {"W1": 40, "W2": 30, "W3": 25}),
    ("dataloader", "W1 W2 W3", "sequential_baseline.py", ["--dataloader"], {"W1": 80, "W2": 45, "W3": 40}),
    ("seed scheme", "W1 W2", "seed_scheme.py", [], {"W1": 60, "W2": 40}),
    ("pfl", "W3", "peer_pfl.py", [], {"W3": 120}),
]
# fewer rounds for the slow baselines at --size full: medians are over the rounds after the first
BASELINE_ROUNDS = {"W1": 2, "W2": 3, "W3": 11}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_workload_arguments(parser)
    parser.set_defaults(workload="W1,W2,W3")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds for the whole command (default 540)")
    parser.add_argument("--workers", default="1,2,4,8,16", help="fedsim worker counts (default 1,2,4,8,16)")
    parser.add_argument("--procs", default="1,3,5", help="pfl processes sharing the device (default 1,3,5)")
    parser.add_argument(
        "--steps", help="only these steps, comma-separated (default all): " + ", ".join(step[0] for step in STEPS)
    )
    return parser.parse_args(argv)


def step_flags(args, workload: str, model: str, step: tuple) -> list[str]:
    name, _, script, extra, _ = step
    flags = ["--workload", workload, "--models", model, "--device", args.device, "--size", args.size, *extra]
    rounds = args.rounds or (
        BASELINE_ROUNDS[workload] if args.size == "full" and not name.startswith("fedsim") else None
    )
    if rounds:
        flags += ["--rounds", str(rounds)]
    if args.data_root:
        flags += ["--data-root", args.data_root]
    for item in args.set:
        flags += ["--set", item]
    if script == "bench_rounds.py":
        flags += ["--workers", args.workers]
    if script == "peer_pfl.py":
        flags += ["--procs", args.procs]
    return flags


def run_steps(args, deadline: float) -> tuple[list[dict], list[dict]]:
    """Every step that fits; (results, skipped)."""
    done, skipped = [], []
    wanted = set(harness.split_list(args.steps)) if args.steps else None
    for workload in harness.split_list(args.workload):
        models = ["mnist_cnn", "fedavg_cnn"] if workload == "W2" else [harness.WORKLOADS[workload]["own_model"]]
        if workload == "W2":
            models = [m for m in models if m in harness.split_list(args.models)]
        for model in models:
            for step in STEPS:
                name, workloads, script, _, _ = step
                if workload not in workloads.split() or (wanted and name not in wanted):
                    continue
                left = deadline - time.time()
                where = {"workload": workload, "model": model, "step": name}
                if left < 5:  # measured, not guessed: the estimates only inform the reader
                    skipped.append({**where, "why": f"the budget is spent ({left:.0f} s left)"})
                    print(f"not run {workload} {model} {name}: the budget is spent")
                    continue
                done.append({**where, **run_step(script, step_flags(args, workload, model, step), left)})
    return done, skipped


def run_step(script: str, flags: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "result.json"
        command = [sys.executable, str(HERE / script), *flags, "--output", str(output)]
        print("$", " ".join(command[1:]), flush=True)
        start = time.time()
        try:
            code = subprocess.run(command, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return {"status": "stopped", "why": f"stopped at the budget's end after {time.time() - start:.0f} s"}
        result = json.loads(output.read_text()) if output.is_file() else {}
    return {"status": "ok" if code == 0 else f"exit status {code}", "seconds": time.time() - start, "result": result}


def summarize(done: list[dict]) -> list[dict]:
    """The side-by-side table (harness.side_by_side), per workload and model in sorted order."""
    ordered = sorted(done, key=lambda d: str((d["workload"], d["model"])))
    return harness.side_by_side([{**d, "what": d["step"]} for d in ordered])


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.time() + args.budget_s
    device = harness.resolved_device(args.device)
    machine = harness.machine_info()
    done, skipped = run_steps(args, deadline)
    rows = summarize(done)
    print("\nSide by side: fedsim's fastest configuration, each baseline; fedsim x = fedsim updates/s / baseline's")
    print(harness.format_table(harness.SIDE_BY_SIDE_COLUMNS, rows))
    if skipped:
        print("\nNot run (the budget was spent)")
        print(
            harness.format_table(
                [("workload", "workload", ""), ("model", "model", ""), ("step", "step", ""), ("why", "why", "")],
                skipped,
            )
        )
    names = [e.get("device_name") for d in done for e in d.get("result", {}).get("entries", [])]
    path = harness.write_results(
        "gpu_all",
        args,
        machine,
        device,
        [{"device_name": n} for n in names if n],
        {"summary": rows, "skipped": skipped, "steps": done},
    )
    print(f"\nwrote {path}")
    return 0 if all(d["status"] == "ok" for d in done) else 1


if __name__ == "__main__":
    sys.exit(main())
