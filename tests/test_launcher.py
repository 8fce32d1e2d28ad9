"""fedsim's launcher of ranks (``fedsim run --ranks``), its parts alone: what it refuses, how it
waits for the ranks and which status the job ends with. The jobs themselves are in
test_distributed.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fedsim.cli import main
from fedsim.execution import launcher


@pytest.mark.parametrize(
    "options, fragment",
    [
        (["--ranks", "0"], "--ranks 0: expected the number of ranks on this machine, at least 1"),
        (["--ranks", "2", "--nodes", "0"], "--nodes 0: expected the number of machines, at least 1"),
        (["--ranks", "2", "--nodes", "2", "--node-rank", "2"], "--node-rank 2: the machines of this job are 0 to 1"),
        (["--ranks", "2", "--nodes", "2", "--rendezvous", "node0"], "--rendezvous node0: expected HOST:PORT"),
        (["--ranks", "2", "--nodes", "2"], "--rendezvous None: expected HOST:PORT"),
        (["--ranks", "2", "--rendezvous", "node0:29500"], "apply to a job of several machines (--nodes)"),
        (["--nodes", "2"], "--nodes, --node-rank and --rendezvous go with --ranks"),
    ],
)
def test_a_job_that_cannot_be_made_is_refused_in_one_line(capsys, monkeypatch, options, fragment):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as ended:
        main(["run", "no-such-file.yaml", *options])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err


def test_a_rank_of_another_launcher_does_not_launch_again(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        main(["run", "no-such-file.yaml", "--ranks", "2"])
    assert "this process is already a rank of a job (RANK is set)" in capsys.readouterr().err


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


@pytest.mark.slow
def test_the_job_ends_as_rank_0_did_else_as_the_first_failed_rank():
    assert launcher._wait({0: python("exit(0)"), 1: python("exit(0)")}, name_killed=False) == 0
    assert launcher._wait({0: python("exit(130)"), 1: python("exit(1)")}, name_killed=False) == 130
    assert launcher._wait({0: python("exit(0)"), 1: python("exit(2)"), 2: python("exit(1)")}, name_killed=False) == 2


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_where_rank_0_cannot_see_it(capsys):
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert launcher._wait({2: python("exit(0)"), 3: python(suicide)}, name_killed=True) == 128 + signal.SIGKILL
    assert capsys.readouterr().err == "fedsim: rank 3 was killed by SIGKILL\n"
    launcher._wait({0: python("exit(0)"), 1: python(suicide)}, name_killed=False)
    assert capsys.readouterr().err == ""  # on rank 0's machine rank 0 names it


@pytest.mark.slow
def test_a_rank_still_running_long_after_another_ended_is_stopped(capsys, monkeypatch):
    monkeypatch.setattr(launcher, "GRACE_SECONDS", 0.5)
    hung = python("import signal, time; signal.signal(signal.SIGTERM, lambda *a: exit(143)); time.sleep(60)")
    t0 = time.monotonic()
    assert launcher._wait({0: python("exit(0)"), 1: hung}, name_killed=False) == 143
    assert time.monotonic() - t0 < 10
    assert "fedsim: rank 1 still running 0.5 s after rank 0 ended; stopping it" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rank_that_ignores_the_stop_is_killed(monkeypatch):
    monkeypatch.setattr(launcher, "GRACE_SECONDS", 0.2)
    monkeypatch.setattr(launcher, "KILL_SECONDS", 0.5)
    deaf = python("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    assert launcher._wait({0: python("exit(0)"), 1: deaf}, name_killed=False) == 128 + signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(deaf.pid, 0)


def test_a_lost_peer_is_told_by_the_first_sentence_of_its_error():
    from fedsim.execution.distributed import _cause

    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:7557"
    assert _cause(RuntimeError(gloo)) == "Connection closed by peer [127.0.0.1]:7557"
    assert _cause(RuntimeError("Connection reset by peer. Details follow\nline 2")) == "Connection reset by peer"
    assert _cause(RuntimeError("")) == "RuntimeError"
