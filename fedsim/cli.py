"""The ``fedsim`` command: run (and resume), sweep, partition, plot, list.

User errors print one line on stderr and exit with status 2 (``--debug`` shows the
traceback). Ctrl-C and SIGTERM stop the run after stopping the workers, keep what was
written, and exit with 130 and 143; a second Ctrl-C ends everything at once.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .core.errors import FedsimError
from .execution.interrupts import Terminated, exiting, install_handlers
from .results.rundir import refuse_if_in_use
from .core.yamlfile import experiment_file, read_yaml, shipped_experiments


def cmd_run(args) -> int:
    """Run or resume; under torchrun, as one of several ranks (see distributed.py)."""
    from .execution.processes import start_fork_server

    if args.resume or args.out:
        refuse_if_in_use(args.resume or args.out)
    if _may_use_workers(args):
        start_fork_server()  # the workers' torch is imported in the fork server while this process imports its own
    from .execution.distributed import Ranks, launched

    ranks = Ranks.join() if launched() else Ranks()
    ending = "failed"
    try:
        code = _run(args, ranks)
        ending = "was interrupted" if code in (130, 143) else "finished"
        return code
    except (KeyboardInterrupt, Terminated):  # while the config was shared, before the run began
        ending = "was interrupted"
        raise
    finally:
        ranks.close(ending)


def _may_use_workers(args) -> bool:
    """False where the experiment file (or the run directory's config.yaml) with ``--set``, and a
    sweep's ``--grid``, say ``workers: 0`` for every run: such runs never fork a worker, and a fork
    server started for them would import torch for nothing, on the core this process needs. A
    glance, not a validation (that comes later, and a run that does use workers starts the fork
    server then)."""
    for text in getattr(args, "grid", None) or []:
        key, _, values = text.partition("=")
        if key.strip() == "workers":
            return any(value.strip() != "0" for value in values.split(","))
    for text in reversed(args.set or []):
        key, _, value = text.partition("=")
        if key.strip() == "workers":
            return value.strip() != "0"
    resume = getattr(args, "resume", None)
    source = Path(resume) / "config.yaml" if resume else args.config and experiment_file(args.config)
    try:
        raw = read_yaml(source) if source else {}
    except FedsimError:
        return True
    return not (isinstance(raw, dict) and raw.get("workers") == 0)


def _run(args, ranks) -> int:
    from .runs.callbacks import TensorBoard
    from .experiment.config import directory_name
    from .experiment.validation import load_config
    from .core.errors import DataError
    from .results.progress import write_or_silence
    from .execution.pool import kill_all_pools
    from .results.rundir import RunDirectory
    from .runs.launch import agree_on_config, resume_run, start_run

    callbacks = [TensorBoard()] if args.tensorboard else []
    path, cfg = args.resume, None
    if args.resume:
        if args.config:
            raise FedsimError("give either an experiment FILE or --resume RUN_DIR, not both")
        if args.out or args.overwrite:
            raise FedsimError(f"--{'out' if args.out else 'overwrite'} does not apply to --resume: a run "
                              f"continues in its own directory")
        runner = lambda: resume_run(args.resume, args.set, quiet=args.quiet, progress=args.progress,  # noqa: E731
                                    callbacks=callbacks, ranks=ranks)
    else:
        def load():
            if not args.config:
                raise FedsimError("missing the experiment FILE (or --resume RUN_DIR)")
            loaded = load_config(args.config, args.set)
            RunDirectory.target(args.out, directory_name(loaded), args.overwrite)  # refuse a taken --out at once
            return loaded

        cfg = agree_on_config(ranks, load)
        path = RunDirectory.target(args.out, directory_name(cfg), args.overwrite) if ranks.is_root else None
        runner = lambda: start_run(cfg, out=path, overwrite=args.overwrite, quiet=args.quiet,  # noqa: E731
                                   progress=args.progress, callbacks=callbacks, ranks=ranks)
    install_handlers(kill_all_pools)
    try:
        history = runner()
    except (KeyboardInterrupt, Terminated) as e:
        message = _stopped_message(ranks, path)
        if message:
            print(f"fedsim: {message}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    except DataError as e:
        if e.missing and not args.resume:  # offer what works at once, without the files
            limit = " --set data.limit=null" if cfg.data.limit else ""
            raise DataError(f"{e}; or try it now on generated data: fedsim run {args.config} "
                            f"--set data.dataset=synthetic{limit}") from None
        raise
    summary = history.summary if history is not None and ranks.is_root else {}
    if summary.get("final_test_accuracy") is not None:
        write_or_silence(sys.stdout, f"final test accuracy {summary['final_test_accuracy']:.4f} after round "
                                     f"{summary['rounds']} ({summary['wall_seconds']:.1f} s); results in "
                                     f"{history.run_dir}\n")
    return 0


def _stopped_message(ranks, path) -> str | None:
    """What a rank stopped by a signal says, if anything. Under torchrun a SIGTERM most often
    comes from the agent stopping the job because another rank died: say which, when that can
    be seen from this machine; or this rank stopped itself because its launcher is gone."""
    from .execution.distributed import launcher_gone, ranks_named

    lost = ranks.lost() if ranks.several else []
    if not ranks.is_root:
        return "rank 0 died; the job stopped (rank 0's run directory holds what it wrote)" \
            if 0 in lost and not launcher_gone() else None  # rank 0 cannot say it any more
    message = _interrupted_message(path)
    if launcher_gone():
        return message.replace("interrupted", "stopped because its launcher (torchrun) is gone", 1)
    if lost:
        return message.replace("interrupted", f"stopped because {ranks_named(lost)} died", 1)
    return message


def _interrupted_message(path) -> str:
    """What an interrupted run left on disk, read from the disk itself."""
    from .results.history import load_run

    path = Path(path)
    if not path.is_dir() or not any(path.iterdir()):
        return "interrupted during start-up; nothing was written"
    try:
        history = load_run(path)
    except FedsimError:
        return f"interrupted during start-up; what was written is in {path}"
    status, checkpoint = history.summary.get("status"), history.summary.get("checkpoint_round")
    if status == "finished":
        return f"interrupted after the run finished; its results are in {path}"
    if not history.summary:
        return f"interrupted during start-up; {path} holds its config and no rounds yet"
    if not checkpoint:
        return f"interrupted before the first checkpoint; what was written is in {path}"
    return (f"interrupted; metrics so far and the checkpoint of round {checkpoint} are in {path}; "
            f"continue with: fedsim run --resume {path}")


def cmd_list(args) -> int:
    from .experiment.components import tables

    experiments = shipped_experiments()
    sections = {"experiments (fedsim run NAME)": list(experiments.items()),
                **{kind: list(table.describe()) for kind, table in tables().items()}}
    for kind, entries in sections.items():
        print(f"{kind}:")
        width = max(len(name) for name, _ in entries)
        for name, description in entries:
            print(f"  {name:<{width}}  {description}")
    return 0


def cmd_partition(args) -> int:
    from pathlib import Path

    from .experiment.config import locate
    from .experiment.validation import load_config
    from .data.report import write_report
    from .experiment.federation import load_federation
    from .results.rundir import check_output_path, safe_dir_name

    cfg = load_config(args.config, args.set)
    out = Path(args.out) if args.out else Path("runs") / f"{safe_dir_name(cfg.name)}-partition"
    check_output_path(out)
    try:
        report = write_report(cfg, load_federation(cfg), out)
    except FedsimError as e:
        raise locate(cfg, e) from None
    print(report["summary"])
    print(f"wrote {out / 'partition.json'} and {out / 'partition.png'}")
    return 0


def cmd_plot(args) -> int:
    from .results.plot import plot_runs, save_figure
    from .results.progress import RoundLog, console_logging

    with console_logging(RoundLog(progress=False)):  # runs left out are said as warnings
        fig = plot_runs(args.runs, metric=args.metric, x=args.x, label=args.label, loss=args.loss,
                        band=args.band, width=args.width, title=args.title, spread=args.spread)
    for path in save_figure(fig, args.output, pdf=args.pdf):
        print(f"wrote {path}")
    return 0


def cmd_sweep(args) -> int:
    from .execution.processes import start_fork_server

    if _may_use_workers(args):
        start_fork_server()
    from .execution.pool import kill_all_pools
    from .runs.sweep import prepare

    if not args.grid and args.seeds is None:
        raise FedsimError("give at least one --grid KEY=V1,V2,... or --seeds S1,S2,..., e.g. "
                          "--grid aggregator=fedavg,median or --seeds 0,1,2")
    install_handlers(kill_all_pools)
    planned = None
    try:
        planned = prepare(args.config, args.grid, args.set, out=args.out, overwrite=args.overwrite, seeds=args.seeds,
                          target=args.target)
        planned.run(quiet=args.quiet)
    except (KeyboardInterrupt, Terminated) as e:
        message = planned.interrupted_message() if planned else "sweep interrupted while it was checked; nothing " \
                                                                "was written"
        print(f"fedsim: {message}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    return 0


def _width(text: str):
    """--width: single, double or inches."""
    if text in ("single", "double"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not single, double or a number of inches") from None


def _version() -> str:
    from . import __version__

    return f"fedsim {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsim", description="Synchronous federated-learning simulator.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_run_parser(sub)
    lst = sub.add_parser("list", help="list datasets, partitions, models, aggregators, ...")
    lst.set_defaults(func=cmd_list)
    _add_partition_parser(sub)
    _add_plot_parser(sub)
    _add_sweep_parser(sub)
    return parser


def _add_run_parser(sub) -> None:
    """``fedsim run``: an experiment file, or --resume of a run directory."""
    run = sub.add_parser("run", help="run an experiment file")
    run.add_argument("config", nargs="?", metavar="FILE",
                     help="YAML experiment file, or the name of a shipped one (fedsim list), e.g. mnist_seed")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set local.lr=0.05 (repeatable)")
    run.add_argument("--out", metavar="DIR", help="run directory (default runs/<name>-<timestamp>)")
    run.add_argument("--overwrite", action="store_true", help="replace the run files in an existing --out DIR")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    run.add_argument("--quiet", action="store_true", help="print nothing per round")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="show the rounds as one updating line (default: only on a terminal)")
    run.add_argument("--tensorboard", action="store_true",
                     help="also write TensorBoard scalars to RUN_DIR/tensorboard (needs the tensorboard package)")
    run.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)


def _add_partition_parser(sub) -> None:
    """``fedsim partition``: how an experiment splits its data among clients."""
    part = sub.add_parser("partition", help="show how an experiment splits its data among clients")
    _add_experiment_arguments(part, "override a config key, e.g. --set data.alpha=0.1 (repeatable)")
    part.add_argument("--out", metavar="DIR", help="where partition.json and partition.png go "
                                                   "(default runs/<name>-partition)")
    part.set_defaults(func=cmd_partition)


def _add_plot_parser(sub) -> None:
    """``fedsim plot``: a figure of the per-round metrics of one or more runs."""
    plot = sub.add_parser("plot", help="plot per-round metrics of one or more runs into a PNG or PDF")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories or glob patterns ('runs/cmp-*')")
    plot.add_argument("-o", "--output", required=True, metavar="FILE",
                      help="the figure: FILE.png or FILE.pdf")
    plot.add_argument("--metric", default="test_accuracy",
                      help="column of metrics.csv to plot (default test_accuracy)")
    plot.add_argument("--x", choices=("round", "seconds", "epsilon", "bytes", "simulated_seconds"), default="round",
                      help="x axis: round, seconds of wall time since the start, epsilon (privacy spent), bytes "
                           "(MB sent up and down since round 1), or simulated_seconds (the simulated clock)")
    plot.add_argument("--label", metavar="KEY",
                      help="name lines by this config key (e.g. aggregator, data.alpha) instead of the run name")
    plot.add_argument("--loss", action="store_true", help="add a panel of test loss")
    plot.add_argument("--spread", action="store_true",
                      help="the global model's accuracy on the clients' own test splits (eval_per_client): "
                           "mean over clients, ± 1 s.d. band, 10th percentile dashed")
    plot.add_argument("--band", choices=("minmax", "std"), default="minmax",
                      help="shade across seeds: minmax (min to max) or std (mean ± 1 s.d.)")
    plot.add_argument("--width", type=_width, default="double",
                      help="single (3.5 in), double (7 in, the default) or inches")
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
    swp.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                     help="values to sweep, e.g. --grid aggregator=fedavg,median --grid seed=0,1 (repeatable)")
    swp.add_argument("--seeds", metavar="S1,S2,...",
                     help="run every configuration under each of these seeds, as repeats: the table and "
                          "sweep.csv give mean ± s.d. over them (runs.csv one row per run)")
    swp.add_argument("--target", type=float, metavar="ACC",
                     help="report the rounds to this test accuracy, a fraction such as 0.99 (default: "
                          "stop_at_accuracy, where set); the runs go on: --set stop_at_accuracy=ACC stops them")
    swp.add_argument("--out", metavar="DIR", help="where the runs go, one folder each "
                                                  "(default runs/<name>-sweep-<timestamp>); the same sweep into "
                                                  "the same DIR again continues it")
    swp.add_argument("--overwrite", action="store_true", help="replace the run files in an existing --out DIR, "
                                                              "starting the sweep again")
    swp.add_argument("--quiet", action="store_true", help="print no per-round lines")
    swp.set_defaults(func=cmd_sweep)


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except FedsimError as e:
        if args.debug:
            raise
        if str(e):  # a rank stopped by another has nothing to add: that one says why
            print(f"fedsim: error: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:  # before a command's own handling began (fedsim run while importing torch)
        print("fedsim: interrupted", file=sys.stderr)
        code = 130
    except Terminated:
        code = 143
    except BrokenPipeError:  # `fedsim list | head`: the reader has all it wanted
        from .results.progress import write_or_silence

        write_or_silence(sys.stdout, "")
        code = 0
    except OSError as e:  # the output itself failed (fedsim list > /dev/full)
        # only that: a failed write to the output names no file, fedsim's own files are named by
        # their own errors, and an OSError of the user's code by its component (errors.user_code)
        if args.debug or e.filename is not None:
            raise
        from .results.progress import write_or_silence

        write_or_silence(sys.stdout, "")
        print(f"fedsim: error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        code = 1
    if argv is None:  # the process's own command line (not a call from Python): its signals are its own
        exiting()
    sys.exit(code)
