"""This tree against an older commit, paired and interleaved in one invocation: did rounds get slower?

The older commit (``--base``, default 6afe489) is unpacked with ``git archive`` into a temporary
folder; every run is a fresh process whose PYTHONPATH points at one of the two trees, so each
imports its own ``fedsim``. A pair runs the same workload once on each tree, one right after
the other (which goes first alternates from pair to pair), so that both see the same load; the
ratio of a pair (this tree / the base) is what is reported, as the median and range over the
pairs. The workloads:

    W-A    fedsim run mnist_seed --set data.limit=12000 --set data.partition=iid --set workers=2
           --set rounds=6 --set local.momentum=0.5
    W-B    the same with mnist_fedavg_iid and --set model=mnist_cnn
    scale  a round of 10 clients in a federation of 10^6 (4 generated samples each, an iid split:
           the base has no natural clients of generated data), 6 rounds, a small MLP, 2 workers

Per run it reads the rounds' ``seconds``, ``train_seconds`` and ``eval_seconds`` (metrics.csv, or
every round's row for ``scale``) and ``startup_seconds``, ``wall_seconds`` and
``final_test_accuracy`` (summary.json), and times the process from launch to exit. A round's
figure is the mean over the rounds after the first; ``train`` is its training phase
(``train_seconds``). The accuracies of a pair must be equal (same seed, same numbers): a pair
where they differ is flagged. The 1-minute load average is recorded before every run.

    FEDSIM_DATA=/path/to/datasets python benchmarks/bench_regression.py --pairs 3
    python benchmarks/bench_regression.py --base main --workloads W-A --pairs 5
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 (benchmarks/ is not a package)

REPO = harness.REPO
COMMON = ["data.limit=12000", "data.partition=iid", "workers=2", "rounds=6", "local.momentum=0.5"]
WORKLOADS = {
    "W-A": ["mnist_seed", *COMMON],
    "W-B": ["mnist_fedavg_iid", *COMMON, "model=mnist_cnn"],
    "scale": None,  # run by this script's --child mode, in the tree's own fedsim
}
SCALE_CLIENTS, SCALE_SAMPLES, SCALE_ROUNDS = 1_000_000, 4, 6
COLUMNS = [
    ("workload", "workload", ""),
    ("figure", "figure", ""),
    ("base", "base", ".4f"),
    ("this tree", "this", ".4f"),
    ("ratio median", "median", ".3f"),
    ("min", "min", ".3f"),
    ("max", "max", ".3f"),
]
FIGURES = ("round_seconds", "train_seconds", "startup_seconds", "wall_seconds", "process_seconds")


def unpack(commit: str, into: Path) -> Path:
    """The files of ``commit`` (git archive) under ``into``; the repository itself is left as it is."""
    tar = into / "tree.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(tar), commit], check=True)
    tree = into / "tree"
    with tarfile.open(tar) as archive:
        archive.extractall(tree, filter="data")
    tar.unlink()
    return tree


def tree_env(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    return env


def round_figures(rows: list[dict]) -> dict:
    """The mean over the rounds after the first of a round (scoring apart) and of its training phase."""
    later = rows[1:]
    return {
        "round_seconds": statistics.mean(float(r["seconds"]) - float(r["eval_seconds"]) for r in later),
        "train_seconds": statistics.mean(float(r["train_seconds"]) for r in later),
    }


def run_cli(tree: Path, workload: str, out: Path) -> dict:
    name, *sets = WORKLOADS[workload]
    command = [sys.executable, "-m", "fedsim", "run", name, "--out", str(out), "--quiet"]
    command += [arg for s in sets for arg in ("--set", s)]
    started = time.perf_counter()
    done = subprocess.run(command, env=tree_env(tree), cwd=out.parent, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise RuntimeError(f"{workload} on {tree}: {lines[-1] if lines else done.returncode}")
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    summary = json.loads((out / "summary.json").read_text())
    return {**round_figures(rows), **_summary_figures(summary), "process_seconds": seconds}


def _summary_figures(summary: dict) -> dict:
    return {k: summary.get(k) for k in ("startup_seconds", "wall_seconds", "final_test_accuracy")}


def run_scale(tree: Path, out: Path) -> dict:
    result = out / "result.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), "--child-result", str(result)]
    started = time.perf_counter()
    done = subprocess.run(command, env=tree_env(tree), cwd=out.parent, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0 or not result.is_file():
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"scale on {tree}: {lines[-1] if lines else done.returncode}")
    return {**json.loads(result.read_text()), "process_seconds": seconds}


class RoundRows:
    """Every round's row (metrics.csv keeps the scored ones only); the callback of either tree."""

    def __init__(self):
        self.rows: list[dict] = []

    def on_round_end(self, row: dict, *_) -> None:
        self.rows.append(row)


