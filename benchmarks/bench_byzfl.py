"""ByzFL's benchmark and fedsim's on the same cells: wall times and accuracy tables side by side.

    python benchmarks/bench_byzfl.py                        # 100 steps; gamma 1, 0.33, 0; f 1, 4; TM; 3 attacks
    python benchmarks/bench_byzfl.py --only fedsim --steps 800 --gammas 1,0.66,0.33,0 --f 1,2,3,4 \\
        --rules trimmed_mean,geometric_median --seeds 0,1,2   # ByzFL's whole default grid, fedsim alone
    python benchmarks/bench_byzfl.py --only fedsim --steps 800 --gammas 1,0.66 --f 1,2,3,4 \
        --rules trimmed_mean,geometric_median --seeds 0,1,2 --workers 0 --device cuda --parallel 12 \
        --budget-s 355                                      # GPU call 3: the rows at gamma >= 0.66
    python benchmarks/bench_byzfl.py --from-sweep runs/byzfl-sweep-X --heatmaps docs/figures
        # the cells and heatmaps of sweeps of experiments/robustness/byzfl.yaml already run

ByzFL's side is its own ``run_benchmark`` (byzfl 0.0.11, ``byzfl/benchmark/benchmark.py``) on a
``config.json`` of the cells, in a temporary folder, reading MNIST from the data root
(``--data-root``, else ``$FEDSIM_DATA``), with ``--byzfl-jobs`` cells at a time. fedsim's side is
``fedsim sweep experiments/robustness/byzfl.yaml`` over the same cells (a part of the file's grid),
one sweep per (f, seed), ``--parallel`` of them at a time, each bound to its own share of the
cores (its CPU affinity, which a run's server and workers read as the cores they have);
``--budget-s`` stops them and keeps the runs they finished, and the table counts
each cell's attacks and seeds. Each side is timed from its first launch to its last exit. Both
train on all 60,000 training images (ByzFL's ``size_train_set: 1.0``: its default keeps 20 %
apart to choose learning rates on) and evaluate on the test set every ``--eval-every`` steps.

A cell's accuracy is ByzFL's heatmap figure (``evaluate_results.test_heatmap``): the test
accuracy curves averaged over the seeds, their best evaluation, the worst over the attacks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import harness

REPO = harness.REPO
EXPERIMENT = REPO / "experiments" / "robustness" / "byzfl.yaml"
# fedsim's name (the experiment's rule axis, which also sets the rule's options) -> ByzFL's aggregator entry
RULES = {
    "trimmed_mean": {"name": "TrMean", "parameters": {}},
    "geometric_median": {"name": "GeometricMedian", "parameters": {"nu": 0.1, "T": 3}},
}
ATTACKS = {
    "sign_flip": "SignFlipping",
    "optimal_ipm": "Optimal_InnerProductManipulation",
    "optimal_alie": "Optimal_ALittleIsEnough",
}
BYZFL_GRID = ((1.0, 0.66, 0.33, 0.0), (1, 2, 3, 4))  # its default_config's gammas and f: a heatmap's axes
RUN_MACHINE = ("device", "device_name", "cpus", "torch")  # what a run's summary says of its machine
COLUMNS = [
    ("tool", "tool", ""),
    ("rule", "rule", ""),
    ("gamma", "gamma", ".2f"),
    ("f", "f", "d"),
    ("acc", "accuracy", ".4f"),
    ("worst attack", "worst_attack", ""),
    ("attacks", "attacks", "d"),
    ("seeds", "seeds", "d"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (rounds) per cell (ByzFL's: 800)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (ByzFL's: 50)")
    parser.add_argument("--gammas", default="1,0.33,0", help="gamma similarities, comma-separated")
    parser.add_argument("--f", default="1,4", help="numbers of Byzantine clients, comma-separated")
    parser.add_argument("--rules", default="trimmed_mean", help=f"comma-separated, of: {', '.join(RULES)}")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of: {', '.join(ATTACKS)}")
    parser.add_argument("--seeds", default="0", help="training seeds, comma-separated and consecutive")
    parser.add_argument("--only", choices=["both", "fedsim", "byzfl"], default="both")
    parser.add_argument("--byzfl-jobs", type=int, default=2, help="cells ByzFL trains at once (its nb_jobs)")
    parser.add_argument(
        "--workers", type=int, default=2, help="fedsim's worker processes (0: each run in its sweep's process)"
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="fedsim's sweeps at once: one sweep per (f, seed), N at a time (a GPU machine's cores)",
    )
    parser.add_argument("--device", default="cpu", help="both sides' device (cpu or cuda)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="fedsim's side: stop its sweeps after this many seconds, keeping the runs finished",
    )
    parser.add_argument(
        "--from-sweep", nargs="+", help="fedsim sweep directories to tabulate together, running nothing"
    )
    parser.add_argument("--heatmaps", default=None, help="a folder for each tool's and rule's heatmap (PNG)")
    parser.add_argument("--data-root", default=None, help="the folder holding MNIST/raw (default $FEDSIM_DATA)")
    parser.add_argument("--output", default=None, help="the results JSON (default benchmarks/results/...)")
    return parser.parse_args(argv)


def cells(args) -> dict:
    return {
        "gammas": [float(g) for g in args.gammas.split(",")],
        "f": [int(f) for f in args.f.split(",")],
        "rules": args.rules.split(","),
        "attacks": args.attacks.split(","),
        "seeds": [int(s) for s in args.seeds.split(",")],
    }


def heatmap(curves: dict) -> list[dict]:
    """ByzFL's cell figure from ``{(rule, gamma, f, attack): [curve per seed]}``, with how much of
    the cell ran: its attacks, and the fewest seeds of any of them (a cell of a grid cut short
    may lack some); ``by_attack``, each attack's own figure (the rules x attacks table)."""
    worst: dict = {}
    for (rule, gamma, f, attack), per_seed in curves.items():
        length = min(len(c) for c in per_seed)
        mean = [sum(c[i] for c in per_seed) / len(per_seed) for i in range(length)]
        best = max(mean)
        key = (rule, gamma, f)
        cell = worst.setdefault(
            key, {"accuracy": best, "worst_attack": attack, "attacks": 0, "seeds": len(per_seed), "by_attack": {}}
        )
        if best < cell["accuracy"]:
            cell.update(accuracy=best, worst_attack=attack)
        cell["attacks"] += 1
        cell["seeds"] = min(cell["seeds"], len(per_seed))
        cell["by_attack"][attack] = best
    return [
        {"rule": rule, "gamma": gamma, "f": f, **cell}
        for (rule, gamma, f), cell in sorted(worst.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2]))
    ]


