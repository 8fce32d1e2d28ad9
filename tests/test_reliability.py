"""Crashes, hangs, interrupts, resume and non-finite updates: nothing hangs, nothing is lost.

Most tests drive the real command in a subprocess; workers are found through /proc and a
tag in their environment, so a test can tell that none outlived the run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from support import (
    BASE,
    TESTS_DIR,
    assert_one_line_error,
    fork_server_of,
    installed,
    run_cli,
    shm_entries,
    shm_left_behind,
    start,
    tagged_processes,
    wait_for_round,
    worker_pids,
    write_config,
    write_faulty_config,
)

import fedsim
from fedsim.core.errors import FedsimError
from fedsim.execution.interrupts import Terminated
from fedsim.experiment import components
from fedsim.results.keys import flatten_config

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- worker failure


@pytest.mark.parametrize(
    "kind, worker, cause", [("raise", 1, "RuntimeError: injected fault"), ("exit", 0, "exited with status 3")]
)
def test_a_failing_worker_ends_the_run_with_one_line(tmp_path, kind, worker, cause):
    shm_before = shm_entries()
    config, client = write_faulty_config(tmp_path, kind, 2, worker)
    code, out, err, seconds, tag = run_cli(["run", str(config), "--out", str(tmp_path / "run")])
    assert code == 1 and seconds < 30
    assert_one_line_error(err, f"worker {worker} failed while training client {client} in round 2: {cause}")
    assert tagged_processes(tag) == []
    assert shm_left_behind(shm_before) == set()
    assert re.search(r"^round\s+1/3", out, re.M)  # the rounds before the failure were kept
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds"] == 1
    assert summary["error"] == f"worker {worker} failed while training client {client} in round 2: {cause}"


def test_a_worker_killed_from_outside_ends_the_run(tmp_path):
    tag = uuid.uuid4().hex
    proc = start(["run", str(write_config(tmp_path, rounds=50)), "--out", str(tmp_path / "run")], tag)
    wait_for_round(proc, 2)
    workers = worker_pids(tagged_processes(tag))
    assert len(workers) == 2
    t0 = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and time.monotonic() - t0 < 30
    assert_one_line_error(err, "killed by SIGKILL")
    assert tagged_processes(tag) == []


def test_a_hung_worker_hits_the_timeout(tmp_path):
    config, client = write_faulty_config(tmp_path, "hang", 2, 1, worker_timeout=3)
    code, _, err, seconds, tag = run_cli(["run", str(config), "--out", str(tmp_path / "run")])
    assert code == 1 and seconds < 30
    assert_one_line_error(err, f"worker 1 did not finish client {client} of round 2 within 3 s (worker_timeout)")
    assert tagged_processes(tag) == []


def test_restart_reruns_the_round_and_changes_nothing(tmp_path):
    clean = fedsim.run(BASE, out=tmp_path / "clean", quiet=True)  # plain fedavg
    fired = tmp_path / "fired"
    config, _ = write_faulty_config(tmp_path, "kill", 2, 1, once=fired, on_worker_failure="restart")
    code, out, err, _, tag = run_cli(["run", str(config), "--out", str(tmp_path / "restarted")])
    assert code == 0, err
    assert fired.exists()  # the fault did strike, once
    assert "restarting the workers and re-running the round" in err
    assert fedsim.load_run(tmp_path / "restarted").test_accuracy == clean.test_accuracy
    assert tagged_processes(tag) == []


# ----------------------------------------------------------------------------- interrupts


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_interrupt_stops_cleanly_and_keeps_what_was_written(tmp_path, signum, status):
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = start(["run", str(write_config(tmp_path, rounds=500)), "--out", str(run_dir)], tag)
    wait_for_round(proc, 3)
    t0 = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == status and time.monotonic() - t0 < 10
    assert f"fedsim run --resume {run_dir}" in err
    assert tagged_processes(tag) == []
    rows = fedsim.load_run(run_dir).rows
    assert len(rows) >= 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["checkpoint_round"] >= 3
    assert (run_dir / "checkpoint.pt").is_file() and (run_dir / "accuracy.png").is_file()


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    tag = uuid.uuid4().hex
    proc = start(["run", str(write_config(tmp_path, rounds=500)), "--out", str(tmp_path / "run")], tag)
    wait_for_round(proc, 2)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    time.sleep(0.5)
    assert tagged_processes(tag) == []


SIGNALLED_IN_A_FINALIZER = """
import os, signal, time
from fedsim.execution.interrupts import install_handlers

