"""Time fedsim's rounds on the benchmark workloads, for each worker count and backend.

    python benchmarks/bench_rounds.py                                  # W1 and W2, GPU-sized
    python benchmarks/bench_rounds.py --size cpu --device cpu          # minutes on 2 cores

Every (workload, model, backend, workers) runs `fedsim.run` in a fresh process; W1 is also
timed through the `fedsim run` command from the moment the command starts. Prints the tables
and writes every number to benchmarks/results/bench_rounds-<device>-<time>.json.
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

SCRIPT = Path(__file__).resolve()

TIMING_COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("backend", "backend", ""),
    ("W", "workers", "d"),
    ("round1 s", "round1_seconds", ".3f"),
    ("s/round", "round_seconds", ".3f"),
    ("interval s", "interval_seconds", ".3f"),
    ("samples/s", "samples_per_second", ",.0f"),
    ("updates/s", "client_updates_per_second", ",.1f"),
    ("train s", "train_seconds", ".3f"),
    ("agg s", "aggregate_seconds", ".3f"),
    ("eval s", "eval_seconds", ".3f"),
    ("overhead", "overhead_fraction", ".1%"),
    ("speedup", "speedup", ".2f"),
    ("eff", "efficiency", ".0%"),
    ("startup s", "startup_seconds", ".2f"),
    ("run s", "run_call_seconds", ".2f"),
    ("acc", "final_test_accuracy", ".4f"),
]
MEMORY_COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("backend", "backend", ""),
    ("W", "workers", "d"),
    ("server peak MB", "server_peak_mb", ".1f"),
    ("worker peak MB", "worker_peak_mb", ".1f"),
]
CLI_COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("backend", "backend", ""),
    ("W", "workers", "d"),
    ("command s", "command_seconds", ".2f"),
    ("startup s", "startup_seconds", ".2f"),
    ("run wall s", "wall_seconds", ".2f"),
    ("acc", "final_test_accuracy", ".4f"),
]
NOTE_COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("backend", "backend", ""),
    ("W", "workers", "d"),
    ("status", "status", ""),
    ("why", "message", ""),
]

# Performance goals on one GPU at --size full: (what, workload, model, key, bound, at most?)
GPU_TARGETS = [
    ("W1 end to end, command (s)", "W1", "mnist_cnn", "cli_command_seconds", 5.0, True),
    ("W1 seconds per round", "W1", "mnist_cnn", "round_seconds", 0.4, True),
    ("W1 start-up (s)", "W1", "mnist_cnn", "startup_seconds", 3.0, True),
    ("W2 seed CNN seconds per round", "W2", "mnist_cnn", "round_seconds", 0.5, True),
    ("W2 McMahan CNN seconds per round", "W2", "fedavg_cnn", "round_seconds", 0.6, True),
    ("W2 seed CNN efficiency at 8 workers", "W2", "mnist_cnn", "efficiency_at_8", 0.7, False),
    ("W2 McMahan CNN efficiency at 8 workers", "W2", "fedavg_cnn", "efficiency_at_8", 0.7, False),
    ("W2 seed CNN overhead fraction", "W2", "mnist_cnn", "overhead_fraction", 0.1, True),
    ("W2 McMahan CNN overhead fraction", "W2", "fedavg_cnn", "overhead_fraction", 0.1, True),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_workload_arguments(parser)
    parser.add_argument("--workers", help="worker counts, comma-separated (default 1,2,4,8,10,16; 1,2 with --size cpu)")
    parser.add_argument("--backends", default="process", help="comma-separated: process, vmap")
    parser.add_argument("--no-cli", action="store_true", help="skip timing W1 through the `fedsim run` command")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- in the child


def measure(spec: dict) -> dict:
    """One fedsim run: its rows, summary and resolved config, and how long `fedsim.run` took."""
    from fedsim.runs.launch import run  # fedsim.run; torch and the engine load here, before the clock starts

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        history = run(spec["config"], out=out, overwrite=True, quiet=True, **spec["overrides"])
        seconds = time.perf_counter() - start
    return {"rows": history.rows, "summary": history.summary, "config": history.config, "run_call_seconds": seconds}


# ----------------------------------------------------------------------------- in the parent


def measure_all(args, device: str) -> tuple[list[dict], list[dict]]:
    """Every (workload, model, backend, workers), and W1 through the command per backend."""
    from fedsim.experiment.validation import load_config

    worker_counts = [int(w) for w in harness.split_list(args.workers or harness.DEFAULT_WORKERS[args.size])]
    entries, commands = [], []
    runs = harness.workload_runs(args)
    configs = [load_config(run["config"], run["overrides"]) for run in runs]
    for run, cfg, train_size in zip(runs, configs, harness.train_sizes(configs)):
        samples = harness.samples_per_round(cfg, train_size)
        for backend in harness.split_list(args.backends):
            done = [measure_one(run, cfg, backend, workers, samples, device) for workers in worker_counts]
            entries += done
            measured = [e["workers"] for e in done if e["status"] == "ok"]
            if run["workload"] == "W1" and measured and not args.no_cli:
                commands.append(measure_command(run, backend, max(measured), device))
    add_scaling(entries)
    return entries, commands


def measure_one(run: dict, cfg, backend: str, workers: int, samples: float, device: str) -> dict:
    """One configuration in a fresh process, or why it was not measured."""
    from fedsim.core.errors import ConfigError
    from fedsim.experiment.validation import load_config

    entry = {
        "workload": run["workload"],
        "model": run["model"],
        "backend": backend,
        "workers": workers,
        "samples_per_round": samples,
    }
    if workers > cfg.clients_per_round:
        return {
            **entry,
            "status": "skipped",
            "message": f"more workers than the {cfg.clients_per_round} clients per round",
        }
    overrides = {**run["overrides"], "backend": backend, "workers": workers}
    try:
        load_config(run["config"], overrides)
    except ConfigError as e:
        return {**entry, "status": "unavailable", "message": str(e)}
    print(f"{run['workload']} {run['model']} {backend} workers={workers} ...", end=" ", flush=True)
    result = harness.run_isolated(SCRIPT, {"config": run["config"], "overrides": overrides}, device)
    entry.update(overrides=overrides, **describe(result, samples))
    print(f"{entry['round_seconds']:.3f} s/round" if entry.get("round_seconds") else entry["status"], flush=True)
    return entry


def measure_command(run: dict, backend: str, workers: int, device: str) -> dict:
    overrides = {**run["overrides"], "backend": backend, "workers": workers}
    print(f"{run['workload']} {run['model']} {backend} workers={workers} via `fedsim run` ...", end=" ", flush=True)
    timing = time_command(run["config"], overrides, device)
    print(f"{timing['command_seconds']:.2f} s" if timing["status"] == "ok" else timing["status"], flush=True)
    return {
        "workload": run["workload"],
        "model": run["model"],
        "backend": backend,
        "workers": workers,
        "overrides": overrides,
        **timing,
    }


def describe(result: dict, samples: float) -> dict:
    """The numbers of one isolated run: round statistics, summary fields, memory."""
    if result["status"] != "ok":
        return {"status": result["status"], "message": result.get("message")}
    summary = result["summary"]
    return {
        "status": "ok",
        **harness.round_statistics(result["rows"], samples),
        "startup_seconds": summary.get("startup_seconds"),
        "wall_seconds": summary.get("wall_seconds"),
        "run_call_seconds": result["run_call_seconds"],
        "final_test_accuracy": summary.get("final_test_accuracy"),
        "rounds": summary.get("rounds"),
        "rounds_to_target": summary.get("rounds_to_target"),
        "workers_ran": summary.get("workers"),
        "backend_ran": summary.get("backend", result["config"].get("backend")),
        "device_name": summary.get("device_name"),
        "worker_peak_mb": max(summary.get("worker_peak_memory_mb") or [0]) or None,
        "server_peak_mb": summary.get("server_peak_memory_mb"),
        **harness.memory_fields(result.get("memory")),
        "summary": summary,
        "rows": result["rows"],
    }


def add_scaling(entries: list[dict]) -> None:
    """Speedup over workers=1 of the same workload, model and backend, and parallel efficiency
    (speedup / workers; 100 % is linear)."""
    base = {
        (e["workload"], e["model"], e["backend"]): e["round_seconds"]
        for e in entries
        if e["workers"] == 1 and e.get("round_seconds")
    }
    for e in entries:
        reference = base.get((e["workload"], e["model"], e["backend"]))
        if reference and e.get("round_seconds"):
            e["speedup"] = reference / e["round_seconds"]
            e["efficiency"] = e["speedup"] / e["workers"]


def time_command(config: str, overrides: dict, device: str) -> dict:
    """`fedsim run` as a user types it, timed from the command's start to its exit."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "fedsim", "run", config, "--quiet", "--out", str(out)]
        command += [f"--set={key}={json.dumps(value)}" for key, value in overrides.items()]
        sampler = harness.MemorySampler(gpu=device == "cuda")
        start = time.perf_counter()
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=harness.child_env()
        )
        sampler.start(process.pid)
        _, error_text = process.communicate()
        seconds = time.perf_counter() - start
        sampler.stop()
        if process.returncode != 0:
            lines = error_text.strip().splitlines()
            return {"status": "failed", "message": lines[-1] if lines else f"exit status {process.returncode}"}
        summary = json.loads((out / "summary.json").read_text())
    return {
        "status": "ok",
        "command": command,
        "command_seconds": seconds,
        "startup_seconds": summary.get("startup_seconds"),
        "wall_seconds": summary.get("wall_seconds"),
        "final_test_accuracy": summary.get("final_test_accuracy"),
        **harness.memory_fields(sampler.report()),
    }


