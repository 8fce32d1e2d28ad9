"""A worker that cannot start says so soon, in one line naming the worker, the device and the cause.

The runs use this module's StartFault as their algorithm (the tests directory is on the run's
PYTHONPATH): FedAvg, except that in one worker its ``setup`` (called while the worker builds its
runner) raises, exits or hangs. The server calls ``setup`` too, and there it does nothing.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
from multiprocessing import resource_sharer

import pytest
import torch
from support import assert_one_line_error, run_cli, shm_entries, shm_left_behind, tagged_processes, write_config

from fedsim.algorithms.fedavg import FedAvg
from fedsim.core.errors import ConfigError
from fedsim.execution.pool import NOT_RUNNING, WorkerPool
from fedsim.execution.processes import start_fork_server
from fedsim.execution.resources import quiet_resource_sharer, start_seconds

pytestmark = pytest.mark.slow


class StartFault(FedAvg):
    """FedAvg whose ``setup`` strikes in worker ``worker`` only: ``raise``, ``exit`` or ``hang``."""

    def __init__(self, kind: str, worker: int):
        super().__init__()
        self.kind, self.worker = kind, int(worker)

    def setup(self, config) -> None:
        super().setup(config)
        if multiprocessing.current_process().name != f"fedsim-worker-{self.worker}":
            return
        if self.kind == "raise":
            raise RuntimeError("injected start-up fault\nsecond line, not shown")
        if self.kind == "exit":
            os._exit(3)
        time.sleep(3600)


def _run(tmp_path, kind: str, worker: int = 1, env: dict | None = None, **changes):
    options = {"kind": kind, "worker": worker}
    config = write_config(
        tmp_path, rounds=2, algorithm="test_worker_start:StartFault", algorithm_options=options, **changes
    )
    shm_before = shm_entries()
    code, out, err, seconds, tag = run_cli(
        ["run", str(config), "--out", str(tmp_path / "run")], timeout=40, **(env or {})
    )
    assert tagged_processes(tag) == []  # no worker, no fork server left behind
    assert shm_left_behind(shm_before) == set()
    return code, out, err, seconds


def test_an_exception_in_set_up_is_one_line_naming_worker_device_and_cause(tmp_path):
    code, out, err, seconds = _run(tmp_path, "raise")
    assert code == 1 and seconds < 30, err
    assert_one_line_error(err, "worker 1 could not start on cpu: RuntimeError: injected start-up fault")
    assert "second line" not in err and "round" not in out


def test_a_worker_that_dies_in_set_up_is_named_with_its_exit_status(tmp_path):
    code, _, err, seconds = _run(tmp_path, "exit", worker=0)
    assert code == 1 and seconds < 30, err
    assert_one_line_error(err, "worker 0 could not start on cpu: exited with status 3")


def test_a_worker_that_hangs_in_set_up_hits_the_start_bound_not_worker_timeout(tmp_path):
    code, _, err, seconds = _run(tmp_path, "hang", env={"FEDSIM_WORKER_START_SECONDS": "3"}, worker_timeout=600)
    assert code == 1 and 3 <= seconds < 30, err
    assert_one_line_error(
        err,
        "worker 1 did not start on cpu within 3 s (FEDSIM_WORKER_START_SECONDS)",
        "still building its model and runner",
    )


def test_the_start_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("FEDSIM_WORKER_START_SECONDS", raising=False)
    assert start_seconds() == 60.0
    monkeypatch.setenv("FEDSIM_WORKER_START_SECONDS", "2.5")
    assert start_seconds() == 2.5
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("FEDSIM_WORKER_START_SECONDS", bad)
        with pytest.raises(ConfigError, match="FEDSIM_WORKER_START_SECONDS: must be a number of seconds"):
            start_seconds()


def test_a_worker_gone_while_taking_descriptors_prints_no_traceback(monkeypatch, capfd):
    """What a worker that dies while it receives the run's buffers leaves the server's resource
    sharer: a connection that asked for a descriptor and closed. Without the quiet hook each one
    prints a 10-line BrokenPipeError traceback on the server's terminal."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    quiet_resource_sharer()
    shared = [resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY)) for _ in range(3)]
    pid = os.fork()
    if pid == 0:  # the "worker": asks for each descriptor, then is gone before taking it
        for descriptor in shared:
            resource_sharer._resource_sharer.get_connection(descriptor._id).close()
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.5)  # the sharer's thread answers the three requests
    try:
        raise OSError("an error of this process")
    except OSError:
        sys.excepthook(*sys.exc_info())  # other reports still go through
    err = capfd.readouterr().err
    assert "BrokenPipeError" not in err and "resource_sharer" not in err, err
    assert "OSError: an error of this process" in err


def test_a_bad_start_bound_is_refused_in_one_line_before_anything_is_written(tmp_path):
    config = write_config(tmp_path, rounds=1)
    code, _, err, _, tag = run_cli(
        ["run", str(config), "--out", str(tmp_path / "run")], FEDSIM_WORKER_START_SECONDS="soon"
    )
    assert code == 2
    assert_one_line_error(err, "FEDSIM_WORKER_START_SECONDS: must be a number of seconds > 0", "got 'soon'")
    assert not (tmp_path / "run").exists() and tagged_processes(tag) == []


def test_workers_not_started_are_each_named_with_their_last_stage():
    pool = WorkerPool.__new__(WorkerPool)  # the message alone: no processes
    pool.device, pool.stages = torch.device("cuda", 1), ["initialising CUDA on cuda:1", NOT_RUNNING, "x"]
    assert pool._timeout_message("ready", 60.0, [0, 1]) == (
        "workers 0, 1 did not start on cuda:1 within 60 s (FEDSIM_WORKER_START_SECONDS): "
        "worker 0 still initialising CUDA on cuda:1, "
        "worker 1 still starting its process (the fork server may still be importing torch); "
        "raise FEDSIM_WORKER_START_SECONDS if start-up is really this slow"
    )


def _has_imported(name: str, report: str) -> None:
    with open(report, "w") as file:
        file.write(str(name in sys.modules))


def _fork_server_pid():
    return multiprocessing.forkserver._forkserver._forkserver_pid


def test_a_fork_server_without_a_runs_imports_is_started_anew_with_them_where_no_worker_lives(tmp_path, monkeypatch):
    """A notebook's CNN run, then a LoRA run: its workers fork from a server that imported peft,
    instead of each importing it (here, two modules of this test's own, which nothing else imports)."""
    for name in ("preloaded_first", "preloaded_second"):
        (tmp_path / f"{name}.py").write_text("")
    # where a fork server started anew finds them (python 3.11's ignores the sys.path it is given)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    context = multiprocessing.get_context("forkserver")

    def imported_in_a_worker(name):
        worker = context.Process(target=_has_imported, args=(name, str(tmp_path / name)))
        worker.start()
        worker.join(60)
        return (tmp_path / name).read_text() == "True"

    start_fork_server()
    first = _fork_server_pid()
    assert not imported_in_a_worker("preloaded_first")
    start_fork_server(["preloaded_first"])
    second = _fork_server_pid()
    assert second != first and imported_in_a_worker("preloaded_first")
    start_fork_server(["preloaded_first"])
    start_fork_server()
    assert _fork_server_pid() == second  # it has them: kept
    alive = context.Process(target=time.sleep, args=(60,))
    alive.start()
    try:
        start_fork_server(["preloaded_second"])  # restarting it would end the worker alive
        assert _fork_server_pid() == second and alive.is_alive() and not imported_in_a_worker("preloaded_second")
    finally:
        alive.kill()
        alive.join()