class SignalledWhileCollected:
    def __del__(self):
        os.kill(os.getpid(), {signum})
        for _ in range(100_000):  # the handler runs here, where Python cannot raise
            pass

install_handlers(lambda: None)
try:
    SignalledWhileCollected()
    time.sleep(10)
    print("went on")
except BaseException as e:  # KeyboardInterrupt, or fedsim.execution.interrupts.Terminated
    print(type(e).__name__)
"""


@pytest.mark.parametrize(
    "signum, raised",
    [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Terminated"), (signal.SIGHUP, "Terminated")],
)
def test_a_signal_handled_inside_a_finalizer_still_stops_the_command(tmp_path, signum, raised):
    """Python swallows an exception raised in a finalizer (``Exception ignored in ...``); the run
    must still stop, and say nothing of it."""
    script = tmp_path / "finalizer.py"
    script.write_text(SIGNALLED_IN_A_FINALIZER.format(signum=int(signum)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert (done.stdout.strip(), done.stderr) == (raised, "")


SIGNALLED_ON_ANOTHER_THREAD = """
import os, signal, subprocess, sys, threading, time
from fedsim.execution.interrupts import children_born_blocking, install_handlers

install_handlers(lambda: None)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread that blocks no signal
try:
    with children_born_blocking({{signal.SIGINT, signal.SIGTERM}}):
        blocked = "import signal; print(sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, ()))))"
        child = subprocess.Popen([sys.executable, "-c", blocked], stdout=subprocess.PIPE, text=True)
        os.kill(os.getpid(), {signum})  # this thread blocks it: the kernel hands it to the other one
        time.sleep(0.5)
        print("held", flush=True)
    time.sleep(30)
    print("went on")
except BaseException as e:  # KeyboardInterrupt, or fedsim.execution.interrupts.Terminated
    print(type(e).__name__)
print(child.communicate()[0].strip())
"""


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Terminated")])
def test_a_signal_while_a_child_starts_is_held_then_stops_the_command(tmp_path, signum, raised):
    """While a worker or the fork server starts, the stop signals are blocked in the main thread
    for the child to be born with them blocked; one that another thread receives meanwhile is
    held, and raised once the start is done, never lost."""
    script = tmp_path / "another_thread.py"
    script.write_text(SIGNALLED_ON_ANOTHER_THREAD.format(signum=int(signum)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:3] == ["held", raised, "[2, 15]"], done.stdout + done.stderr
    assert done.stderr == ""


FORK_SERVER_WAITING = """
import os, sys, time
if "multiprocessing.forkserver" in " ".join(sys.orig_argv):  # a fork server slow to start, until told
    while not os.path.exists({go!r}):
        time.sleep(0.01)