def scale_child(out: str, result: str) -> None:
    """In a fresh process of one tree: a federation of SCALE_CLIENTS clients run for SCALE_ROUNDS."""
    import torch

    import fedsim
    from fedsim.data import Dataset

    g = torch.Generator().manual_seed(0)
    n = SCALE_CLIENTS * SCALE_SAMPLES
    labels = torch.randint(0, 10, (n,), generator=g)
    centres = torch.randn(10, 16, generator=g) * 2
    x = centres[labels] + torch.randn(n, 16, generator=g)
    data = Dataset(x, labels, x[:10_000].clone(), labels[:10_000].clone(), 10, "generated")
    config = {
        "name": "scale",
        "seed": 0,
        "rounds": SCALE_ROUNDS,
        "clients_per_round": 10,
        "device": "cpu",
        "workers": 2,
        "model": _small_mlp,
        "eval_every": SCALE_ROUNDS,
        "data": {"dataset": data, "partition": "iid", "num_clients": SCALE_CLIENTS},
        "local": {"epochs": 1, "batch_size": SCALE_SAMPLES, "lr": 0.1},
    }
    rounds = RoundRows()
    history = fedsim.run(config, out=Path(out) / "run", quiet=True, callbacks=[rounds])
    figures = {**round_figures(rounds.rows), **_summary_figures(history.summary)}
    Path(result).write_text(json.dumps(figures))


def _small_mlp(input_shape, num_classes):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(input_shape[0], 32), torch.nn.ReLU(), torch.nn.Linear(32, num_classes))


def measure(tree: Path, workload: str, out: Path) -> dict:
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    figures = run_scale(tree, out) if workload == "scale" else run_cli(tree, workload, out)
    return {**figures, "load_average": load}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="6afe489", help="the older commit (default 6afe489)")
    parser.add_argument("--pairs", type=int, default=3, help="paired runs of each workload")
    parser.add_argument("--workloads", default="W-A,W-B,scale", help="comma-separated: W-A, W-B, scale")
    parser.add_argument("--output", help="results JSON (default benchmarks/results/bench_regression-cpu-<time>.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the scale run's folder, in a fresh process
    parser.add_argument("--child-result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        scale_child(args.child, args.child_result)
        return
    workloads = args.workloads.split(",")
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; choose among {', '.join(WORKLOADS)}")
    if args.pairs < 1:
        parser.error("--pairs: at least 1")
    machine = harness.machine_info()
    base_commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", args.base], check=True, capture_output=True, text=True
    ).stdout.strip()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": unpack(base_commit, Path(tmp)), "this": REPO}
        for pair in range(args.pairs):
            for workload in workloads:
                order = ["base", "this"] if pair % 2 == 0 else ["this", "base"]
                for side in order:
                    out = Path(tmp) / f"{workload}-{pair}-{side}"
                    out.mkdir()
                    figures = measure(trees[side], workload, out / "run")
                    runs.append({"pair": pair, "workload": workload, "side": side, **figures})
                    print(
                        f"pair {pair + 1} {workload} {side}: round {figures['round_seconds']:.4f} s, "
                        f"train {figures['train_seconds']:.4f} s, load {figures['load_average']}",
                        flush=True,
                    )
    rows, mismatched = paired(runs, workloads)
    print(
        f"\nthis tree / {args.base} ({base_commit[:10]}), {args.pairs} pair(s); means over the pairs beside the ratios"
    )
    print(harness.format_table(COLUMNS, rows))
    for workload, pair in mismatched:
        print(f"{workload}, pair {pair + 1}: the final accuracies differ")
    loads = [r["load_average"] for r in runs if r["load_average"] is not None]
    if loads:
        print(f"1-minute load average before the runs: {min(loads)} to {max(loads)}")
    payload = {"base": base_commit, "runs": runs, "ratios": rows, "accuracy_mismatches": mismatched}
    path = harness.write_results("bench_regression", args, machine, "cpu", [], payload)
    print(f"wrote {path}")


def paired(runs: list[dict], workloads: list[str]) -> tuple[list[dict], list[tuple[str, int]]]:
    """Per workload and figure: both sides' means and the pairs' ratios (this / base); the pairs
    whose final accuracies differ."""
    rows, mismatched = [], []
    for workload in workloads:
        pairs = {}
        for r in runs:
            if r["workload"] == workload:
                pairs.setdefault(r["pair"], {})[r["side"]] = r
        for pair, sides in sorted(pairs.items()):
            if sides["base"]["final_test_accuracy"] != sides["this"]["final_test_accuracy"]:
                mismatched.append((workload, pair))
        for figure in FIGURES:
            ratios = [s["this"][figure] / s["base"][figure] for s in pairs.values() if s["base"][figure]]
            if not ratios:
                continue
            rows.append(
                {
                    "workload": workload,
                    "figure": figure.removesuffix("_seconds"),
                    "base": statistics.mean(s["base"][figure] for s in pairs.values()),
                    "this": statistics.mean(s["this"][figure] for s in pairs.values()),
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                    "ratios": ratios,
                }
            )
    return rows, mismatched


if __name__ == "__main__":
    main()
