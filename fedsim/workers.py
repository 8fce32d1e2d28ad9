"""The worker pool: persistent processes that train the clients of every round.

One round, as the server and each worker ``w`` of ``W`` see it::

    server                                     worker w
    write global weights and assignment
    open the round barrier:  ("train", r, groups) -> wakes up
                                               for slots in its groups (w, w+W, ... of the
                                               server's share of the round):
                                                   train the clients assignment[slots] from
                                                   the global weights; write their weights and
                                                   stats into rows `slots` of the shared buffers
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

import contextlib
import ctypes
import multiprocessing.resource_sharer
import os
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from .config import vmap_group_size
from .errors import ResourceError, WorkerError, resource_hint

STARTING, IDLE = -2, -1  # Shared.progress values besides a client id


@dataclass
class Shared:
    """Everything the workers read or write, allocated once by the server."""

    train_x: torch.Tensor  # [N, ...] device: the training inputs
    train_y: torch.Tensor  # [N] device
    client_indices: torch.Tensor  # device: every client's sample indices, concatenated
    client_offsets: torch.Tensor  # CPU [num_clients + 1]: client c owns indices[off[c]:off[c+1]]
    num_classes: int
    global_flat: torch.Tensor  # [P] device: the weights clients start from
    local_flat: torch.Tensor  # [k, P] device: one row per client slot of the round
    stats: torch.Tensor  # [k, 3] device: (sample count, mean train loss, local steps taken) per slot
    assignment: torch.Tensor  # CPU [k]: client id per slot
    step_limits: torch.Tensor  # CPU [k]: the most local steps each slot's client may take; -1: all
    progress: torch.Tensor  # CPU [W]: client each worker is training (or IDLE / STARTING)
    attackers: torch.Tensor  # CPU bool [num_clients]
    server_state: dict[str, torch.Tensor]  # the algorithm's state (see algorithms/base.py)
    client_state: dict[str, torch.Tensor]  # [num_clients, ...] each
    reports: dict[str, torch.Tensor]  # [k, ...] each: what each slot's client reported

    def tensors(self):
        for value in vars(self).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, dict):
                yield from value.values()

    def share_cpu_tensors(self) -> "Shared":
        for tensor in self.tensors():
            if tensor.device.type == "cpu":
                tensor.share_memory_()
        return self


# ----------------------------------------------------------------------------- worker side


def _die_with_parent() -> None:
    """Ask Linux to kill this worker if the server dies (even by SIGKILL): no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the server's atexit handler still terminates daemonic workers


def _worker_main(rank: int, num_workers: int, config, device: str, conn: Connection, runner: type) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the server decides
    try:
        torch.multiprocessing.set_sharing_strategy(config.sharing_strategy)
        torch.set_num_threads(1)  # one thread per worker: no oversubscription, and the same float
        # reductions in every worker (and in InlinePool), so results do not depend on `workers`
        shared: Shared = conn.recv()
        trainer = runner(config, shared, torch.device(device))
        shared.progress[rank] = IDLE
        conn.send(("ready",))
        while True:
            command = conn.recv()  # blocks until the server opens the next round
            if command[0] == "stop":
                return
            _, rnd, groups = command
            started = time.perf_counter()
            for slots in groups:
                shared.progress[rank] = int(shared.assignment[slots[0]])
                trainer.train_group(slots, rnd)
            shared.progress[rank] = IDLE
            trainer.synchronize()  # results must be in memory before the server reads them
            conn.send(("done", time.perf_counter() - started, trainer.peak_memory()))
    except (EOFError, BrokenPipeError):
        return  # the server is gone or stopping the pool
    except BaseException as e:  # report, so the server can name the cause; then die
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        finally:
            sys.exit(1)


def slot_groups(config, k: int) -> list[list[int]]:
    """The round's slots cut into groups trained together (one slot each for the process
    backend, ``vmap_group_size`` for vmap). Groups are dealt to ranks and then to workers in
    turn: the grouping depends on the round and the config, never on the number of workers or
    ranks, so neither do the results."""
    size = vmap_group_size(config) if config.backend == "vmap" else 1
    return [list(range(i, min(i + size, k))) for i in range(0, k, size)]


