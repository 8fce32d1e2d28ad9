"""What the benchmark scripts share: the workloads, one fresh process per measurement, memory
sampling from outside, per-round statistics, fixed-width tables and the results JSON.

Every measurement runs in a fresh Python process. A process's peak memory (the CUDA
allocator's peak, or the peak resident set size) only ever grows, and cuDNN and the CUDA
caching allocator stay warm, so a second run in the same process would report the first
run's peaks and an unrealistically cheap first round. The parent stays small (it never loads
a dataset): Linux carries a process's resident size across fork and exec into the child's
peak-RSS counter (getrusage's ru_maxrss), so a large parent would inflate its children's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"

# From a checkout without `pip install -e .`, fedsim is importable only from the repository root.
if importlib.util.find_spec("fedsim") is None:
    sys.path.insert(0, str(REPO))

MODELS = ("mnist_cnn", "fedavg_cnn")

# W1 is the default experiment (mnist_seed.yaml) with its own model; W2 runs with each model named by --models.
WORKLOADS = {
    "W1": {"config": REPO / "experiments" / "mnist_seed.yaml", "own_model": "mnist_cnn"},
    "W2": {"config": REPO / "experiments" / "mnist_fedavg_iid.yaml", "own_model": None},
    "W3": {"config": REPO / "benchmarks" / "w3_cifar10.yaml", "own_model": "pfl_cnn"},
}
# W3 reads CIFAR-10 where the data root holds it, else these generated CIFAR-shaped tensors.
# (benchmarks/w3data.py, importable as `w3data` from this folder and in the children, see child_env)
W3_GENERATED = {"full": "w3data:cifar_shaped", "cpu": "w3data:cifar_shaped_small"}

# Overrides per --size. `cpu` keeps each workload's shape (partition, E, B, lr) but trains on
# 12,000 samples, and W2 samples 4 clients a round, so that 2 cores finish in minutes; W3 keeps
# clients of 50 images but has 100 of them (5,000 images), 10 a round, 4 rounds, evaluating every
# 2nd on 1,000 test images.
SIZES = {
    "full": {"W1": {}, "W2": {"rounds": 5}, "W3": {}},
    "cpu": {
        "W1": {"data.limit": 12000},
        "W2": {"data.limit": 12000, "clients_per_round": 4, "rounds": 3},
        "W3": {"data.limit": 5000, "data.num_clients": 100, "clients_per_round": 10, "rounds": 4, "eval_every": 2},
    },
}
DEFAULT_WORKERS = {"full": "1,2,4,8,10,16", "cpu": "1,2"}


# ----------------------------------------------------------------------------- command line


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every script shares."""
    parser.add_argument("--workload", default="W1,W2", help="comma-separated: W1, W2, W3 (default W1,W2)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help="models for W2, comma-separated (W1 always runs its own mnist_cnn)"
    )
    parser.add_argument("--rounds", type=int, help="rounds per run (default: 3 for W1, 5 for W2; 3 with --size cpu)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--size",
        default="full",
        choices=tuple(SIZES),
        help="full: the experiments as written; cpu: smaller variants for a few CPU cores",
    )
    parser.add_argument("--data-root", help="folder holding MNIST/raw (default: $FEDSIM_DATA, else datasets/)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run, e.g. --set data.dataset=synthetic",
    )
    parser.add_argument("--output", help="results JSON path (default benchmarks/results/<name>-<device>-<time>.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON spec of one measurement
    parser.add_argument("--child-result", help=argparse.SUPPRESS)


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def workload_runs(args) -> list[dict]:
    """(workload, model, config path, overrides) for every workload and model asked for."""
    from fedsim.experiment.config import parse_override

    extra = dict(parse_override(item) for item in args.set)
    runs = []
    for workload in split_list(args.workload):
        if workload not in WORKLOADS:
            raise SystemExit(f"--workload: unknown {workload!r}; choose from {', '.join(WORKLOADS)}")
        spec = WORKLOADS[workload]
        models = [spec["own_model"]] if spec["own_model"] else split_list(args.models)
        for model in models:
            overrides = {**SIZES[args.size][workload], "model": model, "device": args.device}
            if args.rounds:
                overrides["rounds"] = args.rounds
            if args.data_root:
                overrides["data.root"] = args.data_root
            if workload == "W3":
                overrides["data.dataset"] = w3_dataset(args.data_root, args.size)
            overrides.update(extra)
            runs.append({"workload": workload, "model": model, "config": str(spec["config"]), "overrides": overrides})
    return runs


def w3_dataset(data_root: str | None, size: str) -> str:
    """cifar10 where the data root holds its files, else generated CIFAR-shaped tensors."""
    from fedsim.experiment.config import default_data_root

    root = Path(data_root or default_data_root())
    return "cifar10" if (root / "cifar-10-batches-py" / "test_batch").is_file() else W3_GENERATED[size]


def resolved_device(name: str) -> str:
    """cpu or cuda, without creating a CUDA context in this process."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- isolated runs


def report_entries(
    name: str,
    title: str,
    columns: list,
    args,
    device: str,
    machine: dict,
    entries: list[dict],
    what=lambda e: f"{e['workload']} {e['model']}",
) -> int:
    """Print a script's entries as one table (and each failure in a line), write them as JSON
    with ``machine`` (machine_info() from before the measurements); the script's exit status: 1
    if any failed."""
    print(f"\n{title}")
    print(format_table(columns + memory_columns(device == "cuda"), [e for e in entries if e["status"] == "ok"]))
    for e in entries:
        if e["status"] != "ok":
            print(f"{what(e)}: {e['status']}: {e.get('message')}")
    path = write_results(name, args, machine, device, entries, {"entries": entries})
    print(f"\nwrote {path}")
    return 1 if any(e["status"] == "failed" for e in entries) else 0


def child_main(args, measure) -> None:
    """In the fresh process: run one measurement and write its result for the parent."""
    from fedsim.core.errors import ConfigError, FedsimError

    spec = json.loads(args.child)
    try:
        result = {"status": "ok", **measure(spec)}
    except ConfigError as e:
        result = {"status": "unavailable", "message": str(e)}
    except FedsimError as e:
        result = {"status": "failed", "message": str(e)}
    Path(args.child_result).write_text(json.dumps(result))


def run_isolated(script: Path, spec: dict, device: str, sample_memory: bool = True) -> dict:
    """Run ``script --child spec`` in a fresh process; its result, plus the memory of the
    process and its children as sampled from outside (see MemorySampler) unless not
    ``sample_memory``: reading every process's PSS four times a second slows what it reads, so
    a benchmark of time alone leaves it out."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        command = [sys.executable, str(script), "--child", json.dumps(spec), "--child-result", str(result_path)]
        sampler = MemorySampler(gpu=device == "cuda") if sample_memory else None
        with open(Path(tmp) / "stderr", "w+") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=child_env())
            if sampler:
                sampler.start(process.pid)
            process.wait()
            if sampler:
                sampler.stop()
            stderr.seek(0)
            error_text = stderr.read()
        if process.returncode != 0 or not result_path.is_file():
            lines = [line for line in error_text.splitlines() if line.strip()]
            return {"status": "failed", "message": lines[-1] if lines else f"exit status {process.returncode}"}
        result = json.loads(result_path.read_text())
    if sampler:
        result["memory"] = sampler.report()
    return result


