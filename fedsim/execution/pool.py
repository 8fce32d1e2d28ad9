"""The executors of one machine: a pool of persistent worker processes, or the server itself.

One round, as the server and each worker ``w`` of ``W`` see it::

    server                                     worker w
    write global weights and assignment
    open the round barrier:  ("train", r, groups) -> wakes up
                                               for slots in its groups (w, w+W, ... of the
                                               server's share of the round):
                                                   train the clients assignment[slots] from
                                                   the global weights; write their weights and
                                                   stats into rows `slots` of the round's buffers
    wait until all W arrive  <- ("done",)      synchronize the device, arrive
    aggregate rows 0..k-1

Every tensor a worker touches is created by the server and handed over once at start-up
(CUDA IPC on a GPU, shared memory on a CPU): nothing is pickled per round but those
few-byte messages.

The round barrier is built on each worker's pipe rather than on multiprocessing.Barrier:
waking the waiters of a multiprocessing.Barrier (also to abort it) waits for each of them to
acknowledge, so one worker killed while waiting there hangs the server for good. Here the
server waits on the pipes and the process sentinels together, so an arrival, an exception
report, a death and a timeout are all seen at once, and a failure ends the round with a
message naming worker, client and round.
"""

from __future__ import annotations

import atexit
import signal
import sys
import time
from multiprocessing.connection import Connection, wait

import torch

from ..core.errors import UnguardedScript, WorkerError, exception_text, resource_hint, user_code
from ..core.threads import torch_threads
from ..engine.buffers import RoundBuffers
from ..engine.loop import Executor
from ..experiment.config import Config, vmap_group_size
from .interrupts import children_born_blocking, shielded
from .processes import UNGUARDED_SCRIPT, leave_library_warnings_to_the_server, worker_context
from .resources import (
    check_descriptors,
    die_with_parent,
    exit_cause,
    keep_freed_memory,
    name_this_process,
    prepare_descriptor_sharing,
    pss_bytes,
    reset_peak_memory,
    start_seconds,
    stop_resource_sharer,
)
from .runner import ClientRunner

STARTING, IDLE = -2, -1  # RoundBuffers.progress values besides a client id

# what reaches a worker through its process group: Ctrl-C, and torchrun's or systemd's SIGTERM;
# the server decides what they mean, and stops its workers itself
GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM}

RECEIVING = "receiving the run's config and shared buffers"
NOT_RUNNING = "starting its process (the fork server may still be importing torch)"  # no stage reported yet
FIRST_ROUND_TIMEOUT = 900.0  # the first round also pays for cuDNN set-up and first kernels


def _set_up(conn: Connection, rank: int, device: torch.device, command: tuple) -> tuple:
    """The worker's runner for the run of ``command``; each stage is told first, for a timeout to name."""
    _, config, runner, buffers = command
    # the run's threads (a kept worker's may have served another run): the same float reductions in
    # every worker and in InlinePool, so that results do not depend on `workers`
    torch.set_num_threads(config.threads)
    if device.type == "cuda":
        conn.send(("stage", f"initialising CUDA on {device}"))
        torch.cuda.set_device(device)  # creates the worker's CUDA context
    conn.send(("stage", "building its model and runner"))
    trainer = runner(config, buffers, device)
    reset_peak_memory(device)  # a kept worker's peaks are its new run's
    buffers.progress[rank] = IDLE
    conn.send(("ready",))
    return trainer, buffers


def _worker_main(rank: int, device: str, sharing_strategy: str, conn: Connection) -> None:
    try:  # everything, so that whatever fails is reported in one line, never as a traceback
        die_with_parent()
        keep_freed_memory()
        name_this_process(f"fedsim-worker{rank}")
        leave_library_warnings_to_the_server()
        for signum in GROUP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)  # born blocked: see _fork_workers
        torch.multiprocessing.set_sharing_strategy(sharing_strategy)
        trainer = buffers = None
        conn.send(("stage", RECEIVING))
        while True:
            command = conn.recv()  # blocks until the server starts a run or opens its next round
            if command[0] == "stop":
                return
            if command[0] == "setup":  # a run: its config, its routine and its shared buffers
                trainer, buffers = _set_up(conn, rank, torch.device(device), command)
                continue
            if command[0] == "release":  # the run is over; the pool is kept for another (PoolKeeper)
                trainer = buffers = None
                conn.send(("stage", RECEIVING))  # read when the next run starts the pool
                continue
            _, rnd, groups = command
            started = time.perf_counter()
            for slots in groups:
                buffers.progress[rank] = int(buffers.assignment[slots[0]])
                trainer.train_group(slots, rnd)
            buffers.progress[rank] = IDLE
            trainer.synchronize()  # results must be in memory before the server reads them
            conn.send(("done", time.perf_counter() - started, trainer.peak_memory()))
    except (EOFError, BrokenPipeError):
        return  # the server is gone or stopping the pool
    except BaseException as e:  # report, so the server can name the cause; then die
        try:
            conn.send(("error", exception_text(e)))
        finally:
            sys.exit(1)


