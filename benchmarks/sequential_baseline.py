"""Sequential single-process FedAvg, the plain way, as the yardstick for fedsim's rounds.

    python benchmarks/sequential_baseline.py                           # data as device tensors
    python benchmarks/sequential_baseline.py --dataloader              # a DataLoader per client
    python benchmarks/sequential_baseline.py --size cpu --device cpu

One process trains the sampled clients one after another. It starts where a fedsim run of the
same config starts (fedsim.experiment.federation: the data, its partition among the clients, the initial
weights) and draws from the same random streams (fedsim.core.streams: each round's clients, each
client's seed); then the same E/B/lr/momentum/weight decay, a fresh torch.optim.SGD per client
per round, FedAvg weighted by sample counts and a test-set evaluation every round. Nothing of
fedsim's engine (worker pool, flat weights, local trainer) is used. The default keeps the
whole dataset on the device and gathers batches by index; --dataloader instead iterates a
torch DataLoader over a Subset of a CPU TensorDataset per client and copies each batch to the
device, as most simulators do.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import harness

SCRIPT = Path(__file__).resolve()

COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("data", "mode", ""),
    ("threads", "threads", "d"),
    ("round1 s", "round1_seconds", ".3f"),
    ("s/round", "round_seconds", ".3f"),
    ("samples/s", "samples_per_second", ",.0f"),
    ("updates/s", "client_updates_per_second", ",.1f"),
    ("train s", "train_seconds", ".3f"),
    ("agg s", "aggregate_seconds", ".3f"),
    ("eval s", "eval_seconds", ".3f"),
    ("overhead", "overhead_fraction", ".1%"),
    ("startup s", "startup_seconds", ".2f"),
    ("run s", "run_call_seconds", ".2f"),
    ("acc", "final_test_accuracy", ".4f"),
    ("peak MB", "peak_mb", ".1f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_workload_arguments(parser)
    parser.add_argument(
        "--dataloader",
        action="store_true",
        help="feed clients through torch DataLoaders over CPU tensors instead of device tensors",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's own, one per core); fedsim's CPU workers use 1 each",
    )
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- FedAvg, plainly


def tensor_batches(train_x, train_y, indices, batch_size: int):
    """Shuffled mini-batches gathered by index from device-resident tensors."""
    import torch

    order = indices[torch.randperm(len(indices), device=indices.device)]
    for batch in order.split(batch_size):
        yield train_x[batch], train_y[batch]


def loader_batches(loader, device):
    for x, y in loader:
        yield x.to(device), y.to(device)


def train_client(model, batches_per_epoch, local) -> tuple:
    """E epochs of SGD with a fresh optimizer; returns (summed loss as a device scalar, samples seen)."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(
        model.parameters(), lr=local.lr, momentum=local.momentum, weight_decay=local.weight_decay
    )
    model.train()
    loss_sum, seen = 0.0, 0
    for _ in range(local.epochs):
        for x, y in batches_per_epoch():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum = loss_sum + loss.detach() * len(y)
            seen += len(y)
    return loss_sum, seen


def evaluate(model, test_x, test_y, batch_size: int) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for x, y in zip(test_x.split(batch_size), test_y.split(batch_size)):
            out = model(x)
            loss = loss + F.cross_entropy(out, y, reduction="sum")
            correct = correct + (out.argmax(dim=1) == y).sum()
    return int(correct) / len(test_y), float(loss) / len(test_y)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare(cfg, use_dataloader: bool):
    """The device, the model with fedsim's initial weights, the test set, each client's sample
    count, a source of one epoch's batches per client, and the training-set size."""
    import torch
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from fedsim.experiment.federation import initial_model, load_federation

    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    federation = load_federation(cfg)  # what fedsim's run starts from: its clients, then its initial weights
    data, parts = federation.data, federation.parts
    model = initial_model(cfg, data).to(device)
    test = (data.test_x.to(device), data.test_y.to(device))
    if use_dataloader:
        dataset = TensorDataset(data.train_x, data.train_y)
        loaders = [
            DataLoader(Subset(dataset, part.tolist()), batch_size=cfg.local.batch_size, shuffle=True) for part in parts
        ]

        def epoch_batches(client):
            return loader_batches(loaders[client], device)
    else:
        train_x, train_y = data.train_x.to(device), data.train_y.to(device)
        device_parts = [part.to(device) for part in parts]

        def epoch_batches(client):
            return tensor_batches(train_x, train_y, device_parts[client], cfg.local.batch_size)

    return device, model, test, [len(part) for part in parts], epoch_batches, len(data.train_y)


def train_round(cfg, rnd: int, model, global_state: dict, client_sizes: list[int], epoch_batches):
    """Every sampled client from the global weights in turn; the new global weights (FedAvg:
    the mean of the clients' weights, weighted by sample counts) and the mean train loss."""
    import numpy as np
    import torch

    from fedsim.core.streams import client_seed
    from fedsim.fl.sampling import draw

    total = {name: torch.zeros_like(value) for name, value in global_state.items()}
    weight_sum, loss_sum, samples_seen = 0, 0.0, 0
    everyone = np.arange(cfg.data.num_clients)  # a uniform sample, every client online
    for client in draw("uniform", cfg.seed, rnd, everyone, cfg.clients_per_round, None).tolist():
        torch.manual_seed(client_seed(cfg.seed, rnd, client))  # shuffling and dropout of this client
        model.load_state_dict(global_state)
        client_loss, seen = train_client(model, partial(epoch_batches, client), cfg.local)
        n = client_sizes[client]
        for name, value in model.state_dict().items():
            total[name] += value.detach() * n
        weight_sum += n
        loss_sum, samples_seen = loss_sum + client_loss, samples_seen + seen
    new_state = {name: (value / weight_sum).to(global_state[name].dtype) for name, value in total.items()}
    return new_state, loss_sum / samples_seen


