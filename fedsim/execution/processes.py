"""Where worker processes come from: forks of a server process that imported torch once.

Starting a Python process and importing torch costs a second or two of CPU; a pool of spawned
workers pays it once per worker (four workers on two cores: several seconds before the first
round). Here multiprocessing's fork server imports torch and fedsim's worker code once, and
every worker is a fork of it, ready in milliseconds. It is as safe with CUDA as spawning: the
fork server imports torch but never initializes CUDA, so each worker creates its own CUDA
context, as a spawned one does, and the server process's own CUDA state is never copied.

``fedsim run`` and ``fedsim sweep`` start the fork server first thing (unless the file, ``--set``
or ``--grid`` says ``workers: 0``), so that it imports torch while the command imports torch
itself and loads the data; ``fedsim.run`` starts it before loading the data, for a run with
workers. It lives as long as the process that started it: a restarted pool and the runs of a
sweep fork from it at once. Its environment is the one it started with (CUDA_VISIBLE_DEVICES,
say), and so is every worker's.

A worker, like a spawned one, imports the script that started the run, so that the functions
and classes the script defines exist there too; a script that calls ``fedsim.run`` outside an
``if __name__ == "__main__":`` block would run again in every worker. ``in_worker_start`` tells
such a call apart, and the worker then ends with ``UNGUARDED_SCRIPT`` as its status, which the
server reports in one line naming the guard.

This module imports no torch: the command line uses it before anything else.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import warnings
from collections.abc import Mapping

from .interrupts import children_born_blocking

# What every worker needs, imported once in the fork server (an import that fails there is
# retried in the worker, where it reports its error)
PRELOAD = ["torch", "cloudpickle", "fedsim.execution.pool", "fedsim.execution.hogwild"]
UNGUARDED_SCRIPT = 87  # the exit status of a worker that found the script calling fedsim.run unguarded


def worker_context(extra: list[str] | tuple[str, ...] = ()) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of worker processes: forks of the fork server, or spawned
    processes where a platform has no fork server. ``extra``: modules the fork server imports
    beside PRELOAD, if it starts now."""
    try:
        context = multiprocessing.get_context("forkserver")
    except ValueError:
        return multiprocessing.get_context("spawn")
    context.set_forkserver_preload(PRELOAD + list(extra))  # read when the fork server starts, and only then
    return context


# the fork server this process started (its pid), and what it imported beside PRELOAD
_started: tuple[int | None, frozenset[str]] = (None, frozenset())


def start_fork_server(extra: list[str] | tuple[str, ...] = ()) -> None:
    """Start the fork server, if it is not running, and return at once: it imports torch and
    fedsim (and ``extra``) in its own process while this one goes on.

    One that runs without some of ``extra`` (started for an earlier run of this process: a
    notebook's CNN, then a LoRA run) is started anew with them, where no worker of it is alive:
    otherwise every worker would import them itself, seconds each for peft and transformers."""
    global _started
    server = multiprocessing.forkserver._forkserver
    running = getattr(server, "_forkserver_pid", None)
    imported = _started[1] if running is not None and running == _started[0] else frozenset()
    if worker_context(sorted(imported | set(extra))).get_start_method() != "forkserver":
        return
    stop = getattr(server, "_stop", None)  # multiprocessing's own, for its tests (3.8 on)
    if running is not None and stop and not set(extra) <= imported and not multiprocessing.active_children():
        stop()  # the workers are its children, and none is alive
    with children_born_blocking({signal.SIGINT}):  # the fork server ignores it once torch is imported
        multiprocessing.forkserver.ensure_running()
    if server._forkserver_pid != running:
        _started = (server._forkserver_pid, imported | frozenset(extra))
    atexit.unregister(_stop_fork_server)
    atexit.register(_stop_fork_server)


def _stop_fork_server() -> None:
    """At exit, end the fork server and wait for it: left to notice its parent gone, it would go
    on for seconds (still importing torch, if no run needed a worker) after the command ended."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)  # it holds no state; a worker still open dies with it (die_with_parent)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def worker_imports(config: Mapping) -> list[str]:
    """What the workers of a run with this config (a config.yaml's mapping, a file with its
    overrides applied, or ``Config.to_dict()``) import beside PRELOAD, for the fork server to
    import once: a language model's library and peft take seconds and hundreds of MB each, paid
    once and shared by every fork instead of once per worker."""
    model, lora = config.get("model"), config.get("lora")
    rank = lora.get("rank") if isinstance(lora, Mapping) else None
    imports = ["transformers"] if isinstance(model, str) and model.startswith("hf:") else []
    return imports + (["peft"] if isinstance(rank, int) and rank > 0 else [])


def leave_library_warnings_to_the_server() -> None:
    """In a worker: the warnings of transformers and peft (a deprecation met while placing
    adapters, say) are left to the server, which builds the same model and scores it, so that a
    run shows each once rather than once per process."""
    warnings.filterwarnings("ignore", module=r"(transformers|peft)(\.|$)")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # transformers' own logger, read when it is imported
    if "transformers" in sys.modules:  # imported already by the fork server
        sys.modules["transformers"].logging.set_verbosity_error()


def in_worker_start() -> bool:
    """Whether this process is a worker still starting: importing the script that started the
    run, as multiprocessing does before a worker runs (the call that got here is then a
    script's top-level ``fedsim.run``, outside ``if __name__ == "__main__":``)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))