"""


def _blocked(pid: int) -> set[int]:
    """The signals that the main thread of ``pid`` blocks (its SigBlk in /proc)."""
    mask = int(re.search(r"^SigBlk:\s*(\w+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1), 16)
    return {signum for signum in range(1, 65) if mask >> (signum - 1) & 1}


def test_ctrl_c_while_the_workers_start_stops_the_run_in_one_line(tmp_path):
    # the command waits for a worker's start with the stop signals blocked in its main thread, as
    # long as the fork server's imports take: here until the test says so (sitecustomize)
    go = tmp_path / "go"
    (tmp_path / "sitecustomize.py").write_text(FORK_SERVER_WAITING.format(go=str(go)))
    tag = uuid.uuid4().hex
    proc = start(
        ["run", str(write_config(tmp_path)), "--out", str(tmp_path / "run")],
        tag,
        popen_options={"start_new_session": True},
        PYTHONPATH=f"{tmp_path}{os.pathsep}{TESTS_DIR}",
    )
    # exactly those two blocked once the fork server runs: the pool's start of a worker (the
    # resource tracker is started with the same two blocked, but before the fork server)
    deadline = time.monotonic() + 60
    while not (fork_server_of(proc.pid) and _blocked(proc.pid) == {signal.SIGINT, signal.SIGTERM}):
        assert time.monotonic() < deadline, "the command never started a worker"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C, while the worker is being started
    time.sleep(0.3)
    go.touch()
    _, err = proc.communicate(timeout=60)
    run_dir = tmp_path / "run"
    assert proc.returncode == 130, err
    assert err == f"fedsim: interrupted before the first checkpoint; what was written is in {run_dir}\n", err
    time.sleep(0.5)
    assert tagged_processes(tag) == []


# ----------------------------------------------------------------------------- resume


def test_resume_continues_exactly(tmp_path):
    full = fedsim.run(BASE, out=tmp_path / "full", quiet=True, rounds=5)
    fedsim.run(BASE, out=tmp_path / "part", quiet=True, rounds=2)
    resumed = fedsim.resume(tmp_path / "part", quiet=True, rounds=5)
    assert resumed.round == [1, 2, 3, 4, 5]
    for column in ("test_accuracy", "test_loss", "train_loss"):
        assert getattr(resumed, column) == getattr(full, column), column  # bit-identical on CPU


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_servers_random_stream_of_the_uninterrupted_one(tmp_path):
    """Where no client trains (every one offline here), nothing else moves the server's global
    generator: a resumed run must end with the stream its checkpoint restored, although with
    workers: 0 it builds the model it trains clients with after the restore."""
    cfg = {**BASE, "workers": 0, "system": {"availability": 0.01}}
    fedsim.run(cfg, out=tmp_path / "full", quiet=True, rounds=4)
    fedsim.run(cfg, out=tmp_path / "part", quiet=True, rounds=2)
    fedsim.resume(tmp_path / "part", quiet=True, rounds=4)
    streams = [
        torch.load(tmp_path / run / "checkpoint.pt", weights_only=False)["torch_rng"] for run in ("full", "part")
    ]
    assert torch.equal(*streams)


def test_a_server_killed_mid_run_resumes_to_the_uninterrupted_metrics(tmp_path):
    full = fedsim.run(BASE, out=tmp_path / "full", quiet=True, rounds=6)
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "killed"
    proc = start(["run", str(write_config(tmp_path, rounds=6)), "--out", str(run_dir)], tag)
    wait_for_round(proc, 3)
    proc.kill()  # SIGKILL: no chance to clean up; the workers must die with it
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes(tag) == []
    code, _, err, _, _ = run_cli(["run", "--resume", str(run_dir)])
    assert code == 0, err
    assert fedsim.load_run(run_dir).test_accuracy == full.test_accuracy


def test_a_run_killed_after_its_last_checkpoint_is_finished_by_resume(tmp_path):
    """Killed between the checkpoint of its last round and summary.json and the plot (the files are
    then those of the finished run without these two): load_model says how to finish it, and the
    command it names writes them as the uninterrupted run did."""
    whole = fedsim.run({**BASE, "workers": 0}, out=tmp_path / "run", quiet=True)
    for file in ("summary.json", "accuracy.png"):
        (tmp_path / "run" / file).unlink()
    with pytest.raises(FedsimError) as error:
        fedsim.load_model(tmp_path / "run")
    command = f"fedsim run --resume {tmp_path / 'run'}"
    assert str(error.value) == (
        f"{tmp_path / 'run'}: no summary.json, which says the shape of the run's data: the run stopped before "
        f"writing it; `{command}` finishes the run and writes it"
    )
    code, out, err, _, _ = run_cli(command.split()[1:])
    assert code == 0, err
    assert f"every round done (the checkpoint of round 3); writing its summary and plot in {tmp_path / 'run'}" in out
    assert (tmp_path / "run" / "accuracy.png").is_file()
    summary = fedsim.load_run(tmp_path / "run").summary
    for key in ("status", "rounds", "final_test_accuracy", "best_test_accuracy", "final_test_loss", "input_shape"):
        assert summary[key] == whole.summary[key], key
    assert fedsim.load_model(tmp_path / "run") is not None
    code, out, err, _, _ = run_cli(command.split()[1:])  # now it is done
    assert code == 0 and "already at round 3 of 3; nothing to do" in out, err


def test_resume_refuses_changes_that_would_split_the_run(tmp_path):
    fedsim.run(BASE, out=tmp_path / "run", quiet=True, rounds=1)
    code, _, err, _, _ = run_cli(["run", "--resume", str(tmp_path / "run"), "--set", "local.lr=0.5"])
    assert code == 2
    assert_one_line_error(err, "--set local.lr: cannot change when resuming")
    # a change the run's other keys refuse as well is named as a change first
    code, _, err, _, _ = run_cli(["run", "--resume", str(tmp_path / "run"), "--set", "local.lr=-1"])
    assert code == 2
    assert_one_line_error(err, "--set local.lr: cannot change when resuming")


def test_resume_refuses_to_replan_a_cosine_schedule(tmp_path):
    """A cosine run's rates are planned over its rounds: more rounds would re-plan those left, and
    the run would match neither plan."""
    fedsim.run(
        {**BASE, "workers": 0, "rounds": 2, "local": {**BASE["local"], "lr_schedule": "cosine"}},
        out=tmp_path / "run",
        quiet=True,
    )
    code, _, err, _, _ = run_cli(["run", "--resume", str(tmp_path / "run"), "--set", "rounds=4"])
    assert code == 2
    assert_one_line_error(
        err,
        f"--set rounds=4: cannot change when resuming; {tmp_path / 'run'} anneals its learning rate over its 2 "
        "rounds (local.lr_schedule: cosine), and the rounds before and after would not be one run",
    )


# ----------------------------------------------------------------------------- non-finite updates


def test_a_nan_update_is_dropped_and_counted(tmp_path):
    config, client = write_faulty_config(tmp_path, "nan", 2, 0)
    code, out, err, _, _ = run_cli(["run", str(config), "--out", str(tmp_path / "run")])
    assert code == 0, err
    assert f"dropped 1 client(s) with non-finite weights: [{client}]" in err
    history = fedsim.load_run(tmp_path / "run")
    assert history.dropped_clients == [0, 1, 0]
    assert all(acc == acc for acc in history.test_accuracy)  # the global model stayed finite
    assert history.test_accuracy[-1] > 0.2


def test_a_nan_update_can_stop_the_run(tmp_path):
    config, client = write_faulty_config(tmp_path, "nan", 2, 0, on_nonfinite="fail")
    code, _, err, _, tag = run_cli(["run", str(config), "--out", str(tmp_path / "run")])
    assert code == 1
    assert_one_line_error(err, f"round 2: client {client} sent non-finite (NaN/Inf) weights", "on_nonfinite: fail")
    assert tagged_processes(tag) == []


def test_resume_from_a_broken_or_missing_checkpoint_is_one_line(tmp_path, capsys):
    from fedsim.cli import main

    fedsim.run(BASE, out=tmp_path / "run", quiet=True, rounds=1)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    checkpoint.write_bytes(b"not a checkpoint")
    for run_dir, message in [
        (tmp_path / "run", f"{checkpoint}: corrupt or not a fedsim checkpoint"),
        (tmp_path / "nowhere", "not a run directory (no config.yaml)"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["run", "--resume", str(run_dir)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err
    checkpoint.unlink()
    with pytest.raises(SystemExit):
        main(["run", "--resume", str(tmp_path / "run")])
    assert "no checkpoint.pt to resume from" in capsys.readouterr().err


# ----------------------------------------------------------------------------- resumes of every algorithm

TIMES = {"seconds", "elapsed_seconds", "train_seconds", "worker_seconds", "aggregate_seconds", "eval_seconds"}


def algorithm_config(name: str, tmp_path, rounds: int) -> dict:
    """A run of ``name`` small enough to run four times: the LoRA methods on the one-layer
    char_transformer of the LoRA tests, the others on 600 generated samples."""
    if name in ("fedsa_lora", "flora", "hetlora"):
        if not installed("peft"):
            pytest.skip("peft is not installed")
        from test_lora_methods import lora_config, play_root

        return lora_config(play_root(tmp_path)[0], name, algorithm=name, rounds=rounds)
    # fedproto's figures are its clients' own models, by the nearest prototype: resumed, they must match too
    personal = name == "fedproto"
    return {
        "name": name,
        "seed": 1,
        "rounds": rounds,
        "workers": 0,
        "clients_per_round": 3,
        "algorithm": name,
        "data": {"dataset": "synthetic", "num_clients": 6, "limit": 600, "test_partition": personal},
        "local": {"batch_size": 32, "lr": 0.05},
        "eval_per_client": personal,
        **({"model": "cifar_cnn_bn"} if name == "fedbn" else {}),  # fedbn needs batch norm
        # cfl splits its clusters from round 2 on, so that the resumed rounds hold several
        **(
            {"algorithm_options": {"start_round": 2, "eps1": 10.0, "eps2": 0.0, "min_cluster_size": 1}}
            if name == "cfl"
            else {}
        ),
    }


class StopAt:
    """A callback that, at the end of round ``rnd``, sends this process SIGTERM (held until the
    round's files and checkpoint are written, as a real one is) or copies the run directory as a
    kill -9 at that moment leaves it: the round's rows written, its checkpoint not yet."""

    def __init__(self, rnd: int, copy_to=None):
        self.rnd, self.copy_to = rnd, copy_to

    def on_run_start(self, run):
        self.run_dir = run.run_dir

    def on_round_end(self, row, clients):
        if row["round"] != self.rnd:
            return
        if self.copy_to is None:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            shutil.copytree(self.run_dir, self.copy_to)


class LiveModel:
    """A callback keeping the run's global model as the server holds it when the run ends."""

    def on_run_start(self, run):
        self.model = run.model

    def on_run_end(self, history):
        self.state = {key: tensor.clone() for key, tensor in self.model.state_dict().items()}


def finished_run(run_dir) -> tuple:
    """What a run leaves: its rows but their times, its clients' rows, its checkpoint's tensors
    and the model fedsim.load_model builds (for FLoRA, the base with the merges)."""
    history = fedsim.load_run(run_dir)
    rows = [{k: v for k, v in row.items() if k not in TIMES} for row in history.rows]
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    tensors = dict(
        flatten_config({k: state[k] for k in ("global", "server_optimizer", "algorithm", "privacy", "client_state")})
    )
    model = fedsim.load_model(run_dir).state_dict()
    return rows, history.client_records, tensors, model


def assert_same_run(resumed, whole) -> None:
    rows, clients, tensors, model = finished_run(resumed)
    rows_w, clients_w, tensors_w, model_w = finished_run(whole)
    assert json.dumps(rows) == json.dumps(rows_w)  # NaN == NaN, every bit of every float
    assert json.dumps(clients) == json.dumps(clients_w)
    for what, got, want in (("checkpoint", tensors, tensors_w), ("load_model", model, model_w)):
        assert got.keys() == want.keys(), what
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(got[key], want[key]), (what, key)


@pytest.mark.parametrize("name", components.tables()["algorithms"].names())
def test_every_algorithm_resumes_to_the_uninterrupted_run_bit_for_bit(name, tmp_path):
    """Stopped after round 2 of 4, by a run of 2 rounds, by SIGTERM, or by a kill -9 after round 3's
    rows but before its checkpoint: resumed, each ends as the run of 4 rounds did, exactly."""
    live, killed = LiveModel(), StopAt(3, copy_to=tmp_path / "killed")  # the copy leaves the run as it was
    whole = fedsim.run(
        algorithm_config(name, tmp_path, 4), out=tmp_path / "whole", quiet=True, callbacks=[live, killed]
    )
    whole = whole.run_dir
    loaded = fedsim.load_model(whole).state_dict()
    assert loaded.keys() == live.state.keys()
    assert all(torch.equal(loaded[key], live.state[key]) for key in loaded)  # load_model: the run's own model
    fedsim.run(algorithm_config(name, tmp_path, 2), out=tmp_path / "stopped", quiet=True)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(Terminated(signum)))
    try:
        with pytest.raises(Terminated):
            fedsim.run(algorithm_config(name, tmp_path, 4), out=tmp_path / "term", quiet=True, callbacks=[StopAt(2)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(fedsim.load_run(tmp_path / "killed").rows) == 3
    assert torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["round"] == 2
    for stopped in ("stopped", "term", "killed"):
        fedsim.resume(tmp_path / stopped, rounds=4, quiet=True)
        assert_same_run(tmp_path / stopped, whole)