def child_env() -> dict:
    """The environment of a child process: this one, with the repository and this folder importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH")]))
    return env


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants, read from /proc; multiprocessing's resource tracker
    (a helper process, not a worker) is left out."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if b"resource_tracker" in (entry / "cmdline").read_bytes():
                continue
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [root], [root]
    while frontier:
        frontier = [c for pid in frontier for c in children.get(pid, [])]
        tree += frontier
    return tree


def _proc_kib(path: str, field: str) -> float | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


class MemorySampler:
    """Samples the memory of a process tree from outside, in a background thread.

    Host memory: each process's peak resident set (VmHWM in /proc/PID/status; unlike
    getrusage's ru_maxrss it starts afresh at exec, so a worker's does not include the size of
    the server it was spawned from), and the tree's proportional set size (PSS, from
    /proc/PID/smaps_rollup), which counts the shared dataset and buffers once rather than once
    per process. With ``gpu``, also ``nvidia-smi``'s used
    memory per process, which includes each process's CUDA context and the caching
    allocator's reserve (the allocator peaks that fedsim reports leave both out). The root is
    the server, its descendants the workers. Inside a container with its own PID namespace
    nvidia-smi reports host PIDs that match nothing here; their memory is then reported as
    unmatched, and the whole device's used memory is always recorded.
    """

    INTERVAL = 0.25  # seconds between samples

    def __init__(self, gpu: bool):
        self.gpu = gpu and shutil.which("nvidia-smi") is not None
        self.rss: dict[int, float] = {}
        self.gpu_used: dict[int, float] = {}
        self.pss_total = self.gpu_total = self.gpu_unmatched = self.device_used = 0.0
        self.samples = 0
        self.root = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self, root: int) -> None:
        self.root = root
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            tree = process_tree(self.root)
            self._sample_host(tree)
            if self.gpu:
                self._sample_gpu(set(tree))
            self.samples += 1
            self._stop.wait(self.INTERVAL)

    def _sample_host(self, tree: list[int]) -> None:
        pss = 0.0
        for pid in tree:
            rss = _proc_kib(f"/proc/{pid}/status", "VmHWM:")  # the kernel's own peak of this process
            if rss is not None:
                self.rss[pid] = max(self.rss.get(pid, 0.0), rss / 1024)
            pss += (_proc_kib(f"/proc/{pid}/smaps_rollup", "Pss:") or 0.0) / 1024
        self.pss_total = max(self.pss_total, pss)

    def _sample_gpu(self, tree: set[int]) -> None:
        apps = _nvidia_smi("--query-compute-apps=pid,used_memory")
        device = _nvidia_smi("--query-gpu=memory.used")
        if apps is None or device is None:
            return
        mine = unmatched = 0.0
        for pid, used in _numbers(apps):
            pid = int(pid)
            if pid in tree:
                self.gpu_used[pid] = max(self.gpu_used.get(pid, 0.0), used)
                mine += used
            else:
                unmatched += used
        self.gpu_total = max(self.gpu_total, mine)
        self.gpu_unmatched = max(self.gpu_unmatched, unmatched)
        self.device_used = max(self.device_used, sum(row[0] for row in _numbers(device)))

    def report(self) -> dict:
        """Peaks in MiB: per process (server, then workers by PID) and for the whole tree."""

        def split(peaks):
            return peaks.get(self.root), [peaks[pid] for pid in sorted(peaks) if pid != self.root]

        server_rss, worker_rss = split(self.rss)
        report = {
            "samples": self.samples,
            "server_rss_mb": server_rss,
            "worker_rss_mb": worker_rss,
            "total_pss_mb": self.pss_total or None,
        }
        if self.gpu:
            server_gpu, worker_gpu = split(self.gpu_used)
            report.update(
                server_gpu_mb=server_gpu,
                worker_gpu_mb=worker_gpu,
                total_gpu_mb=self.gpu_total or None,
                unmatched_gpu_mb=self.gpu_unmatched,
                device_used_mb=self.device_used,
            )
        return report


def _numbers(rows: list[list[str]]) -> list[list[float]]:
    """Rows of nvidia-smi values as numbers; rows holding '[N/A]' (e.g. under MIG) are left out."""
    numeric = []
    for row in rows:
        try:
            numeric.append([float(cell) for cell in row])
        except ValueError:
            continue
    return numeric


def _nvidia_smi(query: str) -> list[list[str]] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- statistics


def round_statistics(rows: list[dict], samples_per_round: float) -> dict:
    """Medians over the rounds after the first (the first pays for warm-up), and round 1 alone.

    ``interval`` is the time between the ends of consecutive rounds: the round itself plus
    what the loop does between rounds (checkpoint, metrics file, log line).
    """
    if not rows:
        return {}
    later = rows[1:]
    stats = {"round1_seconds": rows[0]["seconds"], "measured_rounds": len(later)}
    if not later:
        return stats
    median = statistics.median
    seconds = median([r["seconds"] for r in later])
    stats.update(
        round_seconds=seconds,
        interval_seconds=median([b["elapsed_seconds"] - a["elapsed_seconds"] for a, b in zip(rows, rows[1:])]),
        samples_per_second=samples_per_round / seconds if seconds > 0 else None,
        train_seconds=median([r["train_seconds"] for r in later]),
        aggregate_seconds=median([r["aggregate_seconds"] for r in later]),
        eval_seconds=median([r["eval_seconds"] for r in later]),
        # time outside local training: fedsim's busiest worker trains for worker_seconds of the
        # round; the sequential baseline has no workers, so its whole training phase counts
        overhead_fraction=median(
            [1 - r.get("worker_seconds", r["train_seconds"]) / r["seconds"] for r in later if r["seconds"] > 0]
        ),
        mean_round_seconds=sum(r["seconds"] for r in later) / len(later),
    )
    if all(r.get("clients") for r in later):
        # client updates over the rounds after the first, evaluation rounds included
        stats["client_updates_per_second"] = sum(r["clients"] for r in later) / sum(r["seconds"] for r in later)
    if all("worker_seconds" in r for r in later):
        stats["worker_seconds"] = median([r["worker_seconds"] for r in later])
    return stats


def samples_per_round(cfg, train_size: int) -> float:
    """Samples one round trains: clients x mean client size x epochs."""
    return cfg.clients_per_round * train_size / cfg.data.num_clients * cfg.local.epochs


def train_sizes(configs: list) -> list[int]:
    """Training samples of each config's dataset, counted in a throwaway process: loading a
    dataset here would make this process large, and its children would inherit that size."""
    keys = [(c.data.dataset, c.data.root, c.data.limit, c.data.download) for c in configs]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.starmap(_count_train_samples, keys)


def _count_train_samples(dataset: str, root: str, limit, download: bool) -> int:
    from fedsim.data import load_dataset

    return len(load_dataset(dataset, root, limit, download).train_y)


def memory_columns(gpu: bool) -> list[tuple[str, str, str]]:
    """Columns of the sampled memory (see MemorySampler) for a table."""
    columns = [
        ("RSS server MB", "rss_server_mb", ".0f"),
        ("RSS worker MB", "rss_worker_mb", ".0f"),
        ("PSS total MB", "pss_total_mb", ".0f"),
    ]
    if gpu:
        columns += [
            ("GPU server MB", "gpu_server_mb", ".0f"),
            ("GPU worker MB", "gpu_worker_mb", ".0f"),
            ("GPU total MB", "gpu_total_mb", ".0f"),
        ]
    return columns


def memory_fields(report: dict | None) -> dict:
    """The sampled peaks as table fields; a worker column holds the largest worker."""
    report = report or {}
    return {
        "rss_server_mb": report.get("server_rss_mb"),
        "rss_worker_mb": max(report.get("worker_rss_mb") or [0]) or None,
        "pss_total_mb": report.get("total_pss_mb"),
        "gpu_server_mb": report.get("server_gpu_mb"),
        "gpu_worker_mb": max(report.get("worker_gpu_mb") or [0]) or None,
        "gpu_total_mb": report.get("total_gpu_mb"),
        "memory": report or None,
    }


# ----------------------------------------------------------------------------- output


def in_turns(sides: dict, repeats: int) -> dict:
    """Each side (a callable of no argument) called in turn, ``repeats`` times: its seconds each
    time, so that both sides see the same load."""
    times: dict = {name: [] for name in sides}
    for _ in range(repeats):
        for name, side in sides.items():
            start = time.perf_counter()
            side()
            times[name].append(time.perf_counter() - start)
    return times


def machine_info() -> dict:
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "usable_cores": cores,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "load_average_start": _load_average(),
    }


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def write_results(name: str, args, machine: dict, device: str, ran: list[dict], payload: dict) -> Path:
    """Write the results JSON, ``args.output`` or benchmarks/results/<name>-<device>-<time>.json:
    the command line, the machine (with the device, the name of the one the entries in ``ran``
    report, and the load average at the end), the options, then ``payload``."""
    names = [e["device_name"] for e in ran if e.get("device_name")]
    machine["device"], machine["device_name"] = device, names[0] if names else device
    machine["load_average_end"] = _load_average()
    payload = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine,
        "options": vars(args),
        **payload,
    }
    if args.output:
        path = Path(args.output)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        slug = re.sub(r"[^a-z0-9]+", "-", (machine["device_name"] if device == "cuda" else "cpu").lower()).strip("-")
        path = RESULTS_DIR / f"{name}-{slug}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def format_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """A fixed-width table; ``columns`` are (header, key, format spec). Columns without a
    format spec hold names and are left-aligned; numbers are right-aligned; missing values
    print as '-'."""

    def cell(row, key, spec):
        value = row.get(key)
        if value is None or value == "":
            return "-"
        return format(value, spec) if spec else str(value)

    cells = [[cell(row, key, spec) for _, key, spec in columns] for row in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells]) for i, (header, _, _) in enumerate(columns)]

    def line(values):
        return "  ".join(
            v.rjust(w) if spec else v.ljust(w) for v, w, (_, _, spec) in zip(values, widths, columns)
        ).rstrip()

    header = line([h for h, _, _ in columns])
    return "\n".join([header, "-" * len(header)] + [line(values) for values in cells])


# the side-by-side table of gpu_all.py and gpu/calls.py: fedsim's fastest configuration and each
# baseline per workload and model, with fedsim's client updates per second over the baseline's
SIDE_BY_SIDE_COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("what", "what", ""),
    ("config", "config", ""),
    ("s/round", "round_seconds", ".3f"),
    ("updates/s", "client_updates_per_second", ",.1f"),
    ("fedsim x", "ratio", ".2f"),
    ("acc", "final_test_accuracy", ".4f"),
]
SIDE_BY_SIDE_NUMBERS = (
    "round_seconds",
    "client_updates_per_second",
    "final_test_accuracy",
    "gpu_worker_mb",
    "gpu_total_mb",
)


def side_by_side(records: list[dict]) -> list[dict]:
    """Per workload and model, in the records' order: fedsim's fastest configuration, then each
    baseline with fedsim's ratio to it. A record names its step in ``what`` (fedsim's start with
    "fedsim") and holds the step's ``status`` and the benchmark's JSON in ``result``."""
    rows = []
    for workload, model in dict.fromkeys((r["workload"], r["model"]) for r in records if r.get("workload")):
        mine = [r for r in records if (r.get("workload"), r.get("model")) == (workload, model)]
        best = _fastest([e for r in mine if r["what"].startswith("fedsim") for e in _entries(r)])
        if best:
            config = f"{best.get('backend')} W={best.get('workers')}"
            rows.append({"workload": workload, "model": model, "what": "fedsim", "config": config, **_side(best)})
        for record in (r for r in mine if not r["what"].startswith("fedsim")):
            other = _fastest(_entries(record))
            if other is None:
                rows.append({"workload": workload, "model": model, "what": record["what"], "config": record["status"]})
                continue
            config = f"procs={other['procs']}" if "procs" in other else other.get("mode", "")
            row = {"workload": workload, "model": model, "what": record["what"], "config": config, **_side(other)}
            if best:
                row["ratio"] = best["client_updates_per_second"] / other["client_updates_per_second"]
            rows.append(row)
    return rows


def _entries(record: dict) -> list[dict]:
    return [e for e in record.get("result", {}).get("entries", []) if e.get("client_updates_per_second")]


def _fastest(candidates: list[dict]) -> dict | None:
    return max(candidates, key=lambda e: e["client_updates_per_second"], default=None)


def _side(entry: dict) -> dict:
    return {key: entry.get(key) for key in SIDE_BY_SIDE_NUMBERS}