class ClientRunner:
    """Per-worker state: the model, the trainer, the algorithm and the attack; ``train_group``
    trains the clients of some slots from the global weights into their rows of ``local_flat``.
    (Hogwild's runner, a subclass in hogwild.py, trains the global weights themselves.)"""

    def __init__(self, config, shared: Shared, device: torch.device):
        from . import components
        from .attacks import make_attack
        from .client import LocalTrainer, VmapTrainer
        from .data.augment import augmentation_for

        self.config, self.shared, self.device = components.from_server(config), shared, device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        input_shape = tuple(shared.train_x.shape[1:])
        module = components.build_model(config.model, input_shape, shared.num_classes)
        self.algorithm = components.algorithm(config.algorithm, config.algorithm_options)
        self.algorithm.setup(config)
        self.attack = make_attack(config.attack)
        options = dict(num_classes=shared.num_classes, algorithm=self.algorithm,
                       augment=augmentation_for(config.data, input_shape))
        if config.backend == "vmap":
            self.trainer = VmapTrainer(module.to(device), shared.train_x, shared.train_y, config.local, **options)
        else:
            self.model = self._flat_model(module, device)
            self.trainer = LocalTrainer(self.model, shared.train_x, shared.train_y, config.local, **options)

    def _flat_model(self, module, device: torch.device):
        """The model the clients train: a copy of the global weights, this worker's own."""
        from .flat import FlatModel

        return FlatModel(module, device)

    def _indices(self, client: int) -> torch.Tensor:
        s = self.shared
        return s.client_indices[int(s.client_offsets[client]): int(s.client_offsets[client + 1])]

    def train_group(self, slots: list[int], rnd: int) -> None:
        from .algorithms import Clients, LocalResult
        from .streams import client_seed, group_seed

        cfg, s = self.config, self.shared
        clients = [int(s.assignment[slot]) for slot in slots]
        rows = slice(slots[0], slots[-1] + 1)
        ids = torch.tensor(clients, device=s.global_flat.device)
        local_state = self.algorithm.start_client(Clients(
            ids, rnd, s.server_state, {name: state[ids] for name, state in s.client_state.items()}))
        indices = [self._indices(c) for c in clients]
        attacked = s.attackers[clients]
        relabel = self.attack.relabel if self.attack.relabels and bool(attacked.any()) else None
        limits = [None if limit < 0 else limit for limit in s.step_limits[rows].tolist()]
        if cfg.backend == "vmap":
            weights, trained = self.trainer.train(
                indices, s.global_flat, [client_seed(cfg.seed, rnd, c) for c in clients],
                group_seed(cfg.seed, rnd, slots[0]), local_state=local_state, relabel=relabel,
                attacked=attacked.to(self.device), max_steps=limits)
            s.local_flat[rows].copy_(weights)
        else:
            trained = self.trainer.train(indices[0], s.global_flat, client_seed(cfg.seed, rnd, clients[0]),
                                         local_state=local_state, relabel=relabel, max_steps=limits[0])
            s.local_flat[rows].copy_(self.model.flat)
        sizes = torch.tensor([len(ix) for ix in indices], dtype=s.stats.dtype)
        s.stats[rows, 0] = sizes
        s.stats[rows, 1].copy_(trained.loss)
        s.stats[rows, 2].copy_(trained.steps)
        reports = self.algorithm.client_report(
            LocalResult(s.global_flat, s.local_flat[rows], trained.steps, sizes, trained.mean_gradient), local_state)
        for name, value in reports.items():
            s.reports[name][rows].copy_(value)

    def peak_memory(self) -> int:
        """Bytes: the allocator's peak on a GPU (the CUDA context comes on top), peak RSS on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ----------------------------------------------------------------------------- server side


def peak_rss_bytes() -> int:
    """This process's peak resident set size. Read from /proc: a spawned child's ru_maxrss
    starts at its parent's peak, which would make every worker report the server's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _exit_cause(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"


class WorkerPool:
    """``W`` spawned worker processes sharing the server's buffers; each trains its clients with
    a ``runner`` (a ClientRunner, or a subclass such as Hogwild's), built once in the worker.

    Creating the pool spawns the processes, which import torch (the bulk of a worker's
    start-up) while the server loads the data; ``start`` then hands them the buffers.
    """

    def __init__(self, config, num_workers: int, device: torch.device, runner: type = ClientRunner):
        ctx = mp.get_context("spawn")
        self.shared: Shared | None = None  # set by start()
        self.num_workers = num_workers
        self.round = 0
        self._closed = False
        self._in_round = False
        self.processes, self.conns = [], []
        self.peak_memory = [0] * num_workers  # bytes, as last reported by each worker
        self.busy_seconds = [0.0] * num_workers  # each worker's training time in the last round
        _LIVE_POOLS.add(self)
        _raise_descriptor_limit()
        try:
            for rank in range(num_workers):
                parent_end, child_end = ctx.Pipe()
                process = ctx.Process(target=_worker_main, name=f"fedsim-worker-{rank}", daemon=True,
                                      args=(rank, num_workers, config, str(device), child_end, runner))
                with _born_ignoring_sigint():
                    process.start()
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
        except BaseException:
            self._release()
            raise

    def start(self, shared: Shared, timeout: float) -> None:
        """Hand every worker the shared buffers, once, and wait until all are ready to train."""
        self.shared = shared
        shared.progress.fill_(STARTING)
        try:
            _check_descriptors(shared, self.num_workers)
            for conn in self.conns:
                try:
                    conn.send(shared)
                except BrokenPipeError:
                    pass  # that worker died while starting; waiting below names it
            self._await_all("ready", timeout)
        except BaseException:
            self._release()
            raise

    def run_round(self, rnd: int, clients: torch.Tensor, groups: list[list[int]], timeout: float) -> None:
        """Have the workers train the slot ``groups`` of the round's ``clients`` (one per slot)
        from ``shared.global_flat``: worker w the groups w, w+W, ..."""
        s = self.shared
        s.assignment[: len(clients)] = clients
        self.round, self._in_round = rnd, True
        if s.global_flat.is_cuda:
            torch.cuda.synchronize(s.global_flat.device)  # the global weights are written
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(("train", rnd, groups[rank::self.num_workers]))
            except (BrokenPipeError, OSError):
                self.processes[rank].join(1)
                raise WorkerError(self._failure(rank, _exit_cause(self.processes[rank].exitcode))) from None
        self._await_all("done", timeout)
        self._in_round = False

    def _await_all(self, kind: str, timeout: float) -> None:
        """Wait until every worker has sent ``kind``; raise WorkerError on the first death,
        exception report or timeout."""
        waiting = set(range(self.num_workers))
        owner = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        deadline = time.monotonic() + timeout
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(self._timeout_message(kind, timeout, sorted(waiting)))
            pipes = {self.conns[rank]: rank for rank in waiting}
            ready = wait(list(pipes) + list(owner), timeout=remaining)
            for obj in sorted(ready, key=lambda o: o not in pipes):  # messages before deaths
                if obj in pipes:
                    rank = pipes[obj]
                    try:
                        message = obj.recv()
                    except (EOFError, OSError):
                        continue  # died: its sentinel is ready too
                    if message[0] == "error":
                        raise WorkerError(self._failure(rank, message[1]))
                    if message[0] == kind:
                        waiting.discard(rank)
                    if message[0] == "done":
                        self.busy_seconds[rank], self.peak_memory[rank] = message[1], message[2]
                else:
                    rank = owner[obj]
                    self.processes[rank].join(1)
                    raise WorkerError(self._failure(rank, _exit_cause(self.processes[rank].exitcode)))

    def _progress(self, rank: int) -> int:
        return STARTING if self.shared is None else int(self.shared.progress[rank])

    def _failure(self, rank: int, cause: str) -> str:
        client = self._progress(rank)
        if client >= 0:
            where = f"while training client {client} in round {self.round}"
        elif client == STARTING:
            where = "while starting"
        else:
            where = f"between clients in round {self.round}" if self._in_round else "between rounds"
        hint = resource_hint(cause)
        return f"worker {rank} failed {where}: {cause}" + (f"; {hint}" if hint else "")

    def _timeout_message(self, kind: str, timeout: float, waiting: list[int]) -> str:
        rank = waiting[0]
        client = self._progress(rank)
        others = f" (and {len(waiting) - 1} more)" if len(waiting) > 1 else ""
        if kind == "ready":
            doing = "did not start"
        elif client >= 0:
            doing = f"did not finish client {client} of round {self.round}"
        else:
            doing = f"did not finish round {self.round}"
        return (f"worker {rank} {doing} within {timeout:.0f} s (worker_timeout){others}; "
                f"raise worker_timeout if rounds are really this slow")

    def close(self) -> None:
        """Stop every worker: politely between rounds, by signal otherwise. Never leaves one alive."""
        if self._closed:
            return
        if self.shared is not None and not self._in_round:  # started and idle: ask them to stop
            for conn in self.conns:
                try:
                    conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
            deadline = time.monotonic() + 10
            for p in self.processes:
                p.join(max(0.0, deadline - time.monotonic()))
        self._release()

    def _release(self) -> None:
        self._closed = True
        self.kill()
        for conn in self.conns:
            conn.close()
        _stop_resource_sharer()
        _LIVE_POOLS.discard(self)

    def kill(self) -> None:
        """Terminate, then kill, whatever is still alive; wait for each to be gone."""
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join()


_LIVE_POOLS: set[WorkerPool] = set()


class InlinePool:
    """``workers: 0``: the server trains the clients itself, one after another, with no worker
    process. For debugging (a breakpoint in a model's forward stops there) and for runs so small
    that starting a process costs more than training. The same code trains the same clients from
    the same streams, on one thread as a worker does, so the numbers are those of any ``workers``.
    No timeout guards a round here, and there is no process to restart."""

    num_workers = 0

    def __init__(self, config, device: torch.device, runner: type = ClientRunner):
        self.config, self.device, self.runner_type = config, device, runner
        self.busy_seconds, self.peak_memory = [0.0], [0]

    def start(self, shared: Shared, timeout: float) -> None:
        self.shared, self.runner = shared, self.runner_type(self.config, shared, self.device)

    def run_round(self, rnd: int, clients: torch.Tensor, groups: list[list[int]], timeout: float) -> None:
        s, k = self.shared, len(clients)
        s.assignment[:k] = clients
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        started = time.perf_counter()
        try:
            for slots in groups:
                try:
                    self.runner.train_group(slots, rnd)
                except Exception as e:
                    raise WorkerError(f"training client {int(s.assignment[slots[0]])} in round {rnd} failed: "
                                      f"{type(e).__name__}: {e}") from None
            self.runner.synchronize()
        finally:
            torch.set_num_threads(threads)
        self.busy_seconds, self.peak_memory = [time.perf_counter() - started], [self.runner.peak_memory()]

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _born_ignoring_sigint():
    """Ctrl-C reaches every process of the terminal's group, and the server decides what it
    means; a worker still importing torch would print a traceback. An ignored signal stays
    ignored across exec, so the worker is started while SIGINT is ignored here; meanwhile
    SIGINT is also blocked, which on Linux keeps one that arrives pending for the server's own
    handler instead of discarding it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; the worker ignores SIGINT once it runs
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _stop_resource_sharer() -> None:
    """Descriptors of CPU tensors that a dead worker never collected stay open in
    multiprocessing's resource sharer until it stops; release them. Its stop() waits for the
    sharer's thread to answer, which it cannot do while descriptors are exhausted, so the wait
    is bounded (the thread is a daemon and ends with the process)."""
    stopper = threading.Thread(target=multiprocessing.resource_sharer.stop, daemon=True)
    stopper.start()
    stopper.join(5)


_DESCRIPTOR_TARGET = 65536


def _raise_descriptor_limit() -> None:
    """Lift the soft limit on open descriptors towards the hard one, as PyTorch advises for the
    file_descriptor sharing strategy (every shared CPU tensor is one descriptor per process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _DESCRIPTOR_TARGET if hard == resource.RLIM_INFINITY else min(hard, _DESCRIPTOR_TARGET)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _check_descriptors(shared: Shared, num_workers: int) -> None:
    """Refuse to start, in one line, when the descriptor limit is too low to hand the buffers to
    the workers: running out midway leaves multiprocessing's resource sharer spinning on failed
    accepts, with a traceback each time. The server needs its open descriptors, plus for each
    worker its pipe, sentinel and handshake and, with file_descriptor, one per CPU tensor."""
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        return  # not Linux: nothing to count with
    per_tensor = torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    tensors = sum(t.device.type == "cpu" for t in shared.tensors())
    needed = open_now + num_workers * (4 + tensors * per_tensor) + 16
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        alternative = " or set sharing_strategy: file_system" if per_tensor else ""
        raise ResourceError(f"too few file descriptors: {num_workers} worker(s) need about {needed} open at "
                            f"once and the limit (ulimit -n) is {soft}; raise it (ulimit -n 65536){alternative}")


def kill_all_pools() -> None:
    """For a second Ctrl-C: end every worker at once, without the polite protocol."""
    for pool in list(_LIVE_POOLS):
        pool.kill()
