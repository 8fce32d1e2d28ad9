"""The command line: every command, option and help text."""

from __future__ import annotations

import argparse

from .commands import cmd_list, cmd_partition, cmd_plot, cmd_run, cmd_sweep


def _width(text: str):
    """--width: single, double or inches."""
    if text in ("single", "double"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not single, double or a number of inches") from None


def _version() -> str:
    from .. import __version__

    return f"fedsim {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsim", description="Synchronous federated-learning simulator.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_run_parser(sub)
    lst = sub.add_parser("list", help="list datasets, partitions, models, aggregators, ...; with keys, every key")
    lst.add_argument(
        "what", nargs="?", choices=["keys"], help="keys: every key of an experiment file, its default and meaning"
    )
    lst.set_defaults(func=cmd_list)
    _add_partition_parser(sub)
    _add_plot_parser(sub)
    _add_sweep_parser(sub)
    return parser


def _add_run_parser(sub) -> None:
    """``fedsim run``: an experiment file, or --resume of a run directory."""
    run = sub.add_parser("run", help="run an experiment file")
    run.add_argument(
        "config",
        nargs="?",
        metavar="FILE",
        help="YAML experiment file, or the name of a shipped one (fedsim list), e.g. mnist_seed",
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set local.lr=0.05 (repeatable)",
    )
    run.add_argument("--out", metavar="DIR", help="run directory (default runs/<name>-<timestamp>)")
    run.add_argument("--overwrite", action="store_true", help="replace the run files in an existing --out DIR")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    run.add_argument("--quiet", action="store_true", help="print nothing per round")
    run.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the rounds as one updating line (default: only on a terminal)",
    )
    run.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard scalars to RUN_DIR/tensorboard (needs the tensorboard package)",
    )
    run.add_argument(
        "--mlflow",
        action="store_true",
        help="also log the run to MLflow: MLFLOW_TRACKING_URI, else mlflow.db here (needs the mlflow package)",
    )
    run.add_argument(
        "--wandb",
        action="store_true",
        help="also log the run to Weights & Biases, offline unless WANDB_MODE says otherwise, under RUN_DIR/wandb "
        "(needs the wandb package)",
    )
    ranks = run.add_argument_group("several ranks (one per GPU; docs/scaling.md)")
    ranks.add_argument("--ranks", type=int, metavar="N", help="start N ranks on this machine")
    ranks.add_argument("--nodes", type=int, default=1, metavar="M", help="machines in the job (default 1)")
    ranks.add_argument("--node-rank", type=int, default=0, metavar="I", help="this machine's number, 0 to M-1")
    ranks.add_argument("--rendezvous", metavar="HOST:PORT", help="where machine 0 listens for the others")
    run.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)


def _add_partition_parser(sub) -> None:
    """``fedsim partition``: how an experiment splits its data among clients."""
    part = sub.add_parser("partition", help="show how an experiment splits its data among clients")
    _add_experiment_arguments(part, "override a config key, e.g. --set data.alpha=0.1 (repeatable)")
    part.add_argument(
        "--out", metavar="DIR", help="where partition.json and partition.png go (default runs/<name>-partition)"
    )
    part.set_defaults(func=cmd_partition)


def _add_plot_parser(sub) -> None:
    """``fedsim plot``: a figure of the per-round metrics of one or more runs."""
    plot = sub.add_parser("plot", help="plot per-round metrics of one or more runs into a PNG or PDF")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories or glob patterns ('runs/cmp-*')")
    plot.add_argument("-o", "--output", required=True, metavar="FILE", help="the figure: FILE.png or FILE.pdf")
    plot.add_argument(
        "--metric",
        help="column of metrics.csv to plot (default test_accuracy; for language models' runs test_loss, with "
        "the perplexity on the right-hand axis; test_perplexity draws it on a log axis)",
    )
    plot.add_argument(
        "--x",
        choices=("round", "seconds", "epsilon", "bytes", "simulated_seconds"),
        default="round",
        help="x axis: round, seconds of wall time since the start, epsilon (privacy spent), bytes "
        "(MB sent up and down since round 1), or simulated_seconds (the simulated clock)",
    )
    plot.add_argument(
        "--label",
        metavar="KEY",
        help="name lines by this config key (e.g. aggregator, data.alpha) instead of the run name",
    )
    plot.add_argument(
        "--facet", metavar="KEY", help="one panel per value of this config key (e.g. attack.type), sharing the y axis"
    )
    plot.add_argument(
        "--loss", action="store_true", help="add a panel of test loss (of token accuracy below a language model's loss)"
    )
    plot.add_argument(
        "--spread",
        action="store_true",
        help="each client's accuracy on its own test split (eval_per_client) with the model it uses: "
        "the global model (FedAvg), or its own (personal algorithms: ditto, fedper, fedproto, ifca, ...), "
        "as the legend marks; mean over clients, ± 1 s.d. band, 10th percentile dashed",
    )
    plot.add_argument(
        "--band",
        choices=("minmax", "std"),
        default="minmax",
        help="shade across seeds: minmax (min to max) or std (mean ± 1 s.d.)",
    )
    plot.add_argument(
        "--width", type=_width, default="double", help="single (3.5 in), double (7 in, the default) or inches"
    )
    plot.add_argument("--title", help="figure title (default: the run name, or the metric)")
    plot.add_argument("--pdf", action="store_true", help="also write a PDF beside the PNG")
    plot.set_defaults(func=cmd_plot)


def _add_experiment_arguments(parser, set_help: str) -> None:
    """The experiment file and its --set overrides, as the commands that read one take them."""
    parser.add_argument("config", metavar="FILE", help="YAML experiment file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def _add_sweep_parser(sub) -> None:
    """``fedsim sweep``: every combination of grid values, one run after another."""
    swp = sub.add_parser("sweep", help="run every combination of grid values, one run after another")
    _add_experiment_arguments(swp, "override a config key in every run, e.g. --set rounds=5 (repeatable)")
    swp.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="values to sweep, e.g. --grid aggregator=fedavg,median --grid seed=0,1 (repeatable)",
    )
    swp.add_argument(
        "--seeds",
        metavar="S1,S2,...",
        help="run every configuration under each of these seeds, as repeats: the table and "
        "sweep.csv give mean ± s.d. over them (runs.csv one row per run)",
    )
    swp.add_argument(
        "--target",
        type=float,
        metavar="ACC",
        help="report the rounds to this test accuracy, a fraction such as 0.99 (default: "
        "stop_at_accuracy, where set); the runs go on: --set stop_at_accuracy=ACC stops them",
    )
    swp.add_argument(
        "--pivot",
        metavar="ROW,COLUMN",
        help="also print the final test accuracy (with eval_per_client, the clients' accuracy on their own "
        "test splits first) with one grid key's values down and another's across, e.g. --pivot "
        "aggregator,attack.type, with each row's worst; written to pivot.csv",
    )
    swp.add_argument(
        "--out",
        metavar="DIR",
        help="where the runs go, one folder each "
        "(default runs/<name>-sweep-<timestamp>); the same sweep into "
        "the same DIR again continues it",
    )
    swp.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run files in an existing --out DIR, starting the sweep again",
    )
    swp.add_argument("--quiet", action="store_true", help="print no per-round lines")
    swp.set_defaults(func=cmd_sweep)
