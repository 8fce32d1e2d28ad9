"""Make the figures the docs show, from real runs, so that anyone can make them again.

    FEDSIM_DATA=/path/to/datasets python docs/figures/make_figures.py

``FEDSIM_DATA`` must hold real MNIST and Fashion-MNIST (torchvision's layout) and the Shakespeare
play texts (``shakespeare/texts``). Each figure is a fedsim run's or a partition's, drawn by
fedsim's own plotting, written beside this file; the caption in the docs names its data and the
machine it was made on. About seven minutes on 2 CPU cores (load average about 2), most of it
the seven runs of the rule comparison and the three of async against sync.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import fedsim
from fedsim.cli import main as fedsim_main
from fedsim.results.plot import accuracy_figure, plot_runs, save_figure

HERE = Path(__file__).parent
QUICK_LM = {
    "data.num_clients": 200,
    "data.sequence_length": 64,
    "model_options.layers": 2,
    "model_options.width": 64,
    "rounds": 30,
    "local.steps": 10,
    "local.epochs": 2,
    "eval_every": 2,
}
# experiments/compare/base.yaml made quick: 20,000 samples, the small CNN, 20 rounds
QUICK_COMPARE = {"data.limit": 20000, "model": "mnist_cnn", "rounds": 20}
# the rules drawn under attack, after FedAvg without one
RULES = ("fedavg", "median", "trimmed_mean", "krum", "geometric_median", "norm_clip")
# experiments/async.yaml's three runs, as its header gives them (those of the table in docs/asynchronous.md)
SERVERS = {
    "FedBuff, K = 10": {},
    "FedAsync, α = 0.6": {"asynchronous.method": "fedasync", "rounds": 300, "eval_every": 10},
    "FedAvg, 20 s deadline": {"mode": "sync", "system.deadline": 20},
}


def quick_start(work: Path) -> None:
    """The quick start's run: mnist_seed on real MNIST."""
    history = fedsim.run("mnist_seed", out=work / "quickstart", quiet=True, device="cpu")
    save_figure(accuracy_figure(history), HERE / "quickstart.png")


def partition(work: Path) -> None:
    """Fashion-MNIST split Dir(0.3) over 100 clients: the label mix of each client."""
    try:
        code = fedsim_main(["partition", "fmnist_dirichlet", "--out", str(work / "partition")])
    except SystemExit as e:  # the command's own way to end
        code = e.code
    if code not in (0, None):
        sys.exit("fedsim partition failed")
    shutil.copy(work / "partition" / "partition.png", HERE / "partition.png")


def language_model(work: Path) -> None:
    """llm/shakespeare_char's quick version: test loss and perplexity over the rounds."""
    history = fedsim.run("llm/shakespeare_char", out=work / "lm", quiet=True, device="cpu", **QUICK_LM)
    save_figure(accuracy_figure(history), HERE / "language_model.png")


def rule_comparison(work: Path) -> None:
    """experiments/compare/base.yaml's quick version: FedAvg without attackers, then the rules
    with 20 % of the clients sending sign-flipped updates."""
    runs = [("fedavg, no attack", "fedavg", "none")] + [(rule, rule, "sign_flip") for rule in RULES]
    histories = [
        fedsim.run(
            "experiments/compare/base.yaml",
            out=work / "compare" / f"{rule}-{attack}",
            quiet=True,
            device="cpu",
            name=name,
            aggregator=rule,
            **{**QUICK_COMPARE, "attack.type": attack},
        )
        for name, rule, attack in runs
    ]
    title = "Fashion-MNIST Dir(0.3), 100 clients, 20 % sending sign-flipped updates"
    save_figure(plot_runs(histories, title=title), HERE / "rules.png")


def async_against_sync(work: Path) -> None:
    """experiments/async.yaml's three servers on all of MNIST, against the simulated clock: on fewer
    samples a client's work is shorter, and the 20 s deadline would mean something else."""
    histories = [
        fedsim.run(
            "experiments/async.yaml", out=work / "async" / str(i), quiet=True, device="cpu", name=name, **options
        )
        for i, (name, options) in enumerate(SERVERS.items())
    ]
    save_figure(plot_runs(histories, x="simulated_seconds"), HERE / "async.png")


if __name__ == "__main__":
    if not os.environ.get("FEDSIM_DATA"):
        sys.exit("set FEDSIM_DATA to a folder holding MNIST, FashionMNIST and shakespeare/texts")
    with tempfile.TemporaryDirectory() as folder:
        for make in (quick_start, partition, language_model, rule_comparison, async_against_sync):
            make(Path(folder))
            print(f"made {make.__name__}")
