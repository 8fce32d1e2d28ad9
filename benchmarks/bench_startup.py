"""Start-up of `fedsim run` as a user sees it, and of the runs of a sweep.

    python benchmarks/bench_startup.py                              # mnist_seed (W1), 3 repeats each
    python benchmarks/bench_startup.py --source /tmp/old-fedsim     # the same for another copy of fedsim

Every measurement is the command itself, in a fresh process started from an empty directory, one
round long (start-up does not depend on the rounds):

    first line s   from the launch to the first line the command prints
    ready s        from the launch to the start of round 1: when the round's line appears, less the
                   round's own seconds (metrics.csv)
    startup s      summary.json's startup_seconds: from the session's start (config loaded, torch
                   imported) until the data is placed and the workers are ready
    exit s         from the launch to the exit, the one round included

The sweep row runs `fedsim sweep` over three values of local.lr, one round each: its wall time per
run, and the runs' own startup_seconds (the first run's, then the mean of the others).
Prints the tables and writes every number to benchmarks/results/bench_startup-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

COLUMNS = [
    ("what", "what", ""),
    ("W", "workers", "d"),
    ("first line s", "first_line_seconds", ".2f"),
    ("ready s", "ready_seconds", ".2f"),
    ("startup s", "startup_seconds", ".2f"),
    ("exit s", "exit_seconds", ".2f"),
    ("repeats", "repeats", "d"),
]
SWEEP_COLUMNS = [
    ("what", "what", ""),
    ("W", "workers", "d"),
    ("runs", "runs", "d"),
    ("s per run", "seconds_per_run", ".2f"),
    ("startup 1st s", "first_startup_seconds", ".2f"),
    ("startup others s", "other_startup_seconds", ".2f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="4", help="worker counts, comma-separated (default 4, mnist_seed's own)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each; the table shows medians")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--data-root", help="folder holding MNIST/raw (default: $FEDSIM_DATA, else generated data)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    parser.add_argument("--source", help="the folder holding the fedsim package to measure (default: this checkout)")
    parser.add_argument("--no-sweep", action="store_true", help="leave out the sweep")
    parser.add_argument(
        "--output", help="results JSON path (default benchmarks/results/bench_startup-<device>-<time>.json)"
    )
    return parser.parse_args(argv)


def command_env(source: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(source)
    return env


def overrides(args, workers: int) -> list[str]:
    root = args.data_root or os.environ.get("FEDSIM_DATA")
    data = [f"data.root={root}"] if root and (Path(root) / "MNIST" / "raw").is_dir() else ["data.dataset=synthetic"]
    sets = [f"device={args.device}", f"workers={workers}", "rounds=1", *data, *args.set]
    return [flag for item in sets for flag in ("--set", item)]


def time_run(args, source: Path, workers: int) -> dict:
    """One `fedsim run` of mnist_seed, timed line by line from its launch."""
    with tempfile.TemporaryDirectory() as tmp:
        config = source / "experiments" / "mnist_seed.yaml"
        command = [
            sys.executable,
            "-m",
            "fedsim",
            "run",
            str(config),
            "--no-progress",
            "--out",
            "run",
            *overrides(args, workers),
        ]
        start = time.perf_counter()
        process = subprocess.Popen(
            command, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=command_env(source)
        )
        first = round_line = None
        for line in process.stdout:
            now = time.perf_counter() - start
            first = now if first is None else first
            if line.startswith("round 1/"):
                round_line = now
        error = process.stderr.read()
        process.wait()
        exit_seconds = time.perf_counter() - start
        if process.returncode != 0 or round_line is None:
            return {"status": "failed", "message": (error.strip().splitlines() or ["no round line"])[-1]}
        run = Path(tmp) / "run"
        summary = json.loads((run / "summary.json").read_text())
        round_seconds = float((run / "metrics.csv").read_text().splitlines()[1].split(",")[4])
    return {
        "status": "ok",
        "first_line_seconds": first,
        "ready_seconds": round_line - round_seconds,
        "startup_seconds": summary["startup_seconds"],
        "exit_seconds": exit_seconds,
    }


def time_sweep(args, source: Path, workers: int) -> dict:
    """`fedsim sweep` of three one-round runs: wall seconds per run and each run's start-up."""
    values = ["0.01", "0.02", "0.03"]
    with tempfile.TemporaryDirectory() as tmp:
        config = source / "experiments" / "mnist_seed.yaml"
        command = [
            sys.executable,
            "-m",
            "fedsim",
            "sweep",
            str(config),
            "--grid",
            f"local.lr={','.join(values)}",
            "--quiet",
            "--out",
            "sweep",
            *overrides(args, workers),
        ]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, env=command_env(source))
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            return {"status": "failed", "message": (done.stderr.strip().splitlines() or ["?"])[-1]}
        startups = [
            json.loads(path.read_text())["startup_seconds"]
            for path in sorted((Path(tmp) / "sweep").glob("*/summary.json"))
        ]
    return {
        "status": "ok",
        "runs": len(values),
        "seconds_per_run": seconds / len(values),
        "first_startup_seconds": startups[0],
        "other_startup_seconds": statistics.fmean(startups[1:]),
        "startup_seconds_each": startups,
    }


def median_of(measurements: list[dict], keys) -> dict:
    ok = [m for m in measurements if m["status"] == "ok"]
    if not ok:
        return {"status": "failed", "message": measurements[-1].get("message")}
    return {
        "status": "ok",
        "repeats": len(ok),
        **{key: statistics.median(m[key] for m in ok) for key in keys},
        "each": measurements,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    source = Path(args.source).resolve() if args.source else harness.REPO
    device = harness.resolved_device(args.device)
    machine = harness.machine_info()
    runs, sweeps = [], []
    for workers in [int(w) for w in harness.split_list(args.workers)]:
        print(f"fedsim run mnist_seed, workers={workers} ...", end=" ", flush=True)
        timings = [time_run(args, source, workers) for _ in range(args.repeats)]
        runs.append(
            {
                "what": "fedsim run mnist_seed",
                "workers": workers,
                **median_of(timings, ("first_line_seconds", "ready_seconds", "startup_seconds", "exit_seconds")),
            }
        )
        print(f"ready in {runs[-1]['ready_seconds']:.2f} s" if runs[-1]["status"] == "ok" else runs[-1]["message"])
        if not args.no_sweep:
            print(f"fedsim sweep of 3 runs, workers={workers} ...", end=" ", flush=True)
            sweeps.append({"what": "fedsim sweep mnist_seed", "workers": workers, **time_sweep(args, source, workers)})
            print(
                f"{sweeps[-1]['seconds_per_run']:.2f} s per run"
                if sweeps[-1]["status"] == "ok"
                else sweeps[-1]["message"]
            )
    print(f"\nStart-up of fedsim in {source} on {device} (medians of {args.repeats}; see the docstring)")
    print(harness.format_table(COLUMNS, [r for r in runs if r["status"] == "ok"]))
    if sweeps:
        print("\nA sweep of 3 one-round runs")
        print(harness.format_table(SWEEP_COLUMNS, [s for s in sweeps if s["status"] == "ok"]))
    path = harness.write_results(
        "bench_startup", args, machine, device, [], {"source": str(source), "runs": runs, "sweeps": sweeps}
    )
    print(f"\nwrote {path}")
    return 1 if any(e["status"] == "failed" for e in runs + sweeps) else 0


if __name__ == "__main__":
    sys.exit(main())
