"""Several ranks, started by ``fedsim run --ranks`` or by torchrun (gloo on CPU, on this machine):
the numbers of one process, whatever the number of ranks or "machines"; a rank that dies ends the
job, naming it; a signal, or the launcher's death, stops every rank within seconds, as a single
process stops, and fedsim's launcher exits as rank 0 did."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from support import start, tagged_processes, wait_for_round

import fedsim

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo ranks are tested on Linux"),
    pytest.mark.slow,
]

CONFIG = {
    "name": "ranks",
    "seed": 5,
    "device": "cpu",
    "rounds": 3,
    "workers": 1,
    "clients_per_round": 6,
    "model": "mnist_2nn",
    "data": {"dataset": "synthetic", "num_clients": 12, "limit": 1200, "partition": "dirichlet", "alpha": 0.5},
    "local": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
}
# gloo binds to the address the host name resolves to, which a container may not route: use loopback
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, port: int) -> tuple[str, ...]:
    return (
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--monitor-interval=0.2",
    )


def launched(args: list[str], tag: str, launcher: str = "fedsim", nproc: int = 2):
    """``fedsim ARGS`` as ``nproc`` ranks on this machine, by fedsim's launcher or torchrun."""
    if launcher == "fedsim":
        return start([*args, "--ranks", str(nproc)], tag)
    return start(args, tag, launcher=torchrun(nproc, free_port()), **LOOPBACK)