def check_targets(entries: list[dict], commands: list[dict]) -> list[dict]:
    """Each GPU target against the best measured configuration."""
    rows = []
    for what, workload, model, key, bound, at_most in GPU_TARGETS:
        value = _best(entries, commands, workload, model, key)
        met = None if value is None else (value <= bound if at_most else value >= bound)
        rows.append(
            {
                "target": what,
                "measured": value,
                "bound": f"{'<=' if at_most else '>='} {bound:g}",
                "met": {None: "-", True: "yes", False: "NO"}[met],
            }
        )
    return rows


def _best(entries, commands, workload, model, key):
    ok = [e for e in entries if e["workload"] == workload and e["model"] == model and e.get("round_seconds")]
    if key == "cli_command_seconds":
        values = [c["command_seconds"] for c in commands if c["workload"] == workload and c.get("command_seconds")]
        return min(values, default=None)
    if key == "efficiency_at_8":
        return max((e["efficiency"] for e in ok if e["workers"] == 8 and "efficiency" in e), default=None)
    if not ok:
        return None
    fastest = min(ok, key=lambda e: e["round_seconds"])
    return fastest.get(key)


def report(entries: list[dict], commands: list[dict], args, device: str) -> dict:
    """Print the tables; return what goes into the JSON besides the entries."""
    ok = [e for e in entries if e["status"] == "ok"]
    print("\nTiming (medians over rounds 2.., see benchmarks/README.md)")
    print(harness.format_table(TIMING_COLUMNS, ok))
    print("\nMemory: peaks as fedsim reports them, then sampled from outside (see benchmarks/README.md)")
    print(harness.format_table(MEMORY_COLUMNS + harness.memory_columns(device == "cuda"), ok))
    if commands:
        print("\nEnd to end through the `fedsim run` command")
        print(harness.format_table(CLI_COLUMNS + harness.memory_columns(device == "cuda"), commands))
    others = [e for e in entries if e["status"] != "ok"]
    if others:
        print("\nNot measured")
        print(harness.format_table(NOTE_COLUMNS, others))
    extra = {}
    if device == "cuda" and args.size == "full":
        extra["targets"] = check_targets(entries, commands)
        print("\nTargets (best configuration of each)")
        print(
            harness.format_table(
                [("target", "target", ""), ("measured", "measured", ".3f"), ("bound", "bound", ""), ("met", "met", "")],
                extra["targets"],
            )
        )
    return extra


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        harness.child_main(args, measure)
        return 0
    device = harness.resolved_device(args.device)
    machine = harness.machine_info()
    entries, commands = measure_all(args, device)
    extra = report(entries, commands, args, device)
    path = harness.write_results(
        "bench_rounds", args, machine, device, entries, {"entries": entries, "commands": commands, **extra}
    )
    print(f"\nwrote {path}")
    return 1 if any(e["status"] == "failed" for e in entries + commands) else 0


if __name__ == "__main__":
    sys.exit(main())
