"""The commands: run (and resume), sweep, partition, plot, list; each ``cmd_*`` takes the parsed
arguments and returns the exit status."""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import shlex
import sys
from pathlib import Path
from typing import Any

from ..core.errors import FedsimError
from ..core.overrides import apply_overrides, parse_grid
from ..core.yamlfile import experiment_file, read_yaml, shipped_experiments
from ..execution.interrupts import Terminated, install_handlers, shielded
from ..execution.processes import start_fork_server, worker_imports
from ..results.rundir import refuse_if_in_use


def cmd_run(args: argparse.Namespace) -> int:
    """Run or resume; with --ranks, start the ranks that do (launcher.py); as one of several
    ranks (see distributed.py) under that launcher or torchrun."""
    from ..execution.launcher import launch, started_by_launcher

    if args.ranks is not None and not started_by_launcher():
        return launch(args.argv, args.ranks, args.nodes, args.node_rank, args.rendezvous)
    if args.ranks is None and (args.nodes != 1 or args.node_rank or args.rendezvous):
        raise FedsimError("--nodes, --node-rank and --rendezvous go with --ranks (the ranks of each machine)")
    if args.resume or args.out:
        refuse_if_in_use(args.resume or args.out)
    _start_fork_server(args)
    _import_whole(args)
    from ..execution.distributed import Ranks
    from ..execution.rendezvous import launched

    ranks = Ranks.join() if launched() else Ranks()
    ending = "failed"
    try:
        code = _run(args, ranks)
        ending = "was interrupted" if code in (129, 130, 143) else "finished"
        return code
    except (KeyboardInterrupt, Terminated):  # while the config was shared, before the run began
        ending = "was interrupted"
        raise
    finally:
        ranks.close(ending)


def _import_whole(args) -> None:
    """Import the compiled libraries of this command's runs (numpy, torch, a language model's) with
    the stop signals held. A KeyboardInterrupt raised while a C extension initialises itself can be
    cleared there, leaving the module half made (numpy without ``logical_or``) and the run going on
    with it; held, a Ctrl-C then is delivered once they are whole, and stops the command in one line."""
    names = ["numpy", "torch", *sorted({name for config in _planned_configs(args) for name in worker_imports(config)})]
    with shielded():
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError:  # the run that needs it says so in its own words
                pass


def _start_fork_server(args) -> None:
    """Start the fork server now, where a run of this command may use workers, so that it imports
    torch (and the libraries the workers need) while this process imports its own and loads the
    data."""
    libraries = _fork_server_imports(args)
    if libraries is not None:
        start_fork_server(libraries)


def _fork_server_imports(args) -> list[str] | None:
    """What the fork server imports beside torch for the runs of this command (``worker_imports``
    of each, as a run decides it from its loaded config), or None where none of them uses workers."""
    configs = _planned_configs(args)
    if all(config.get("workers", 1) == 0 for config in configs):
        return None
    return sorted({name for config in configs for name in worker_imports(config)})


def _planned_configs(args) -> list[dict]:
    """The raw mapping of every run this command starts: the experiment file (or the resumed run's
    config.yaml) with ``--set`` applied, once per value of each ``--grid`` key, by the same code
    that loading applies them with. A glance, not a validation: what cannot be read now gives the
    file as it is (or nothing), and the run says why later. ``workers: 0`` in every one of them
    means no fork server, whose import of torch would only take the core this process needs."""
    resume = getattr(args, "resume", None)
    source = Path(resume) / "config.yaml" if resume else args.config and experiment_file(args.config)
    raw: dict = {}
    configs = []
    try:
        text = read_yaml(source) if source else {}
        raw = text if isinstance(text, dict) else {}
        apply_overrides(raw, args.set or [])
        for key, values in parse_grid(getattr(args, "grid", None) or []):
            for value in values:
                configs.append(copy.deepcopy(raw))
                apply_overrides(configs[-1], [f"{key}={value}"])
    except FedsimError:
        return [raw]
    return configs or [raw]