def write_config(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "ranks.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, **changes}))
    return path


def ranked_run(tmp_path: Path, config: Path, launcher: str = "fedsim", timeout: float = 120) -> Path:
    out, tag = tmp_path / f"ranked-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    proc = launched(["run", str(config), "--out", str(out)], tag, launcher)
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr
    round_lines = [line for line in stdout.splitlines() if re.match(r"round\s+\d+/", line)]
    assert len(round_lines) == CONFIG["rounds"]  # rank 0's lines only: the others print nothing
    assert tagged_processes(tag) == []
    return out


def same_results(a: Path, b: Path) -> None:
    """Bit for bit: every accuracy, loss and per-client record (times aside)."""

    def rows(path, name):
        with open(path / name) as f:
            return [{k: v for k, v in row.items() if "seconds" not in k} for row in csv.DictReader(f)]

    assert rows(a, "metrics.csv") == rows(b, "metrics.csv")
    assert rows(a, "clients.csv") == rows(b, "clients.csv")


@pytest.mark.parametrize("launcher", ["fedsim", "torchrun"])
def test_two_ranks_give_the_metrics_of_one_process(tmp_path, launcher):
    config = write_config(tmp_path)
    single = fedsim.run(config, out=tmp_path / "single", quiet=True).run_dir
    ranked = ranked_run(tmp_path, config, launcher)
    same_results(single, ranked)
    summary = json.loads((ranked / "summary.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(r["server_peak_memory_mb"] > 0 and len(r["worker_peak_memory_mb"]) == 1 for r in summary["ranks"])


@pytest.mark.parametrize(
    "changes",
    [{"aggregator": "krum", "aggregator_options": {"f": 1}}, {"algorithm": "scaffold"}],
    ids=["krum", "scaffold"],
)
def test_a_robust_rule_and_scaffold_across_ranks_equal_one_process(tmp_path, changes):
    config = write_config(tmp_path, workers=0, **changes)  # in-process training on each rank: same numbers
    single = fedsim.run(config, out=tmp_path / "single", quiet=True).run_dir
    ranked = ranked_run(tmp_path, config)
    same_results(single, ranked)
    ranks = json.loads((ranked / "summary.json").read_text())["ranks"]
    assert [r["worker_peak_memory_mb"] for r in ranks] == [[], []]  # no worker: the rank's server trained


def test_two_machines_on_loopback_give_the_same_metrics(tmp_path):
    config, port, tag = write_config(tmp_path, workers=0), free_port(), uuid.uuid4().hex
    out = tmp_path / "two-nodes"
    machine = ["--ranks", "1", "--nodes", "2", "--rendezvous", f"127.0.0.1:{port}"]
    nodes = [
        start(["run", str(config), "--out", str(out), *machine, "--node-rank", str(rank)], tag, **LOOPBACK)
        for rank in (0, 1)
    ]
    results = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], results
    assert results[1][0] == ""  # the second machine's rank prints nothing
    single = fedsim.run(config, out=tmp_path / "single", quiet=True).run_dir
    same_results(single, out)
    assert tagged_processes(tag) == []


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_ends_the_job_naming_it(tmp_path, victim):
    tag = uuid.uuid4().hex
    config = write_config(tmp_path, rounds=500)
    proc = launched(["run", str(config), "--out", str(tmp_path / "run"), "--no-progress"], tag)
    wait_for_round(proc, 2)
    ranks = _ranks(tag)
    assert sorted(ranks) == [0, 1]
    t0 = time.monotonic()
    os.kill(ranks[victim], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == (1 if victim else 128 + signal.SIGKILL)  # rank 0's status: its error, or its death
    ours = [line for line in err.splitlines() if line.startswith("fedsim:")]
    assert len(ours) == 1 and f"rank {victim} died" in ours[0], err
    assert "Traceback" not in err
    assert _all_gone(tag)  # the launcher reaps what it started


def test_a_peer_still_exiting_when_its_socket_closes_is_named():
    """A killed rank's sockets close a moment before it leaves the process table; on a busy
    machine its peer can read the process table inside that moment. The peer waits a little."""
    import torch.distributed as dist

    from fedsim.execution.distributed import Ranks

    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        ranks = Ranks()
        ranks.rank, ranks.world, ranks.agent_store, ranks.store = 1, 2, True, dist.HashStore()
        ranks.identities = [(socket.gethostname(), dying.pid), (socket.gethostname(), os.getpid())]
        assert ranks.lost() == []  # still running
        t0 = time.monotonic()
        assert ranks.lost(grace=30) == [0]
        assert dying.poll() is not None and time.monotonic() - t0 < 10
        ranks.identities[0] = (socket.gethostname(), os.getppid())
        t0 = time.monotonic()
        assert ranks.lost(grace=0.3) == [] and time.monotonic() - t0 >= 0.3  # a live peer: the wait is bounded
        ranks.identities[0] = ("another-machine", 1)
        t0 = time.monotonic()
        assert ranks.lost(grace=30) == [] and time.monotonic() - t0 < 10  # nothing here to wait for
    finally:
        dying.kill()
        dying.wait()


def _ranks(tag: str) -> dict[int, int]:
    """The job's rank processes (not their workers), by rank."""
    return {
        int(_environment(pid)["LOCAL_RANK"]): pid
        for pid in tagged_processes(tag)
        if "LOCAL_RANK" in _environment(pid) and b"multiprocessing" not in _cmdline(pid)
    }


def _all_gone(tag: str, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    return tagged_processes(tag) == []


def _interrupted_run(run_dir: Path, err: str, stopped: str = "interrupted") -> None:
    """What a stopped job left: one line from fedsim with the way to continue, and rank 0's files
    in step with each other."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = fedsim.load_run(run_dir).rows
    assert summary["status"] == "interrupted" and summary["rounds"] == len(rows) == summary["checkpoint_round"] >= 2
    ours = [line for line in err.splitlines() if line.startswith("fedsim:")]
    assert ours == [
        f"fedsim: {stopped}; metrics so far and the checkpoint of round {len(rows)} are in {run_dir}; "
        f"continue with: fedsim run --resume {run_dir}"
    ], err


@pytest.mark.parametrize(
    "launcher, target, signum, code",
    [
        ("fedsim", "launcher", signal.SIGINT, 130),
        ("fedsim", "ranks", signal.SIGTERM, 143),
        ("torchrun", "ranks", signal.SIGTERM, 143),
    ],
)
def test_a_signal_stops_every_rank_within_seconds(tmp_path, launcher, target, signum, code):
    """Ctrl-C reaches the launcher, which sends it on to every rank's process group; a scheduler's
    SIGTERM reaches every rank's group itself. Either way each rank stops where it is, at once, and
    fedsim's launcher ends as rank 0 did (torchrun ends with its own traceback and status 1)."""
    tag, run_dir = uuid.uuid4().hex, tmp_path / "run"
    proc = launched(
        ["run", str(write_config(tmp_path, rounds=500)), "--out", str(run_dir), "--no-progress"], tag, launcher
    )
    wait_for_round(proc, 2)
    ranks = _ranks(tag)
    assert sorted(ranks) == [0, 1]
    t0 = time.monotonic()
    if target == "launcher":
        proc.send_signal(signum)
    else:
        for pid in ranks.values():
            os.killpg(pid, signum)  # the rank and its workers, as torchrun does
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10, err
    _interrupted_run(run_dir, err)
    if launcher == "fedsim":
        assert proc.returncode == code and "Traceback" not in err and "c10d" not in err, err
    else:  # torchrun's report gives each rank's exit status
        assert sorted(re.findall(r"exitcode\s+: (-?\d+)", err)) == [str(code)] * 2, err
    assert _all_gone(tag)


def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    tag, run_dir = uuid.uuid4().hex, tmp_path / "run"
    proc = launched(["run", str(write_config(tmp_path, rounds=500)), "--out", str(run_dir), "--no-progress"], tag)
    wait_for_round(proc, 2)
    assert sorted(_ranks(tag)) == [0, 1]
    t0 = time.monotonic()
    proc.kill()  # the ranks run in sessions of their own: nothing reaches them
    _, err = proc.communicate(timeout=60)  # the ranks hold its output pipes until they end
    assert time.monotonic() - t0 < 10, err
    _interrupted_run(run_dir, err, "stopped because its launcher is gone")
    assert _all_gone(tag)


def _environment(pid: int) -> dict:
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
