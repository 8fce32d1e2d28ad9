"""How fedsim scales with the number of clients: federations of 10^3 to 10^6 natural clients.

StackOverflow, the largest federated benchmark in common use, has 342,477 clients. This builds
generated federated datasets whose samples each name their own client (as FEMNIST's writers or
Shakespeare's roles do), with ``--samples`` samples per client, and runs a few FedAvg rounds of
``data.partition: natural`` on each through ``fedsim.run``, ``--per-round`` clients a round, each
size in a fresh process (see harness.py: peaks do not carry over, and every size starts its own
workers). It reports, per size: the time to build the dataset (generation, not fedsim's),
fedsim's start-up (``startup_seconds``: the federation split, the model, the buffers, the
workers ready), the mean seconds of the rounds after the first without their scoring (``seconds``
less ``eval_seconds``: the last round scores the whole test set), its ratio to the smallest
size's, and the peak memory of the server process and of the largest worker. What should hold:
the time per round and the workers' memory flat in the number of clients (a round touches
``--per-round`` of them), the server's memory and the start-up growing at most linearly (one
index per sample, one offset per client).

    python benchmarks/bench_scale.py                       # 10^3, 10^4, 10^5, 10^6 clients
    python benchmarks/bench_scale.py --clients 10000,1000000 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 (benchmarks/ is not a package)

import fedsim  # noqa: E402
from fedsim.data.tensors import Dataset  # noqa: E402

FEATURES, CLASSES = 16, 10
COLUMNS = [
    ("clients", "clients", ",d"),
    ("samples", "samples", ",d"),
    ("build s", "build_seconds", ".2f"),
    ("startup s", "startup_seconds", ".2f"),
    ("s/round", "round_seconds", ".4f"),
    ("x smallest", "round_ratio", ".2f"),
    ("server MB", "server_peak_memory_mb", ",.0f"),
    ("worker MB", "worker_peak_memory_mb", ",.0f"),
    ("acc", "final_test_accuracy", ".3f"),
]


def federated_dataset(num_clients: int, samples: int, seed: int = 0) -> Dataset:
    """``samples`` samples for each of ``num_clients`` clients: Gaussian features around a class
    centre, labels skewed per client (each client favours two classes), test samples likewise."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 2

    def split(per_client: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        clients = torch.arange(num_clients).repeat_interleave(per_client)
        favoured = torch.randint(0, CLASSES, (num_clients, 2), generator=g)
        pick = torch.randint(0, 2, (len(clients),), generator=g)
        mixed = torch.rand(len(clients), generator=g) < 0.3
        labels = torch.where(mixed, torch.randint(0, CLASSES, (len(clients),), generator=g), favoured[clients, pick])
        x = centres[labels] + torch.randn(len(clients), FEATURES, generator=g)
        return x, labels, clients

    train_x, train_y, train_clients = split(samples)
    test_x, test_y, test_clients = split(1)
    names = tuple(f"c{i}" for i in range(num_clients))
    return Dataset(
        train_x,
        train_y,
        test_x[:10_000],
        test_y[:10_000],
        CLASSES,
        "generated",
        train_clients=train_clients,
        test_clients=test_clients[:10_000],
        client_names=names,
    )


def small_mlp(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(input_shape[0], 32), torch.nn.ReLU(), torch.nn.Linear(32, num_classes))


class RoundTimes:
    """A callback keeping every round's row (metrics.csv keeps the scored rounds only)."""

    def __init__(self):
        self.rows: list[dict] = []

    def on_round_end(self, row: dict, clients: list[dict]) -> None:
        self.rows.append(row)


def measure(spec: dict) -> dict:
    """In a fresh process: build the federation of ``spec["clients"]`` clients and run it."""
    num_clients = spec["clients"]
    t0 = time.perf_counter()
    data = federated_dataset(num_clients, spec["samples"])
    built = time.perf_counter() - t0
    config = {
        "name": f"scale-{num_clients}",
        "seed": 0,
        "rounds": spec["rounds"],
        "clients_per_round": spec["per_round"],
        "device": spec["device"],
        "workers": spec["workers"],
        "model": small_mlp,
        "eval_every": spec["rounds"],
        "data": {"dataset": data, "partition": "natural", "num_clients": num_clients},
        "local": {"epochs": 1, "batch_size": spec["samples"], "lr": 0.1},
    }
    rounds = RoundTimes()
    with tempfile.TemporaryDirectory() as tmp:
        history = fedsim.run(config, out=Path(tmp) / "run", quiet=True, callbacks=[rounds])
    s = history.summary
    after_first = [r["seconds"] - r["eval_seconds"] for r in rounds.rows[1:]]
    return {
        "clients": num_clients,
        "samples": num_clients * spec["samples"],
        "build_seconds": built,
        "startup_seconds": s["startup_seconds"],
        "round_seconds": statistics.mean(after_first) if after_first else None,
        "rounds": [{k: r[k] for k in ("round", "seconds", "train_seconds", "eval_seconds")} for r in rounds.rows],
        "server_peak_memory_mb": s["server_peak_memory_mb"],
        "worker_peak_memory_mb": max(s["worker_peak_memory_mb"] or [0]),
        "final_test_accuracy": s["final_test_accuracy"],
        "load_average": s["load_average"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1000,10000,100000,1000000", help="comma-separated sizes")
    parser.add_argument("--samples", type=int, default=4, help="training samples per client")
    parser.add_argument("--per-round", type=int, default=10, help="clients per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="results JSON (default benchmarks/results/bench_scale-<device>-<time>.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON spec of one measurement
    parser.add_argument("--child-result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        harness.child_main(args, measure)
        return
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (the rounds after the first are measured)")
    machine = harness.machine_info()
    rows = []
    for n in (int(float(n)) for n in args.clients.split(",")):
        spec = {"clients": n, "samples": args.samples, "rounds": args.rounds, "per_round": args.per_round}
        spec.update(device=args.device, workers=args.workers)
        result = harness.run_isolated(Path(__file__), spec, args.device, sample_memory=False)
        if result["status"] != "ok":
            print(f"{n:,} clients {result['status']}: {result.get('message')}", flush=True)
            continue
        rows.append(result)
        print(f"{n:,} clients done (load {result['load_average']})", flush=True)
    for row in rows:
        row["round_ratio"] = row["round_seconds"] / rows[0]["round_seconds"]
    print(harness.format_table(COLUMNS, rows))
    path = harness.write_results("bench_scale", args, machine, args.device, [], {"rows": rows})
    load = machine["load_average_start"], machine["load_average_end"]
    print(f"wrote {path}; load average {load[0]} at the start, {load[1]} at the end")


if __name__ == "__main__":
    main()
