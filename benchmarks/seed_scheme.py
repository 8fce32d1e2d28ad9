"""The seed article's scheme as a baseline: processes spawned afresh every round, a DataLoader per
worker, FedAvg of the workers' weights.

    python benchmarks/seed_scheme.py                                   # W1 and W2
    python benchmarks/seed_scheme.py --size cpu --device cpu --workload W1

Every round the server spawns `--workers` processes (default: one per client of the round, as the
article's 4 processes for its 4 clients), hands each the global weights and its share of the
round's clients (round robin), and each process builds its model on the device, feeds every client
through a torch DataLoader over a Subset of the CPU training set (shared memory, as
torch.multiprocessing shares tensors), trains it with a fresh SGD (fedsim's E, B, lr, momentum,
weight decay, the seed of fedsim.core.streams), and sends back its clients' weights summed by sample
counts; the server averages them and evaluates as sequential_baseline.py does. The start and the
clients drawn are fedsim's (fedsim.experiment.federation, fedsim.core.streams). Process start, CUDA context and
DataLoader set-up are paid every round: that is the scheme's cost being measured.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import sys
import time
from pathlib import Path

import harness
import sequential_baseline as seq

SCRIPT = Path(__file__).resolve()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_workload_arguments(parser)
    parser.add_argument(
        "--workers", type=int, help="processes spawned per round (default: one per client of the round)"
    )
    return parser.parse_args(argv)


def worker(
    model_spec, shape, classes, state, local, clients, parts, sizes, seeds, train_x, train_y, device, threads, results
):
    """One spawned process: train its clients from ``state``; put (weighted sum, weight, loss, seen)."""
    import torch
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from fedsim.experiment.components import build_model

    torch.set_num_threads(threads)
    device = torch.device(device)
    model = build_model(model_spec, shape, classes).to(device)
    dataset = TensorDataset(train_x, train_y)
    total, weight, loss_sum, seen_sum = None, 0, 0.0, 0
    for _client, part, n, seed in zip(clients, parts, sizes, seeds):
        torch.manual_seed(seed)
        model.load_state_dict(state)
        loader = DataLoader(Subset(dataset, part.tolist()), batch_size=local.batch_size, shuffle=True)
        loss, seen = seq.train_client(model, functools.partial(seq.loader_batches, loader, device), local)
        weighted = {k: v.detach().double() * n for k, v in model.state_dict().items()}
        total = weighted if total is None else {k: total[k] + weighted[k] for k in total}
        weight, loss_sum, seen_sum = weight + n, loss_sum + float(loss), seen_sum + seen
    # as bytes: a tensor put on a queue is shared memory that lives only as long as this process
    buffer = io.BytesIO()
    torch.save(({k: v.cpu() for k, v in total.items()}, weight, loss_sum, seen_sum), buffer)
    results.put(buffer.getvalue())


def train_round(cfg, rnd: int, global_state: dict, data, parts, workers: int, device) -> tuple[dict, float]:
    import numpy as np
    import torch
    import torch.multiprocessing as mp

    from fedsim.core.streams import client_seed
    from fedsim.fl.sampling import draw

    clients = draw("uniform", cfg.seed, rnd, np.arange(cfg.data.num_clients), cfg.clients_per_round, None).tolist()
    count = min(workers, len(clients))
    threads = max(1, len(os.sched_getaffinity(0)) // count) if device.type == "cpu" else 1
    context = mp.get_context("spawn")
    results = context.Queue()
    state = {k: v.cpu() for k, v in global_state.items()}
    processes = []
    for i in range(count):
        mine = clients[i::count]
        args = (
            cfg.model,
            data.input_shape,
            data.num_classes,
            state,
            cfg.local,
            mine,
            [parts[c] for c in mine],
            [len(parts[c]) for c in mine],
            [client_seed(cfg.seed, rnd, c) for c in mine],
            data.train_x,
            data.train_y,
            str(device),
            threads,
            results,
        )
        processes.append(context.Process(target=worker, args=args))
    for process in processes:
        process.start()
    answers = [torch.load(io.BytesIO(results.get())) for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"a worker exited with status {process.exitcode}")
    weight = sum(a[1] for a in answers)
    new_state = {
        k: (sum(a[0][k] for a in answers) / weight).to(device=device, dtype=v.dtype) for k, v in global_state.items()
    }
    return new_state, sum(a[2] for a in answers) / sum(a[3] for a in answers)


def run_scheme(cfg, workers: int) -> dict:
    """The whole run; rows and summary shaped like sequential_baseline.py's."""
    import torch

    from fedsim.experiment.federation import initial_model, load_federation

    t_start = time.perf_counter()
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    federation = load_federation(cfg)
    data, parts = federation.data, federation.parts
    data.train_x.share_memory_(), data.train_y.share_memory_()
    model = initial_model(cfg, data).to(device)
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seq.synchronize(device)
    startup = time.perf_counter() - t_start
    rows = []
    for rnd in range(1, cfg.rounds + 1):
        t0 = time.perf_counter()
        global_state, train_loss = train_round(cfg, rnd, global_state, data, parts, workers, device)
        model.load_state_dict(global_state)
        seq.synchronize(device)
        t_trained = time.perf_counter()
        accuracy = test_loss = None
        if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
            accuracy, test_loss = seq.evaluate(model, test_x, test_y, cfg.eval_batch_size)
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
                "aggregate_seconds": 0.0,
                "eval_seconds": t_end - t_trained,
            }
        )
    summary = {
        "startup_seconds": startup,
        "wall_seconds": time.perf_counter() - t_start,
        "final_test_accuracy": rows[-1]["test_accuracy"],
        "rounds": rows[-1]["round"],
        "rounds_to_target": None,
        "samples_per_round": harness.samples_per_round(cfg, len(data.train_y)),
        "peak_memory_mb": seq.peak_memory_mb(device),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "workers": workers,
        "torch": torch.__version__,
    }
    return {"rows": rows, "summary": summary}


def measure(spec: dict) -> dict:
    from fedsim.experiment.validation import load_config

    cfg = load_config(spec["config"], spec["overrides"])
    start = time.perf_counter()
    result = run_scheme(cfg, spec["workers"] or cfg.clients_per_round)
    return {**result, "run_call_seconds": time.perf_counter() - start}


def measure_all(args, device: str) -> list[dict]:
    entries = []
    for run in harness.workload_runs(args):
        entry = {
            "workload": run["workload"],
            "model": run["model"],
            "mode": "seed scheme",
            "overrides": run["overrides"],
        }
        print(f"{run['workload']} {run['model']} seed scheme ...", end=" ", flush=True)
        spec = {"config": run["config"], "overrides": run["overrides"], "workers": args.workers}
        entry.update(seq.describe(harness.run_isolated(SCRIPT, spec, device)))
        print(
            entry["status"] if entry["status"] != "ok" else f"{entry.get('round_seconds') or 0:.3f} s/round", flush=True
        )
        entries.append(entry)
    return entries


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        harness.child_main(args, measure)
        return 0
    device, machine = harness.resolved_device(args.device), harness.machine_info()
    return harness.report_entries(
        "seed_scheme",
        "The seed article's scheme (medians over rounds 2.., see benchmarks/README.md)",
        seq.COLUMNS,
        args,
        device,
        machine,
        measure_all(args, device),
    )


if __name__ == "__main__":
    sys.exit(main())
