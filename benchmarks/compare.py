"""fedsim against the sequential baseline on the same workloads, in one invocation.

    python benchmarks/compare.py                                       # GPU-sized
    python benchmarks/compare.py --size cpu --device cpu --dataloader

For each workload and model, measures fedsim as bench_rounds.py does and then the baseline of
sequential_baseline.py (and, with --dataloader, its DataLoader variant) right after, each run in
a fresh process, so that the two sides of every ratio share the machine's conditions; prints

    ratio = sequential seconds per round / fedsim seconds per round   (above 1: fedsim is faster)

for every fedsim worker count and backend. Writes both sides' numbers and the ratios to
benchmarks/results/compare-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import sys

import bench_rounds
import harness
import sequential_baseline

COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("backend", "backend", ""),
    ("W", "workers", "d"),
    ("fedsim s/round", "fedsim_round_seconds", ".3f"),
    ("seq s/round", "sequential_round_seconds", ".3f"),
    ("ratio", "round_ratio", ".2f"),
    ("loader s/round", "dataloader_round_seconds", ".3f"),
    ("loader ratio", "dataloader_round_ratio", ".2f"),
    ("fedsim run s", "fedsim_run_seconds", ".2f"),
    ("seq run s", "sequential_run_seconds", ".2f"),
    ("run ratio", "run_ratio", ".2f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_workload_arguments(parser)
    parser.add_argument("--workers", help="fedsim worker counts (default as bench_rounds.py)")
    parser.add_argument("--backends", default="process", help="fedsim backends, comma-separated: process, vmap")
    parser.add_argument("--dataloader", action="store_true", help="also run the baseline's DataLoader variant")
    parser.add_argument("--threads", type=int, help="torch CPU threads of the baseline (default: torch's own)")
    return parser.parse_args(argv)


def shared_flags(args) -> list[str]:
    flags = ["--device", args.device, "--size", args.size]
    if args.rounds:
        flags += ["--rounds", str(args.rounds)]
    if args.data_root:
        flags += ["--data-root", args.data_root]
    for item in args.set:
        flags += ["--set", item]
    return flags


def pair(fedsim_entries: list[dict], sequential: dict | None, loader: dict | None) -> list[dict]:
    """One row per measured fedsim configuration, with the baselines beside it."""
    rows = []
    for e in fedsim_entries:
        if e["status"] != "ok":
            continue
        row = {key: e[key] for key in ("workload", "model", "backend", "workers")}
        row["fedsim_round_seconds"], row["fedsim_run_seconds"] = e.get("round_seconds"), e.get("run_call_seconds")
        if sequential and sequential["status"] == "ok":
            row["sequential_round_seconds"] = sequential.get("round_seconds")
            row["sequential_run_seconds"] = sequential.get("run_call_seconds")
            row["round_ratio"] = _ratio(sequential.get("round_seconds"), e.get("round_seconds"))
            row["run_ratio"] = _ratio(sequential.get("run_call_seconds"), e.get("run_call_seconds"))
        if loader and loader["status"] == "ok":
            row["dataloader_round_seconds"] = loader.get("round_seconds")
            row["dataloader_run_seconds"] = loader.get("run_call_seconds")
            row["dataloader_round_ratio"] = _ratio(loader.get("round_seconds"), e.get("round_seconds"))
        rows.append(row)
    return rows


def _ratio(numerator, denominator):
    return numerator / denominator if numerator and denominator else None


def main(argv=None) -> int:
    args = parse_args(argv)
    device = harness.resolved_device(args.device)
    machine = harness.machine_info()
    results = {"fedsim": [], "sequential": [], "dataloader": []}
    rows = []
    for run in harness.workload_runs(args):
        which = ["--workload", run["workload"], "--models", run["model"], *shared_flags(args)]
        fedsim_flags = which + ["--backends", args.backends, "--no-cli"]
        if args.workers:
            fedsim_flags += ["--workers", args.workers]
        baseline_flags = which + (["--threads", str(args.threads)] if args.threads else [])
        fedsim_entries, _ = bench_rounds.measure_all(bench_rounds.parse_args(fedsim_flags), device)
        (sequential,) = sequential_baseline.measure_all(sequential_baseline.parse_args(baseline_flags), device)
        loader = None
        if args.dataloader:
            (loader,) = sequential_baseline.measure_all(
                sequential_baseline.parse_args(baseline_flags + ["--dataloader"]), device
            )
            results["dataloader"].append(loader)
        results["fedsim"] += fedsim_entries
        results["sequential"].append(sequential)
        rows += pair(fedsim_entries, sequential, loader)
    columns = COLUMNS if args.dataloader else [c for c in COLUMNS if "dataloader" not in c[1]]
    print("\nSequential seconds per round / fedsim seconds per round (medians over rounds 2..), same invocation")
    print(harness.format_table(columns, rows))
    path = harness.write_results("compare", args, machine, device, results["fedsim"], {"ratios": rows, **results})
    print(f"\nwrote {path}")
    return 0 if rows and all(r.get("round_ratio") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
