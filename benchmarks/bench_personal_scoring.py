"""What scoring every client's own model costs (eval_per_client under a personal algorithm),
against one pass of the global model over the same test samples.

    python benchmarks/bench_personal_scoring.py                        # 20, 1,000 and 10,000 clients
    python benchmarks/bench_personal_scoring.py --clients 100,1000 --model mnist_cnn --repeats 5

The test set (MNIST's 10,000 images from $FEDSIM_DATA or --data-root, else generated images of the
same shape) is split among N clients as evenly as it goes, and every client gets weights of its
own (the model's, plus noise). Timed in this process, one thread, medians over --repeats:

    global s      ClientEvaluation.score: the one model over every client's split
    personal s    ClientEvaluation.score_personal: each client's own model; clients with a few
                  samples in groups under vmap, the others one by one
    one by one s  the same figures, one client's weights loaded and scored after another (what
                  score_personal does for a model with a frozen base, and for larger splits)
    ratios        personal and one-by-one over global

Prints the table and writes every number to benchmarks/results/bench_personal_scoring-cpu-<time>.json.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time

import harness
import torch

from fedsim.core.flat import FlatModel
from fedsim.data import load_dataset
from fedsim.fl.client_eval import ClientEvaluation
from fedsim.models import build_model, tasks

COLUMNS = [
    ("clients", "clients", "d"),
    ("samples each", "samples_each", ".1f"),
    ("global s", "global_seconds", ".3f"),
    ("personal s", "personal_seconds", ".3f"),
    ("one by one s", "one_by_one_seconds", ".3f"),
    ("personal/global", "personal_ratio", ".2f"),
    ("one by one/global", "one_by_one_ratio", ".2f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="20,1000,10000", help="federation sizes, comma-separated")
    parser.add_argument("--model", default="mnist_cnn")
    parser.add_argument("--batch-size", type=int, default=128, help="eval_batch_size (default 128, fedsim's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-root", default=os.environ.get("FEDSIM_DATA"))
    parser.add_argument("--output", help="the JSON file (default under benchmarks/results/)")
    return parser.parse_args(argv)


def one_by_one(evaluation: ClientEvaluation, model: FlatModel, own: torch.Tensor, x, y, batch_size: int) -> list:
    """Each client's accuracy, its weights loaded into the one model in turn."""
    accuracies = []
    with torch.inference_mode():
        for client, index in enumerate(evaluation.index.split(evaluation.samples.tolist())):
            if not len(index):
                accuracies.append(float("nan"))
                continue
            model.flat.copy_(own[client])
            hits = sum(int(tasks.hits(model.module(x[part]), y[part]).sum()) for part in index.split(batch_size))
            accuracies.append(hits / len(index))
    return accuracies


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    machine = harness.machine_info()
    data = load_dataset("mnist", args.data_root) if args.data_root else load_dataset("synthetic", "unused")
    x, y = data.test_x, data.test_y
    torch.manual_seed(0)
    model = FlatModel(build_model(args.model, tuple(x.shape[1:]), 10), "cpu")
    rows = []
    for clients in [int(n) for n in harness.split_list(args.clients)]:
        parts = list(torch.randperm(len(y)).tensor_split(clients))
        own = model.flat + 0.01 * torch.randn(clients, len(model.flat))
        evaluation = ClientEvaluation(parts, torch.device("cpu"))
        personal = functools.partial(
            evaluation.score_personal,
            model,
            model.module,
            own.__getitem__,
            x,
            y,
            args.batch_size,
            1,
            set(range(clients)),
        )
        row = {
            "clients": clients,
            "samples_each": len(y) / clients,
            "global_seconds": median_seconds(
                functools.partial(evaluation.score, model.module, x, y, args.batch_size, 1), args.repeats
            ),
            "personal_seconds": median_seconds(personal, args.repeats),
            "one_by_one_seconds": median_seconds(
                functools.partial(one_by_one, evaluation, model, own, x, y, args.batch_size), args.repeats
            ),
        }
        personal()
        by_one = one_by_one(evaluation, model, own, x, y, args.batch_size)
        same = all(
            a == b or math.isnan(a) and math.isnan(b) for a, b in zip([r["accuracy"] for r in evaluation.last], by_one)
        )
        row |= {
            "personal_ratio": row["personal_seconds"] / row["global_seconds"],
            "one_by_one_ratio": row["one_by_one_seconds"] / row["global_seconds"],
            "same_accuracies": same,
        }
        rows.append(row)
        print(f"{clients} clients: done (the two ways give the same accuracies: {same})", flush=True)
    print(harness.format_table(COLUMNS, rows))
    path = harness.write_results("bench_personal_scoring", args, machine, "cpu", [], {"rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
