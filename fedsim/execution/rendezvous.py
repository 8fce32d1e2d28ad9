"""Joining a job of ranks and watching its launcher (distributed.py holds the job itself).

A rank learns its place from the variables every launcher sets (``fedsim run --ranks``,
torchrun, or a person: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), meets the others in the
job's store, where each says that it joined (its host, its process and the number of ranks it
was started with), and stops itself when the process that started it is gone.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from ..core.errors import FedsimError

RENDEZVOUS_SECONDS = 600.0  # as torchrun's own rendezvous waits for its nodes (join_timeout)


def launched() -> bool:
    """Whether this process is one of several ranks (started by torchrun, or by hand)."""
    return os.environ.get("WORLD_SIZE", "1").strip() != "1" and "MASTER_ADDR" in os.environ


def launch_numbers() -> tuple[int, int]:
    """RANK and WORLD_SIZE, refused at once when no job can have them."""
    numbers = []
    for name in ("RANK", "WORLD_SIZE"):
        text = os.environ.get(name, "")
        try:
            numbers.append(int(text))
        except ValueError:
            raise FedsimError(
                f"{name}={text!r}: expected a whole number (torchrun sets it; by hand, set it for each rank)"
            ) from None
    rank, world = numbers
    if world < 1:
        raise FedsimError(f"WORLD_SIZE={world}: expected the number of ranks, at least 1")
    if not 0 <= rank < world:
        raise FedsimError(
            f"RANK={rank} with WORLD_SIZE={world}: no such rank; the ranks of this job are 0 to {world - 1}"
        )
    return rank, world


def rendezvous_seconds() -> float:
    """How long a rank waits for the others to join: FEDSIM_RENDEZVOUS_TIMEOUT, in seconds."""
    text = os.environ.get("FEDSIM_RENDEZVOUS_TIMEOUT", str(RENDEZVOUS_SECONDS))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise FedsimError(f"FEDSIM_RENDEZVOUS_TIMEOUT={text!r}: expected a number of seconds above 0")
    return seconds


def ranks_named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def store_key(what: str, rank: int) -> str:
    # torchrun restarts a failed job under the same store: keep each attempt's keys apart
    return f"fedsim/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{what}/{rank}"


def read(store: Any, key: str) -> str:
    return store.get(key).decode()


def meet(rank: int, world: int, seconds: float, agent_store: bool) -> Any:
    """The job's store, once every rank has said there that it joined; a rank that cannot be
    reached, or that does not come, within ``seconds`` is named in one line."""
    from torch.distributed import TCPStore

    host, port_text = os.environ["MASTER_ADDR"], os.environ.get("MASTER_PORT", "")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise FedsimError(f"MASTER_PORT={port_text!r}: expected a port number (1 to 65535)")
    port, deadline = int(port_text), time.monotonic() + seconds
    bound = f"within {seconds:g} s (FEDSIM_RENDEZVOUS_TIMEOUT)"
    hosts = rank == 0 and not agent_store
    if not hosts and not _reachable(host, port, deadline):
        raise FedsimError(
            f"rank {rank}: nothing answers at MASTER_ADDR={host} MASTER_PORT={port} {bound}; "
            f"start rank 0 there, or correct the address"
        )
    try:
        store = TCPStore(
            host,
            port,
            world,
            is_master=hosts,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
        )
        store.set(store_key("joined", rank), f"{socket.gethostname()} {os.getpid()} {world}")
    except RuntimeError as e:
        raise FedsimError(
            f"rank {rank}: cannot {'open' if hosts else 'use'} the job's store at {host}:{port} "
            f"({str(e).splitlines()[0]})"
        ) from None
    keys, told = [store_key("joined", r) for r in range(world)], time.monotonic() + 10.0
    # polled rather than store.wait, whose time-out c10d also logs on stderr
    while not store.check(keys):
        missing = [r for r in range(world) if not store.check([keys[r]])]
        _same_world(store, rank, world, [r for r in range(world) if r not in missing])
        if time.monotonic() >= deadline:
            raise FedsimError(
                f"rank {rank}: {ranks_named(missing)} of {world} (WORLD_SIZE) did not join {bound}; "
                f"start every rank, or give them longer"
            )
        if time.monotonic() >= told:  # say once what it waits for, when that takes a while
            print(
                f"fedsim: rank {rank}: waiting for {ranks_named(missing)} of {world} to join (at most {seconds:g} "
                f"s: FEDSIM_RENDEZVOUS_TIMEOUT)",
                file=sys.stderr,
                flush=True,
            )
            told = float("inf")
        time.sleep(0.1)
    _same_world(store, rank, world, list(range(world)))
    return store


def _same_world(store, rank: int, world: int, joined: list[int]) -> None:
    """Refuse a job whose ranks were given different numbers of ranks: each would wait for a
    different set of peers, and those that found theirs would wait in vain for the others."""
    for peer in joined:
        said = read(store, store_key("joined", peer)).split()[2:]
        if said and said[0] != str(world):
            raise FedsimError(
                f"rank {rank}: rank {peer} was started with WORLD_SIZE={said[0]} and this rank with "
                f"{world}; start every rank with the same WORLD_SIZE (and --ranks, --nodes)"
            )


def _reachable(host: str, port: int, deadline: float) -> bool:
    """Whether something accepts connections at host:port before ``deadline``."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.1)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


_launcher_pid: int | None = None  # the process that started this rank, once watched


def watch_launcher(interval: float = 0.5) -> None:
    """Stop this rank, as SIGTERM does, when the process that started it (fedsim run --ranks, torchrun) is gone:
    ranks run in sessions of their own, so a launcher killed with SIGKILL signals nobody.
    A thread polls the parent pid. It is plain and portable, where PR_SET_PDEATHSIG is Linux
    only, fires when the parent *thread* ends, and would need its own check for a launcher that
    died before it was set."""
    global _launcher_pid
    _launcher_pid = os.getppid()

    def watch():
        while not launcher_gone():
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fedsim-launcher", daemon=True).start()


def launcher_gone() -> bool:
    """Whether the launcher this rank watches has ended (its orphans get a new parent)."""
    return _launcher_pid is not None and os.getppid() != _launcher_pid
