"""``fedsim run --ranks N``: start the ranks of a job (distributed.py) and end as they did.

    fedsim run FILE --ranks 2                                                 # one machine
    fedsim run FILE --ranks 2 --nodes 2 --node-rank I --rendezvous HOST:PORT  # on machine I

Each rank is ``fedsim run`` with the same arguments, started in a process group of its own with
the variables torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
the launcher of machine 0 holds the job's store. The launcher passes each stop signal on to
every rank and waits for them: the ranks say what happened (rank 0 the interrupted line and the
resume command, a rank that saw another die names it), and the command exits as rank 0 did: 130
after Ctrl-C, 143 after SIGTERM, fedsim's own status after an error. Where torchrun stops the other ranks the
moment one ends, cutting short what they were about to say, and then ends with its own
traceback and status 1, this launcher gives them time to end on their own, and stops only a
rank still running ``GRACE_SECONDS`` after the first one ended.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from ..core.errors import FedsimError
from .rendezvous import ranks_named

GRACE_SECONDS = 30.0  # a rank whose peer ended sees it in its next collective, well within this
KILL_SECONDS = 10.0  # then SIGTERM's time to stop a rank, as a single process stops, before SIGKILL
LAUNCHER = "FEDSIM_LAUNCHER_PID"  # tells a rank that its --ranks are this launcher's, not its own to start
STOPS = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}


def launch(argv: list[str], ranks: int, nodes: int = 1, node_rank: int = 0, rendezvous: str | None = None) -> int:
    """Run ``fedsim <argv>`` as ``ranks`` ranks on this machine, of a job of ``nodes`` machines
    (this one ``node_rank``, meeting at ``rendezvous``, HOST:PORT of node 0); the job's exit status."""
    check_launch(ranks, nodes, node_rank, rendezvous)
    host, port = ("127.0.0.1", free_port()) if nodes == 1 else rendezvous.rsplit(":", 1)
    env = {**os.environ, "MASTER_ADDR": host, "MASTER_PORT": str(port), LAUNCHER: str(os.getpid())}
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the store is machine 0's launcher's, as torchrun's agent's
    env.update(WORLD_SIZE=str(nodes * ranks), LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK=str(node_rank))
    if nodes == 1:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback_name())  # the ranks talk over loopback
    procs: dict[int, subprocess.Popen] = {}
    stopped: list[int] = []

    def pass_on(signum, frame):
        stopped.append(signum)
        for proc in procs.values():
            _signal_group(proc, STOPS[signum])

    previous = {signum: signal.signal(signum, pass_on) for signum in STOPS}
    try:
        for local in range(ranks):
            if stopped:
                break
            rank = node_rank * ranks + local
            procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "fedsim", *argv],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(local)},
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which passes it on once
            )
        store = _host_store(int(port)) if node_rank == 0 and procs else None  # while the ranks import torch
        code = _wait(procs, name_killed=node_rank > 0) if procs else 128 + stopped[0]
        del store  # kept until every rank has ended: each says there how it ended
        return code
    finally:
        for proc in procs.values():  # the launcher itself failed: leave nothing behind
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait(procs: dict[int, subprocess.Popen], name_killed: bool) -> int:
    """Every rank's end; the job's status is rank 0's where it failed, else the lowest failed
    rank's. ``name_killed``: say which ranks a signal killed (SIGKILL, a crash), as nobody else
    on this machine can: rank 0, which names the ranks that die on its own machine, is elsewhere."""
    first = grace_end = kill_at = None
    while any(proc.poll() is None for proc in procs.values()):
        time.sleep(0.1)
        now = time.monotonic()
        if first is None:
            first = next((rank for rank, proc in procs.items() if proc.returncode is not None), None)
            grace_end = now + GRACE_SECONDS
        elif kill_at is None and now >= grace_end:
            late = [rank for rank, proc in procs.items() if proc.returncode is None]
            print(
                f"fedsim: {ranks_named(late)} still running {GRACE_SECONDS:g} s after rank {first} ended; stopping it",
                file=sys.stderr,
                flush=True,
            )
            for rank in late:
                _signal_group(procs[rank], signal.SIGTERM)
            kill_at = now + KILL_SECONDS
        elif kill_at is not None and now >= kill_at:
            for proc in procs.values():
                _signal_group(proc, signal.SIGKILL)
    for rank, proc in procs.items():
        if name_killed and proc.returncode < 0 and kill_at is None:
            print(f"fedsim: rank {rank} was killed by {_signal_name(-proc.returncode)}", file=sys.stderr, flush=True)
    failed = [_status(proc.returncode) for _, proc in sorted(procs.items()) if proc.returncode]
    return failed[0] if failed else 0


def _host_store(port: int):
    """The job's store (distributed.py), held by the launcher of machine 0: it outlives every rank,
    so a rank that leaves last still finds there how the others ended, where a store held by
    rank 0 would be gone with it (and c10d would print its failed calls)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    except RuntimeError as e:
        raise FedsimError(f"cannot open the job's store on port {port} ({str(e).splitlines()[0]})") from None


def started_by_launcher() -> bool:
    """Whether this process is a rank that ``launch`` started (it runs with the launcher's
    arguments, --ranks included)."""
    return os.environ.get(LAUNCHER) == str(os.getppid())


def check_launch(ranks: int, nodes: int, node_rank: int, rendezvous: str | None) -> None:
    """Refuse, in one line, what cannot make a job, before anything starts."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise FedsimError("--ranks: this process is already a rank of a job (RANK is set); drop --ranks or torchrun")
    if ranks < 1:
        raise FedsimError(f"--ranks {ranks}: expected the number of ranks on this machine, at least 1")
    if nodes < 1:
        raise FedsimError(f"--nodes {nodes}: expected the number of machines, at least 1")
    if not 0 <= node_rank < nodes:
        raise FedsimError(f"--node-rank {node_rank}: the machines of this job are 0 to {nodes - 1} (--nodes {nodes})")
    if nodes > 1:
        host, _, port = (rendezvous or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise FedsimError(
                f"--rendezvous {rendezvous}: expected HOST:PORT, where machine 0 listens and every machine can reach it"
            )
    elif rendezvous or node_rank:
        raise FedsimError("--rendezvous and --node-rank apply to a job of several machines (--nodes)")


def _status(returncode: int) -> int:
    """A shell's exit status: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """The rank and its worker processes, as a terminal's signal would reach them."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass  # it ended in between


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_name() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), for gloo: by default it
    binds to the address the host name resolves to, which a container may not route."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"