def timed(
    commands: list[list[str]],
    cwd: Path,
    env: dict,
    parallel: int = 1,
    budget_s: float | None = None,
    share_cores: bool = False,
) -> float:
    """Run the commands, ``parallel`` at a time; seconds from the first launch to the last exit.
    The first that fails stops the others and raises with its message. After ``budget_s`` the
    ones still running are stopped and the rest are not started: what they finished stays.
    ``share_cores``: each of the ``parallel`` slots has its own equal share of this process's
    cores, as its CPU affinity (where the platform has one)."""
    start = time.perf_counter()
    waiting, running = list(commands), []
    cores = sorted(os.sched_getaffinity(0)) if share_cores and hasattr(os, "sched_getaffinity") else []
    each = max(1, len(cores) // parallel)
    slots = [set(cores[(i * each) % len(cores) :][:each]) for i in range(parallel)] if cores else []
    try:
        while waiting or running:
            if budget_s is not None and time.perf_counter() - start > budget_s:
                print(f"bench_byzfl: the budget of {budget_s:.0f} s is spent; {len(running)} sweeps stopped, "
                      f"{len(waiting)} not started", flush=True)  # fmt: skip
                break
            while waiting and len(running) < parallel:
                command = waiting.pop(0)
                # a file, not a pipe, which a chatty process could fill and block on; closed when it ends
                log = tempfile.TemporaryFile()  # noqa: SIM115
                free = [slot for slot in slots if all(slot is not r[3] for r in running)]
                bind = (lambda cores=free[0]: os.sched_setaffinity(0, cores)) if free else None
                process = subprocess.Popen(
                    command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=bind
                )
                running.append((command, process, log, free[0] if free else None))
            time.sleep(0.2)
            for command, process, log, slot in [r for r in running if r[1].poll() is not None]:
                running.remove((command, process, log, slot))
                log.seek(0)
                output = log.read().decode(errors="replace").strip()
                log.close()
                if process.returncode != 0:
                    raise RuntimeError(f"{' '.join(command[:4])} ... failed: {output[-800:]}")
    finally:
        for _, process, _, _ in running:
            process.terminate()  # fedsim stops its workers on SIGTERM; SIGKILL would leave them behind
        for _, process, log, _ in running:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- ByzFL


def byzfl_config(grid: dict, args, data_root: str, results: Path) -> dict:
    return {
        "benchmark_config": {
            "training_algorithm": {"name": "DSGD", "parameters": {}},
            "nb_steps": args.steps,
            "device": args.device,
            "training_seed": grid["seeds"][0],
            "nb_training_seeds": len(grid["seeds"]),
            "nb_honest_clients": 10,
            "f": grid["f"],
            "data_distribution_seed": 0,
            "nb_data_distribution_seeds": 1,
            "data_distribution": [{"name": "gamma_similarity_niid", "distribution_parameter": grid["gammas"]}],
            "size_train_set": 1.0,
        },
        "model": {
            "name": "cnn_mnist",
            "dataset_name": "mnist",
            "nb_labels": 10,
            "loss": "NLLLoss",
            "learning_rate": 0.1,
            "learning_rate_decay": 1.0,
            "milestones": [],
        },
        "aggregator": [RULES[rule] for rule in grid["rules"]],
        "pre_aggregators": [{"name": "Clipping", "parameters": {}}, {"name": "NNM", "parameters": {}}],
        "honest_clients": {"momentum": 0.9, "weight_decay": 0.0001, "batch_size": 25},
        "attack": [{"name": ATTACKS[a], "parameters": {}} for a in grid["attacks"]],
        "evaluation_and_results": {
            "evaluation_delta": args.eval_every,
            "batch_size_evaluation": 128,
            "evaluate_on_test": True,
            "store_per_client_metrics": False,
            "store_models": False,
            "data_folder": data_root,
            "results_directory": str(results),
        },
    }


def run_byzfl(grid: dict, args, data_root: str, folder: Path) -> dict:
    results = folder / "results"
    (folder / "config.json").write_text(json.dumps(byzfl_config(grid, args, data_root, results), indent=2))
    code = f"from byzfl.benchmark import run_benchmark; run_benchmark({args.byzfl_jobs})"
    seconds = timed([[sys.executable, "-c", code]], folder, dict(os.environ))
    rule_of = {spec["name"]: rule for rule, spec in RULES.items()}
    attack_of = {name: attack for attack, name in ATTACKS.items()}
    curves: dict = {}
    runs = []  # each run's own time: ByzFL's train_time, its loop from the first step to the last evaluation
    for cell in sorted(p for p in results.iterdir() if (p / "config.json").is_file()):
        config = json.loads((cell / "config.json").read_text())
        bench = config["benchmark_config"]
        key = (
            rule_of[config["aggregator"]["name"]],
            float(bench["data_distribution"]["distribution_parameter"]),
            int(bench["f"]),
            attack_of[config["attack"]["name"]],
        )
        for seed in grid["seeds"]:
            text = (cell / f"test_accuracy_tr_seed_{seed}_dd_seed_0.txt").read_text()
            curves.setdefault(key, []).append([float(x) for x in text.strip().split(",")])
            trained = float((cell / f"train_time_tr_seed_{seed}_dd_seed_0.txt").read_text())
            curve = curves[key][-1]
            runs.append(dict(zip(("rule", "gamma", "f", "attack"), key), seed=seed, seconds=trained, accuracy=curve))
    return {"wall_seconds": seconds, "cells": heatmap(curves), "runs": runs}


# ----------------------------------------------------------------------------- fedsim


def run_fedsim(grid: dict, args, data_root: str, folder: Path) -> dict:
    """``fedsim sweep`` over the cells, cut into one sweep per (f, seed), ``--parallel`` at a time:
    timed from the first launch to the last exit."""
    env = {**os.environ, "FEDSIM_DATA": data_root}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    settings = [
        f"rounds={args.steps}",
        f"eval_every={args.eval_every}",
        f"workers={args.workers}",
        f"device={args.device}",
    ]
    commands = []
    for f in grid["f"]:
        for seed in grid["seeds"]:
            command = [sys.executable, "-m", "fedsim", "sweep", str(EXPERIMENT), "--quiet"]
            command += ["--out", str(folder / f"runs-f{f}-seed{seed}")]
            command += [flag for setting in settings for flag in ("--set", setting)]
            command += ["--grid", f"rule={','.join(grid['rules'])}"]
            command += ["--grid", f"attack.type={','.join(grid['attacks'])}"]
            command += ["--grid", f"attack.count={f}", "--grid", f"data.gamma={','.join(map(str, grid['gammas']))}"]
            commands.append([*command, "--seeds", str(seed)])
    # the cores shared out, as affinity: sweeps whose threads outnumber the cores wait on each other
    seconds = timed(commands, REPO, env, args.parallel, args.budget_s, share_cores=args.parallel > 1)
    return {"wall_seconds": seconds, **sweep_cells(sorted(folder.glob("runs-*")), args.steps)}


def sweep_cells(folders: list[Path], steps: int | None = None) -> dict:
    """The cells of the runs of sweeps of the experiment in ``folders`` (each run a folder), and
    each run's own time, from its first round to its end (summary.json, less its start-up). A run
    that has not reached its last round (``steps``, else its own ``rounds``: one cut short by a
    time limit) is counted apart and left out of the cells."""
    from fedsim.results.history import load_run

    curves: dict = {}
    runs, unfinished = [], 0
    for path in sorted(p.parent for folder in folders for p in Path(folder).glob("*/metrics.csv")):
        history = load_run(path)
        cfg = history.config
        if not history.rows or history.round[-1] < (steps or cfg["rounds"]) or "wall_seconds" not in history.summary:
            unfinished += 1
            continue
        key = (cfg["aggregator"], float(cfg["data"]["gamma"]), int(cfg["attack"]["count"]), cfg["attack"]["type"])
        curves.setdefault(key, []).append(list(history.test_accuracy))
        trained = history.summary["wall_seconds"] - history.summary["startup_seconds"]
        curve = list(history.test_accuracy)
        machine = {k: history.summary.get(k) for k in (*RUN_MACHINE, "load_average")}
        run = dict(zip(("rule", "gamma", "f", "attack"), key), seed=cfg["seed"], seconds=trained, accuracy=curve)
        runs.append({**run, "machine": machine})
    return {"cells": heatmap(curves), "runs": runs, "unfinished_runs": unfinished, "ran_on": ran_on(runs)}


def ran_on(runs: list[dict]) -> list[dict]:
    """The machines the runs ran on, as their summaries record them, each with its number of runs
    and the range of the load averages they ended at."""
    machines: dict = {}
    for run in runs:
        machine = run["machine"]
        entry = machines.setdefault(tuple(machine[k] for k in RUN_MACHINE), {"runs": 0, "loads": []})
        entry["runs"] += 1
        entry["loads"] += [machine["load_average"]] if machine["load_average"] is not None else []
    return [
        {**dict(zip(RUN_MACHINE, key)), "runs": e["runs"], "load_average": _range(e["loads"])}
        for key, e in machines.items()
    ]


def _range(values: list[float]) -> list[float] | None:
    return [min(values), max(values)] if values else None


def attack_table(cells: list[dict]) -> str:
    """The rules x attacks table: one row per cell (rule, gamma, f), one column per attack (ByzFL's
    in its order, then any other)."""
    ran = {a for cell in cells for a in cell["by_attack"]}
    attacks = [a for a in ATTACKS if a in ran] + sorted(ran - set(ATTACKS))
    columns = [("rule", "rule", ""), ("gamma", "gamma", ".2f"), ("f", "f", "d")]
    columns += [(attack, attack, ".4f") for attack in attacks]
    return harness.format_table(columns, [{**cell, **cell["by_attack"]} for cell in cells])


def fullest(cells: list[dict]) -> tuple[int, int]:
    """The attacks and seeds of the fullest of ``cells``: a cell with fewer was not run in full."""
    return max(((c["attacks"], c["seeds"]) for c in cells), default=(0, 0))


def heatmap_rows(
    cells: list[dict], full: tuple[int, int], gammas: Iterable[float] = (), fs: Iterable[int] = ()
) -> tuple[list[float], list[int], list[list[float | None]]]:
    """One rule's heatmap: gamma down and f across (those of ``cells``, and ``gammas`` and ``fs``
    beside them), each value a cell's figure, or None where the cell was not run in full: it has
    fewer than the ``full`` (attacks, seeds) (a grid cut short), since ByzFL's figure is the worst
    attack over all of them."""
    done = {(c["gamma"], c["f"]): c["accuracy"] for c in cells if (c["attacks"], c["seeds"]) == full}
    down = sorted({c["gamma"] for c in cells} | set(gammas), reverse=True)
    across = sorted({c["f"] for c in cells} | set(fs))
    return down, across, [[done.get((g, f)) for f in across] for g in down]


def write_heatmaps(sides: dict, folder: Path, gammas: Iterable[float] = (), fs: Iterable[int] = ()) -> list[Path]:
    """One heatmap per tool and rule, as ByzFL draws its own: gamma down, f across, each cell the
    worst attack's accuracy (``{tool}_{rule}_heatmap.png``); a cell not run in full is grey."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    colours = colormaps["RdYlGn"].with_extremes(bad="0.85")
    written = []
    for tool, side in sides.items():
        full = fullest(side["cells"])
        for rule in dict.fromkeys(cell["rule"] for cell in side["cells"]):
            down, across, rows = heatmap_rows([c for c in side["cells"] if c["rule"] == rule], full, gammas, fs)
            values = np.ma.masked_invalid([[math.nan if v is None else v for v in row] for row in rows])
            fig = Figure(figsize=(max(3.0, 1.0 + 0.7 * len(across)), 1.1 + 0.5 * len(down)), layout="constrained")
            ax = fig.subplots()
            ax.imshow(values, cmap=colours, vmin=0, vmax=1, aspect="auto")
            for i, row in enumerate(rows):
                for j, value in enumerate(row):
                    ax.text(j, i, "–" if value is None else f"{value:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(across)), [str(f) for f in across])
            ax.set_yticks(range(len(down)), [f"{g:g}" for g in down])
            ax.set_xlabel("f (Byzantine clients)")
            ax.set_ylabel("γ")
            title = f"{rule} ({tool}), worst of {full[0]} attacks, {full[1]} seeds"
            if any(v is None for row in rows for v in row):
                title += "\n–: not run in full"
            ax.set_title(title, fontsize=8)
            path = folder / f"{tool}_{rule}_heatmap.png"
            fig.savefig(path, dpi=200)
            written.append(path)
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_sweep:
        side = sweep_cells([Path(folder) for folder in args.from_sweep])
        print(harness.format_table(COLUMNS, [{"tool": "fedsim", **cell} for cell in side["cells"]]))
        if side["unfinished_runs"]:
            print(f"fedsim: {side['unfinished_runs']} runs did not finish and are left out of the cells")
        for machine in side["ran_on"]:
            load = machine["load_average"]
            print(
                f"{machine['runs']} runs ran on {machine['device_name']} ({machine['device']}, "
                f"a {machine['cpus']}-core machine), torch {machine['torch']}"
                + (f", load average {load[0]:g} to {load[1]:g}" if load else "")
            )
        print("\neach attack's figure: the best evaluation of its seeds' mean curve")
        print(attack_table(side["cells"]))
        heatmaps = write_heatmaps({"fedsim": side}, Path(args.heatmaps), *BYZFL_GRID) if args.heatmaps else []
        for path in heatmaps:
            print(f"wrote {path}")
        path = harness.write_results(
            "bench_byzfl", args, harness.machine_info(), "cpu", [], {"sides": {"fedsim": side}}
        )
        print(f"\nwrote {path}")
        return 0
    grid = cells(args)
    data_root = args.data_root or os.environ.get("FEDSIM_DATA")
    if not data_root or not (Path(data_root) / "MNIST" / "raw").is_dir():
        print("bench_byzfl: --data-root (or FEDSIM_DATA) must name a folder holding MNIST/raw", file=sys.stderr)
        return 2
    machine = harness.machine_info()
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tool, run in (("fedsim", run_fedsim), ("byzfl", run_byzfl)):
            if args.only in ("both", tool):
                folder = Path(tmp) / tool
                folder.mkdir()
                sides[tool] = run(grid, args, str(Path(data_root).resolve()), folder)
    rows = [{"tool": tool, **cell} for tool, side in sides.items() for cell in side["cells"]]
    count = len(grid["gammas"]) * len(grid["f"]) * len(grid["rules"]) * len(grid["attacks"]) * len(grid["seeds"])
    print(f"\n{count} runs of {args.steps} steps each (cells x attacks x seeds)")
    print(harness.format_table(COLUMNS, rows))
    for tool, side in sides.items():
        if side.get("unfinished_runs"):
            print(f"{tool}: {side['unfinished_runs']} runs did not finish and are left out of the cells")
    print()
    per_attack = [
        {"tool": tool, "attack": attack, "seconds": sum(times) / len(times), "runs": len(times)}
        for tool, side in sides.items()
        for attack in grid["attacks"]
        if (times := [r["seconds"] for r in side["runs"] if r["attack"] == attack])
    ]
    print("\nmean seconds per run, training and evaluation (no start-up)")
    print(
        harness.format_table(
            [("tool", "tool", ""), ("attack", "attack", ""), ("runs", "runs", "d"), ("s/run", "seconds", ".1f")],
            per_attack,
        )
    )
    print()
    for tool, side in sides.items():
        print(f"{tool}: {side['wall_seconds']:.1f} s from launch to exit")
    if len(sides) == 2:
        print(f"byzfl / fedsim: {sides['byzfl']['wall_seconds'] / sides['fedsim']['wall_seconds']:.2f}x")
    for path in write_heatmaps(sides, Path(args.heatmaps), grid["gammas"], grid["f"]) if args.heatmaps else []:
        print(f"wrote {path}")
    path = harness.write_results("bench_byzfl", args, machine, args.device, [], {"sides": sides, "grid": grid})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
