"""A fedsim command alone on the machine and beside busy processes, as a run shares a machine
with another run, a notebook or a build.

    python benchmarks/bench_sharing.py                              # this checkout, 0 and 2 busy processes
    python benchmarks/bench_sharing.py --source /tmp/old-fedsim     # and another copy, in turns
    python benchmarks/bench_sharing.py --set rounds=1               # a change to every workload's file

A busy process is a Python loop that never waits, as another job's computing is. Each command runs
in a fresh process from an empty folder, timed from its launch to its exit, with the environment
less OMP_WAIT_POLICY and GOMP_SPINCOUNT, so that each copy of fedsim waits for OpenMP work as it
does by default; the sides run in turns at each number of busy processes, so that they see the
same load. Workloads:

    quickstart   `fedsim run mnist_seed` (its 4 workers, 3 rounds)
    byzfl        ByzFL's benchmark file, 10 rounds of sign flipping against f = 4, `workers=0`

Both read MNIST under --data-root or $FEDSIM_DATA, else the generated dataset. Prints the table and
writes every time to benchmarks/results/bench_sharing-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

WORKLOADS = {
    "quickstart": ("mnist_seed.yaml", []),
    "byzfl": (
        "robustness/byzfl.yaml",
        ["rounds=10", "eval_every=10", "attack.type=sign_flip", "attack.count=4", "workers=0"],
    ),
}
COLUMNS = [
    ("workload", "workload", ""),
    ("fedsim", "side", ""),
    ("busy", "busy", "d"),
    ("median s", "median_seconds", ".2f"),
    ("min s", "min_seconds", ".2f"),
    ("max s", "max_seconds", ".2f"),
    ("x alone", "to_alone", ".2f"),
    ("x other", "to_other", ".2f"),
]
BUSY = [sys.executable, "-c", "while True: pass"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--busy", default=f"0,{os.cpu_count() or 1}", help="busy processes beside, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each side; the table shows medians")
    parser.add_argument("--source", help="another folder holding a fedsim package, timed in turns with this checkout")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a change to every workload")
    parser.add_argument("--data-root", help="folder holding MNIST/raw (default: $FEDSIM_DATA, else generated data)")
    parser.add_argument("--output", help="results JSON path (default benchmarks/results/bench_sharing-cpu-<time>.json)")
    return parser.parse_args(argv)


def command(args, source: Path, workload: str) -> list[str]:
    config, sets = WORKLOADS[workload]
    root = args.data_root or os.environ.get("FEDSIM_DATA")
    data = [f"data.root={root}"] if root and (Path(root) / "MNIST" / "raw").is_dir() else ["data.dataset=synthetic"]
    flags = [flag for item in ["device=cpu", *data, *sets, *args.set] for flag in ("--set", item)]
    return [
        sys.executable,
        "-m",
        "fedsim",
        "run",
        str(source / "experiments" / config),
        "--quiet",
        "--out",
        "run",
        *flags,
    ]


def environment(source: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(source)
    return env


def timed(args, source: Path, workload: str) -> float:
    """Seconds from the launch of the command to its exit."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        done = subprocess.run(
            command(args, source, workload), cwd=tmp, capture_output=True, text=True, env=environment(source)
        )
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{workload} failed in {source}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return seconds


def beside(count: int, measure):
    """``measure()`` with ``count`` busy processes running, stopped afterwards."""
    busy = [subprocess.Popen(BUSY) for _ in range(count)]
    try:
        return measure()
    finally:
        for process in busy:
            process.kill()
            process.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    sources = {"this": harness.REPO}
    if args.source:
        sources["other"] = Path(args.source).resolve()
    machine = harness.machine_info()
    rows = []
    for workload in harness.split_list(args.workloads):
        for count in [int(b) for b in harness.split_list(args.busy)]:
            print(f"{workload} beside {count} busy processes ...", flush=True)
            sides = {name: functools.partial(timed, args, source, workload) for name, source in sources.items()}
            times = beside(count, functools.partial(harness.in_turns, sides, args.repeats))
            for name, seconds in times.items():
                rows.append(
                    {
                        "workload": workload,
                        "side": name,
                        "source": str(sources[name]),
                        "busy": count,
                        "median_seconds": statistics.median(seconds),
                        "min_seconds": min(seconds),
                        "max_seconds": max(seconds),
                        "seconds": seconds,
                    }
                )
    for row in rows:
        alone = [r for r in rows if (r["workload"], r["side"], r["busy"]) == (row["workload"], row["side"], 0)]
        other = [
            r
            for r in rows
            if (r["workload"], r["busy"]) == (row["workload"], row["busy"]) and r["side"] == "other" != row["side"]
        ]
        row["to_alone"] = row["median_seconds"] / alone[0]["median_seconds"] if alone else None
        row["to_other"] = row["median_seconds"] / other[0]["median_seconds"] if other else None
    print(
        f"\nLaunch to exit, medians of {args.repeats} in turns ({', '.join(f'{k}: {v}' for k, v in sources.items())})"
    )
    print(harness.format_table(COLUMNS, rows))
    path = harness.write_results("bench_sharing", args, machine, "cpu", [], {"rows": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