def run_fedavg(cfg, use_dataloader: bool) -> dict:
    """The whole run; rows and summary shaped like fedsim's."""
    import torch

    t_start = time.perf_counter()
    device, model, (test_x, test_y), client_sizes, epoch_batches, train_size = prepare(cfg, use_dataloader)
    global_state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    synchronize(device)
    startup = time.perf_counter() - t_start
    rows = []
    for rnd in range(1, cfg.rounds + 1):
        t0 = time.perf_counter()
        global_state, train_loss = train_round(cfg, rnd, model, global_state, client_sizes, epoch_batches)
        synchronize(device)
        t_trained = time.perf_counter()
        model.load_state_dict(global_state)
        train_loss = float(train_loss)  # the round's one host sync
        t_aggregated = time.perf_counter()
        accuracy = test_loss = None
        if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:  # when fedsim evaluates
            accuracy, test_loss = evaluate(model, test_x, test_y, cfg.eval_batch_size)
        t_end = time.perf_counter()
        rows.append(
            {
                "round": rnd,
                "test_accuracy": accuracy,
                "test_loss": test_loss,
                "train_loss": train_loss,
                "seconds": t_end - t0,
                "elapsed_seconds": t_end - t_start,
                "clients": cfg.clients_per_round,
                "train_seconds": t_trained - t0,
                "aggregate_seconds": t_aggregated - t_trained,
                "eval_seconds": t_end - t_aggregated,
            }
        )
        if cfg.stop_at_accuracy is not None and accuracy is not None and accuracy >= cfg.stop_at_accuracy:
            break
    target = cfg.stop_at_accuracy
    summary = {
        "startup_seconds": startup,
        "wall_seconds": time.perf_counter() - t_start,
        "final_test_accuracy": rows[-1]["test_accuracy"],
        "rounds": rows[-1]["round"],
        "rounds_to_target": next(
            (r["round"] for r in rows if target and r["test_accuracy"] is not None and r["test_accuracy"] >= target),
            None,
        ),
        "samples_per_round": harness.samples_per_round(cfg, train_size),
        "peak_memory_mb": peak_memory_mb(device),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    return {"rows": rows, "summary": summary}


def peak_memory_mb(device) -> float:
    """The CUDA allocator's peak on a GPU; on a CPU the peak resident set size of this
    process's own memory (VmHWM: unlike getrusage's ru_maxrss it excludes the parent's size,
    which Linux carries into the child across fork and exec)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as status:
        return next(float(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**10


# ----------------------------------------------------------------------------- harness


def measure(spec: dict) -> dict:
    import torch

    from fedsim.experiment.validation import load_config

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    cfg = load_config(spec["config"], spec["overrides"])
    start = time.perf_counter()
    result = run_fedavg(cfg, spec["dataloader"])
    return {**result, "run_call_seconds": time.perf_counter() - start}


def measure_all(args, device: str) -> list[dict]:
    mode = "dataloader" if args.dataloader else "tensors"
    entries = []
    for run in harness.workload_runs(args):
        entry = {"workload": run["workload"], "model": run["model"], "mode": mode, "overrides": run["overrides"]}
        print(f"{run['workload']} {run['model']} sequential ({mode}) ...", end=" ", flush=True)
        spec = {
            "config": run["config"],
            "overrides": run["overrides"],
            "dataloader": args.dataloader,
            "threads": args.threads,
        }
        entry.update(describe(harness.run_isolated(SCRIPT, spec, device)))
        print(
            entry["status"] if entry["status"] != "ok" else f"{entry.get('round_seconds') or 0:.3f} s/round", flush=True
        )
        entries.append(entry)
    return entries


def describe(result: dict) -> dict:
    if result["status"] != "ok":
        return {"status": result["status"], "message": result.get("message")}
    summary = result["summary"]
    return {
        "status": "ok",
        "samples_per_round": summary["samples_per_round"],
        **harness.round_statistics(result["rows"], summary["samples_per_round"]),
        **{
            key: summary[key]
            for key in (
                "startup_seconds",
                "wall_seconds",
                "final_test_accuracy",
                "rounds",
                "rounds_to_target",
                "device_name",
                "threads",
            )
        },
        "run_call_seconds": result["run_call_seconds"],
        "peak_mb": summary["peak_memory_mb"],
        **harness.memory_fields(result.get("memory")),
        "summary": summary,
        "rows": result["rows"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        harness.child_main(args, measure)
        return 0
    device, machine = harness.resolved_device(args.device), harness.machine_info()
    return harness.report_entries(
        "sequential_baseline",
        "Sequential FedAvg (medians over rounds 2.., see benchmarks/README.md)",
        COLUMNS,
        args,
        device,
        machine,
        measure_all(args, device),
    )


if __name__ == "__main__":
    sys.exit(main())