def slot_groups(config: Config, k: int) -> list[list[int]]:
    """The round's slots cut into groups trained together (one slot each for the process
    backend, ``vmap_group_size`` for vmap). Groups are dealt to ranks and then to workers in
    turn: the grouping depends on the round and the config, never on the number of workers or
    ranks, so neither do the results."""
    size = vmap_group_size(config) if config.backend == "vmap" else 1
    return [list(range(i, min(i + size, k))) for i in range(0, k, size)]


class WorkerPool(Executor):
    """``W`` worker processes sharing the server's buffers; each trains its clients with a
    ``runner`` (a ClientRunner, or a subclass such as Hogwild's), built in the worker for the run.

    ``start`` forks the processes from the fork server (see processes.py), which has imported
    torch meanwhile, and hands them the run's config and buffers. A pool made by a PoolKeeper
    outlives its run: ``close`` hands it back to the keeper, and its processes serve the next run.
    """

    def __init__(
        self,
        config: Config,
        num_workers: int,
        device: torch.device,
        runner: type = ClientRunner,
        keeper: PoolKeeper | None = None,
    ):
        self.num_workers, self.device, self.keeper = num_workers, device, keeper
        self.sharing_strategy = config.sharing_strategy  # set once in each worker, so one per pool
        self._closed = False
        self.processes, self.conns = [], []
        _LIVE_POOLS.add(self)
        prepare_descriptor_sharing()
        self.begin_run(config, runner)

    def begin_run(self, config: Config, runner: type) -> None:
        """Settings of the run the pool serves next: ``start`` hands them to the workers."""
        self.config, self.runner = config, runner
        self.start_seconds = start_seconds()  # read here, so a bad value is refused before the run starts
        self.buffers: RoundBuffers | None = None  # set by start()
        self.round, self.slowest = 0, 0.0  # the longest round so far, in seconds (for the timeout)
        self._in_round = False
        self.peak_memory = [0] * self.num_workers  # bytes, as last reported by each worker
        # bytes, the workers' and the server's share of what they map (resources.pss_bytes), read
        # together at the few moments the session asks (read_pss): those of the highest sum
        self.pss_memory, self.server_pss = [0] * self.num_workers, 0
        self.busy_seconds = [0.0] * self.num_workers  # each worker's training time in the last round

    def _fork_workers(self) -> None:
        context = worker_context()
        for rank in range(self.num_workers):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_worker_main,
                name=f"fedsim-worker-{rank}",
                daemon=True,
                args=(rank, str(self.device), self.sharing_strategy, child_end),
            )
            # a spawned worker is born with this thread's signal mask, a fork server's with the
            # server's; and a Ctrl-C held until the start is done does not cut short the request
            # the fork server reads (it dies of one cut short, with a traceback)
            with children_born_blocking(GROUP_SIGNALS):
                process.start()
            child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)

    def start(self, buffers: RoundBuffers) -> None:
        """Hand every worker the run's config and shared buffers, once, and wait until all are
        ready to train; the first run forks the workers. The wait has its own bound whatever
        ``worker_timeout`` (for rounds) says: FEDSIM_WORKER_START_SECONDS, default 60 s."""
        self.buffers = buffers
        self.stages = [NOT_RUNNING] * self.num_workers  # what each worker last said it was doing
        buffers.progress.fill_(STARTING)
        try:
            check_descriptors(buffers, self.num_workers)
            if not self.processes:
                self._fork_workers()
            with shielded():  # a KeyboardInterrupt while a tensor is shared leaves multiprocessing's sharer broken
                for conn in self.conns:
                    try:
                        conn.send(("setup", self.config, self.runner, buffers))
                    except BrokenPipeError:
                        pass  # that worker died while starting; waiting below names it
            self._await_all("ready", self.start_seconds)
        except BaseException:
            self._release()
            raise

    def train(
        self, rnd: int, clients: torch.Tensor, start_from: torch.Tensor, groups: list[list[int]] | None = None
    ) -> None:
        """Have the workers train the slot ``groups`` (default: all of the round's, see
        slot_groups) of the round's ``clients`` (one per slot) from the weights ``start_from``:
        worker w the groups w, w+W, ..."""
        b, started = self.buffers, time.perf_counter()
        b.global_flat.copy_(start_from)
        b.assignment[: len(clients)] = clients
        groups = slot_groups(self.config, len(clients)) if groups is None else groups
        timeout = self.config.worker_timeout or (
            FIRST_ROUND_TIMEOUT if not self.slowest else max(120.0, 10 * self.slowest)
        )
        self.round, self._in_round = rnd, True
        if b.global_flat.is_cuda:
            torch.cuda.synchronize(b.global_flat.device)  # the global weights are written
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(("train", rnd, groups[rank :: self.num_workers]))
            except (BrokenPipeError, OSError):
                self.processes[rank].join(1)
                raise WorkerError(self._failure(rank, exit_cause(self.processes[rank].exitcode))) from None
        self._await_all("done", timeout)
        self._in_round = False
        self.slowest = max(self.slowest, time.perf_counter() - started)

    def _await_all(self, kind: str, timeout: float) -> None:
        """Wait until every worker has sent ``kind``; raise WorkerError on the first death,
        exception report or timeout."""
        waiting = set(range(self.num_workers))
        owner = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        deadline = time.monotonic() + timeout
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                raise WorkerError(self._timeout_message(kind, timeout, sorted(waiting)))
            pipes = {self.conns[rank]: rank for rank in waiting}
            ready = wait(list(pipes) + list(owner), timeout=deadline - now)
            for obj in sorted(ready, key=lambda o: o not in pipes):  # messages before deaths
                if obj in pipes:
                    rank = pipes[obj]
                    try:
                        message = obj.recv()
                    except (EOFError, OSError):
                        continue  # died: its sentinel is ready too
                    if message[0] == "error":
                        raise WorkerError(self._failure(rank, message[1]))
                    if message[0] == "stage":
                        self.stages[rank] = message[1]
                    if message[0] == kind:
                        waiting.discard(rank)
                    if message[0] == "done":
                        self.busy_seconds[rank], self.peak_memory[rank] = message[1:]
                else:
                    rank = owner[obj]
                    self.processes[rank].join(1)
                    if self.processes[rank].exitcode == UNGUARDED_SCRIPT:
                        raise UnguardedScript()
                    raise WorkerError(self._failure(rank, exit_cause(self.processes[rank].exitcode)))

    def read_pss(self) -> None:
        """Every process's PSS at one moment; kept where their sum is the highest so far. Reading
        smaps_rollup walks every mapping of a process (milliseconds, and the process waits
        meanwhile), so the session reads it at fixed points between rounds, never during one."""
        workers, server = [pss_bytes(p.pid) for p in self.processes], pss_bytes()
        if sum(workers) + server > sum(self.pss_memory) + self.server_pss:
            self.pss_memory, self.server_pss = workers, server

    def _progress(self, rank: int) -> int:
        return STARTING if self.buffers is None else int(self.buffers.progress[rank])

    def _failure(self, rank: int, cause: str) -> str:
        client = self._progress(rank)
        if client >= 0:
            what = f"failed while training client {client} in round {self.round}"
        elif client == STARTING:
            what = f"could not start on {self.device}"
        else:
            what = f"failed between clients in round {self.round}" if self._in_round else "failed between rounds"
        hint = resource_hint(cause)
        return f"worker {rank} {what}: {cause}" + (f"; {hint}" if hint else "")

    def _timeout_message(self, kind: str, timeout: float, waiting: list[int]) -> str:
        if kind == "ready":  # what each worker last said it was doing
            several = len(waiting) > 1
            who = f"worker{'s' * several} {', '.join(map(str, waiting))}"
            doing = ", ".join(f"worker {rank} " * several + f"still {self.stages[rank]}" for rank in waiting)
            return (
                f"{who} did not start on {self.device} within {timeout:g} s (FEDSIM_WORKER_START_SECONDS): "
                f"{doing}; raise FEDSIM_WORKER_START_SECONDS if start-up is really this slow"
            )
        rank = waiting[0]
        client = self._progress(rank)
        others = f" (and {len(waiting) - 1} more)" if len(waiting) > 1 else ""
        if client >= 0:
            doing = f"did not finish client {client} of round {self.round}"
        else:
            doing = f"did not finish round {self.round}"
        return (
            f"worker {rank} {doing} within {timeout:.0f} s (worker_timeout){others}; "
            f"raise worker_timeout if rounds are really this slow"
        )

    def close(self, finished: bool = True, ended_by: BaseException | None = None) -> None:
        """End the run. A pool with a keeper whose workers are idle and alive goes back to the
        keeper for its next run; otherwise every worker stops, politely between rounds, by signal
        otherwise. Never leaves one alive without a keeper that will stop it."""
        if self._closed:
            return
        if self.processes and not self._in_round:  # started, and idle between rounds (or runs)
            if self.keeper is not None and self._send_all(("release",)) and self.alive():
                self.keeper.keep(self)
                return
            if self._send_all(("stop",)):
                deadline = time.monotonic() + 10
                for p in self.processes:
                    p.join(max(0.0, deadline - time.monotonic()))
        self._release()

    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self.processes)

    def _send_all(self, message: tuple) -> bool:
        """Send ``message`` to every worker; False if one could not take it (it died)."""
        sent = True
        for conn in self.conns:
            try:
                conn.send(message)
            except (BrokenPipeError, OSError):
                sent = False
        return sent

    def _release(self) -> None:
        self._closed = True
        stop_resource_sharer()  # first: its thread prints a traceback if a worker dies while fetching a descriptor
        self.kill()
        for conn in self.conns:
            conn.close()
        _LIVE_POOLS.discard(self)

    def kill(self) -> None:
        """Kill whatever is still alive (SIGKILL: a worker ignores SIGTERM, and has nothing to save);
        wait for each to be gone."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join()


_LIVE_POOLS: set[WorkerPool] = set()


class InlinePool(Executor):
    """``workers: 0``: the server trains the clients itself, one after another, with no worker
    process. For debugging (a breakpoint in a model's forward stops there) and for runs so small
    that starting a process costs more than training. The same code trains the same clients from
    the same streams, on ``threads`` threads as a worker does, so the numbers are those of any
    ``workers``.
    No timeout guards a round here, and there is no process to restart."""

    num_workers = 0

    def __init__(self, config: Config, device: torch.device, runner: type = ClientRunner):
        self.config, self.device, self.runner_type = config, device, runner
        self.busy_seconds, self.peak_memory, self.pss_memory, self.server_pss = [0.0], [0], [0], 0

    def start(self, buffers: RoundBuffers) -> None:
        # building the runner's model draws from the global generator: the server's own stream, which a
        # resumed run has restored by now, and which a worker process would leave alone
        with torch.random.fork_rng(devices=[]):
            self.buffers, self.runner = buffers, self.runner_type(self.config, buffers, self.device)

    def train(
        self, rnd: int, clients: torch.Tensor, start_from: torch.Tensor, groups: list[list[int]] | None = None
    ) -> None:
        b, k = self.buffers, len(clients)
        b.global_flat.copy_(start_from)
        b.assignment[:k] = clients
        started = time.perf_counter()
        with torch_threads(self.config.threads):
            for slots in slot_groups(self.config, k) if groups is None else groups:
                with user_code(f"training client {int(b.assignment[slots[0]])} in round {rnd} failed", WorkerError):
                    self.runner.train_group(slots, rnd)
            self.runner.synchronize()
        self.busy_seconds, self.peak_memory = [time.perf_counter() - started], [self.runner.peak_memory()]

    def read_pss(self) -> None:
        self.server_pss = max(self.server_pss, pss_bytes())  # no worker: the server trains


class PoolKeeper:
    """Worker pools kept from one run to the next, for the runs of a sweep: a run whose workers
    run on the same device, in the same number and with the same sharing strategy takes the
    pool the run before it left, instead of starting its own. Everything else may differ
    (model, algorithm, data, mode, backend): each run hands the workers its own config and
    buffers when it starts. A pool comes back only when its run ended between rounds with every
    worker alive; a pool that failed is stopped, and the next run starts a fresh one. Use it as
    a context manager: leaving it stops the pools it keeps."""

    def __init__(self):
        self._idle: dict[tuple, WorkerPool] = {}

    def pool(self, config: Config, num_workers: int, device: torch.device, runner: type) -> WorkerPool:
        kept = self._idle.pop((num_workers, str(device), config.sharing_strategy), None)
        if kept is not None and kept.alive():
            kept.begin_run(config, runner)
            return kept
        if kept is not None:
            kept.keeper = None
            kept.close()
        return WorkerPool(config, num_workers, device, runner, keeper=self)

    def keep(self, pool: WorkerPool) -> None:
        key = (pool.num_workers, str(pool.device), pool.sharing_strategy)
        previous = self._idle.pop(key, None)
        if previous is not None:  # two pools alike: one is enough
            previous.keeper = None
            previous.close()
        self._idle[key] = pool

    def close(self) -> None:
        while self._idle:
            _, pool = self._idle.popitem()
            pool.keeper = None
            pool.close()

    def __enter__(self) -> PoolKeeper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kill_all_pools() -> None:
    """For a second Ctrl-C: end every worker at once, without the polite protocol."""
    for pool in list(_LIVE_POOLS):
        pool.kill()


# Before multiprocessing's own exit handler (registered earlier, so run later), whose SIGTERM a
# worker ignores: a pool left open by an error ends with the process, also where no parent-death
# signal exists.
atexit.register(kill_all_pools)