def _run(args, ranks) -> int:
    from ..core.errors import DataError
    from ..execution.pool import kill_all_pools
    from ..results.progress import final_line, write_or_silence

    runner, path, cfg = _runner(args, ranks)
    install_handlers(kill_all_pools)
    try:
        history = runner()
    except (KeyboardInterrupt, Terminated) as e:
        message = _stopped_message(ranks, path)
        if message:
            print(f"fedsim: {message}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else e.exit_code
    except DataError as e:
        if e.missing and not args.resume and serves_generated_data(cfg):  # what works at once, without the files
            raise DataError(f"{e}; or try it now on generated data: {_on_generated_data(args, cfg)}") from None
        raise
    summary = history.summary if history is not None and ranks.is_root else {}
    if summary.get("final_test_accuracy") is not None:
        write_or_silence(sys.stdout, final_line(summary, history.run_dir) + "\n")
    return 0


def _runner(args, ranks):
    """The run that ``fedsim run`` asks for, as a call: (the call, its run directory, its config;
    a resumed run's come from its directory)."""
    from ..experiment.config import directory_name
    from ..experiment.validation import load_config
    from ..results.rundir import RunDirectory
    from ..runs.callbacks import TRACKERS
    from ..runs.launch import agree_on_config, resume_run, start_run

    callbacks = [tracker() for name, tracker in TRACKERS.items() if getattr(args, name, False)]
    shown = {"quiet": args.quiet, "progress": args.progress, "callbacks": callbacks, "ranks": ranks}
    if args.resume:
        if args.config:
            raise FedsimError("give either an experiment FILE or --resume RUN_DIR, not both")
        if args.out or args.overwrite:
            raise FedsimError(
                f"--{'out' if args.out else 'overwrite'} does not apply to --resume: a run "
                f"continues in its own directory"
            )
        return functools.partial(resume_run, args.resume, args.set, **shown), args.resume, None

    def load():
        if not args.config:
            raise FedsimError("missing the experiment FILE (or --resume RUN_DIR)")
        loaded = load_config(args.config, args.set)
        RunDirectory.target(args.out, directory_name(loaded), args.overwrite)  # refuse a taken --out at once
        return loaded

    cfg = agree_on_config(ranks, load)
    path = RunDirectory.target(args.out, directory_name(cfg), args.overwrite) if ranks.is_root else None
    return functools.partial(start_run, cfg, out=path, overwrite=args.overwrite, **shown), path, cfg


def serves_generated_data(cfg: Any) -> bool:
    """Whether the run would run on the generated images (``synthetic``: 1x28x28, 10 classes, no
    clients or coarse labels of their own): its partition needs no column of the data's own
    (``natural``'s clients, ``pachinko``'s coarse labels), and its model takes those images."""
    import torch

    from ..data.partition import columns_needed
    from ..experiment import components
    from ..models.language import is_hf_model

    if columns_needed(cfg.data.partition) or is_hf_model(cfg.model):
        return False
    try:
        model = components.run_model(cfg, (1, 28, 28), 10)
        return tuple(model(torch.zeros(2, 1, 28, 28)).shape) == (2, 10)
    except Exception:  # a model for other inputs (text, colour images): no such suggestion
        return False


def _on_generated_data(args, cfg) -> str:
    """The same ``fedsim run`` on the generated dataset, as a shell command: the user's own --set
    keys kept, but for the data.dataset (and data.limit) it replaces."""
    replaced = {"data.dataset": "synthetic", **({"data.limit": "null"} if cfg.data.limit else {})}
    kept = [text for text in args.set or [] if text.partition("=")[0].strip() not in replaced]
    sets = [*kept, *(f"{key}={value}" for key, value in replaced.items())]
    return shlex.join(["fedsim", "run", args.config, *(word for text in sets for word in ("--set", text))])


def _stopped_message(ranks, path) -> str | None:
    """What a rank stopped by a signal says, if anything. Under torchrun a SIGTERM most often
    comes from the agent stopping the job because another rank died: say which, when that can
    be seen from this machine; or this rank stopped itself because its launcher (fedsim run
    --ranks, torchrun) is gone."""
    from ..execution.rendezvous import launcher_gone, ranks_named

    lost = ranks.lost() if ranks.several else []
    if not ranks.is_root:
        return (
            "rank 0 died; the job stopped (rank 0's run directory holds what it wrote)"
            if 0 in lost and not launcher_gone()
            else None
        )  # rank 0 cannot say it any more
    message = _interrupted_message(path)
    if launcher_gone():
        return message.replace("interrupted", "stopped because its launcher is gone", 1)
    if lost:
        return message.replace("interrupted", f"stopped because {ranks_named(lost)} died", 1)
    return message


def _interrupted_message(path) -> str:
    """What an interrupted run left on disk, read from the disk itself."""
    from ..results.history import load_run

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
    return (
        f"interrupted; metrics so far and the checkpoint of round {checkpoint} are in {path}; "
        f"continue with: fedsim run --resume {path}"
    )


def cmd_list(args: argparse.Namespace) -> int:
    from ..experiment.components import forms, tables

    if getattr(args, "what", None) == "keys":
        return _list_keys()

    experiments = shipped_experiments()
    sections = {
        "experiments (fedsim run NAME)": list(experiments.items()),
        **{kind: list(table.describe()) for kind, table in tables().items()},
        **forms(),
    }
    for kind, entries in sections.items():
        print(f"{kind}:")
        width = max(len(name) for name, _ in entries)
        for name, description in entries:
            print(f"  {name:<{width}}  {description}")
    return 0


def _list_keys() -> int:
    """Every key of an experiment file, as the docs' table has it, in plain text."""
    import re

    from ..core.sections import key_rows
    from ..experiment.config import Config

    def plain(markdown: str) -> str:  # code marks dropped, a link by its text
        return re.sub(r"`|\[([^]]*)\]\([^)]*\)", r"\1", markdown)

    rows = list(key_rows(Config))
    width = max(len(key) for key, _, _ in rows)
    for key, default, doc in rows:
        print(f"  {key:<{width}}  [{plain(default)}]  {plain(doc)}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..data.report import write_report
    from ..experiment.federation import load_federation
    from ..experiment.reading import locate
    from ..experiment.validation import load_config
    from ..results.rundir import check_output_path, safe_dir_name

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


def cmd_plot(args: argparse.Namespace) -> int:
    from ..results.plot import plot_runs, save_figure
    from ..results.progress import RoundLog, console_logging

    with console_logging(RoundLog(progress=False)):  # runs left out are said as warnings
        fig = plot_runs(
            args.runs,
            metric=args.metric,
            x=args.x,
            label=args.label,
            loss=args.loss,
            band=args.band,
            width=args.width,
            title=args.title,
            spread=args.spread,
            facet=args.facet,
        )
    for path in save_figure(fig, args.output, pdf=args.pdf):
        print(f"wrote {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    _start_fork_server(args)
    _import_whole(args)
    from ..execution.pool import kill_all_pools
    from ..runs.sweep import prepare

    install_handlers(kill_all_pools)
    planned = None
    try:
        planned = prepare(
            args.config,
            args.grid,
            args.set,
            out=args.out,
            overwrite=args.overwrite,
            seeds=args.seeds,
            target=args.target,
            pivot=args.pivot,
        )
        planned.run(quiet=args.quiet)
    except (KeyboardInterrupt, Terminated) as e:
        message = (
            planned.interrupted_message() if planned else "sweep interrupted while it was checked; nothing was written"
        )
        print(f"fedsim: {message}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else e.exit_code
    return 0
