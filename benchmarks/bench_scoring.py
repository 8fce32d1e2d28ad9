"""Scoring the test set in batches of several sizes: the server's ``evaluate`` per model and batch.

    python benchmarks/bench_scoring.py
    python benchmarks/bench_scoring.py --models fedavg_cnn --batches 64,128,2000 --repeats 9

``eval_batch_size`` sets the batch the server scores the test set in (and the clients score
their own samples in). On a CPU a batch whose activations stay in the core's cache scores
fastest, which is why the default is 128. For each model of the zoo named in ``--models``,
``--samples`` generated inputs of its shape (the speed does not depend on the values) are scored
in batches of each size of ``--batches``, in turns, ``--repeats`` times after a warm-up, on
``--threads`` torch threads (default: torch's, as the server has). The table gives the median
seconds of a scoring and its ratio to the largest batch's; the accuracy and loss of every batch
size are printed beside, which may differ in their last bits (a batch's loss is summed in float32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 (benchmarks/ is not a package)

SHAPES = {"cifar_cnn": (3, 32, 32), "resnet20": (3, 32, 32), "resnet18": (3, 32, 32), "pfl_cnn": (3, 32, 32)}
COLUMNS = [
    ("model", "model", ""),
    ("batch", "batch", "d"),
    ("seconds", "seconds", ".3f"),
    ("/ largest batch", "ratio", ".2f"),
    ("accuracy", "accuracy", ".4f"),
    ("loss", "loss", ".7f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mnist_cnn,fedavg_cnn,cifar_cnn,byzfl_cnn", help="comma-separated")
    parser.add_argument("--batches", default="64,128,256,512,2000", help="eval_batch_size values, comma-separated")
    parser.add_argument("--samples", type=int, default=10_000, help="test samples (10,000: MNIST's and CIFAR's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed scorings of each batch size, in turns")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="results JSON (default benchmarks/results/bench_scoring-<device>-<time>.json)")
    return parser.parse_args(argv)


def measure(name: str, args) -> list[dict]:
    from fedsim.engine.loop import evaluate
    from fedsim.models.zoo import MODELS

    shape, generator = SHAPES.get(name, (1, 28, 28)), torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the model's initial weights
    model = MODELS.get(name)(shape, 10).to(args.device)
    x = torch.randn(args.samples, *shape, generator=generator).to(args.device)
    y = torch.randint(0, 10, (args.samples,), generator=generator).to(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    scores = {b: evaluate(model, x, y, b) for b in batches}  # the warm-up
    # each scoring ends with a host sync (.item()), on a GPU too
    times = harness.in_turns({b: lambda b=b: evaluate(model, x, y, b) for b in batches}, args.repeats)
    largest = statistics.median(times[max(batches)])
    return [
        {
            "model": name,
            "batch": b,
            "seconds": statistics.median(times[b]),
            "ratio": statistics.median(times[b]) / largest,
            "accuracy": scores[b][0],
            "loss": scores[b][1],
            "times_s": times[b],
        }
        for b in batches
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = harness.machine_info()
    entries = [entry for name in args.models.split(",") for entry in measure(name, args)]
    threads = torch.get_num_threads()
    print(f"scoring {args.samples:,} samples on {args.device}, {threads} thread(s), median of {args.repeats}")
    print(harness.format_table(COLUMNS, entries))
    path = harness.write_results("bench_scoring", args, machine, args.device, [], {"entries": entries})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
