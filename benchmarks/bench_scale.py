"""How fedsim scales with the number of clients: federations of 10^3 to 10^6 natural clients.

StackOverflow, the largest federated benchmark in common use, has 342,477 clients. This builds
generated federated datasets whose samples each name their own client (as FEMNIST's writers or
Shakespeare's roles do), with ``--samples`` samples per client, and runs a few FedAvg rounds of
``data.partition: natural`` on each through ``fedsim.run``, ``--per-round`` clients a round. It
reports, per size: the time to build the dataset (generation, not fedsim's), fedsim's start-up
(``startup_seconds``: the federation split, the model, the buffers, the workers ready), the
mean seconds of a round after the first, and the peak memory of the server process and of the
largest worker. What should hold: the time per round and the workers' memory flat in the number
of clients (a round touches ``--per-round`` of them), the server's memory and the start-up
growing at most linearly (one index per sample, one offset per client).

    python benchmarks/bench_scale.py                       # 10^3, 10^4, 10^5, 10^6 clients
    python benchmarks/bench_scale.py --clients 1000,100000 --rounds 3
"""

from __future__ import annotations

import argparse
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


def measure(num_clients: int, args: argparse.Namespace, out: Path) -> dict:
    t0 = time.perf_counter()
    data = federated_dataset(num_clients, args.samples)
    built = time.perf_counter() - t0
    config = {
        "name": f"scale-{num_clients}",
        "seed": 0,
        "rounds": args.rounds,
        "clients_per_round": args.per_round,
        "device": args.device,
        "workers": args.workers,
        "model": small_mlp,
        "eval_every": args.rounds,
        "data": {"dataset": data, "partition": "natural", "num_clients": num_clients},
        "local": {"epochs": 1, "batch_size": args.samples, "lr": 0.1},
    }
    history = fedsim.run(config, out=out / f"clients-{num_clients}", quiet=True)
    s = history.summary
    seconds = [r["seconds"] for r in history.rows]
    return {
        "clients": num_clients,
        "samples": num_clients * args.samples,
        "build_seconds": built,
        "startup_seconds": s["startup_seconds"],
        "round_seconds": seconds[-1] if seconds else None,
        "server_peak_memory_mb": s["server_peak_memory_mb"],
        "worker_peak_memory_mb": max(s["worker_peak_memory_mb"] or [0]),
        "final_test_accuracy": s["final_test_accuracy"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1000,10000,100000,1000000", help="comma-separated sizes")
    parser.add_argument("--samples", type=int, default=4, help="training samples per client")
    parser.add_argument("--per-round", type=int, default=10, help="clients per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="results JSON (default benchmarks/results/bench_scale-<device>-<time>.json)")
    args = parser.parse_args(argv)
    sizes = [int(float(n)) for n in args.clients.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            rows.append(measure(n, args, Path(tmp)))
            print(f"{n:,} clients done", flush=True)
    print(harness.format_table(COLUMNS, rows))
    path = harness.write_results("bench_scale", args, harness.machine_info(), args.device, [], {"rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
