"""What a run asks of the operating system: memory figures, open descriptors, signals for child
processes."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.forkserver
import multiprocessing.resource_sharer
import os
import platform
import resource
import signal
import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from ..core.errors import ConfigError, ResourceError

if TYPE_CHECKING:
    from ..engine.buffers import RoundBuffers


def die_with_parent() -> None:
    """Ask Linux to kill this worker if its parent dies (even by SIGKILL): no orphans. A worker's
    parent is the fork server (see processes.py), which exits as soon as the server does, once
    no worker holds the "alive" pipe that the server holds: a forked worker inherits an end of
    it, and lets it go here."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the server's atexit handler still kills the workers (see pool.py)
    fork_server = multiprocessing.forkserver._forkserver
    if getattr(fork_server, "_forkserver_alive_fd", None) is not None:
        os.close(fork_server._forkserver_alive_fd)
        fork_server._forkserver_alive_fd = None


def name_this_process(name: str) -> None:
    """The name that ps and top show (Linux keeps 15 bytes of it): fedsim-worker0, ..."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15])  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
KEPT_BLOCK = 1 << 30  # blocks up to 1 GiB come from the heap, and up to 1 GiB of its free top stays


def keep_freed_memory() -> None:
    """Let this process reuse the memory it frees (glibc). By default glibc hands a large freed
    block back to the system at once (its mmap threshold, 128 KiB, rises only up to 32 MiB), and
    trims the heap's free top; the next tensor of that size is then faulted in page by page, each
    page zeroed by the kernel. A round allocates and frees stacks of updates of tens of MB many
    times, an optimal attack's line search 20 times a round: 30 rounds of ByzFL's benchmark
    against the optimal IPM took 31 s with the blocks kept, 43 s without (docs/architecture.md).
    A process keeps its peak heap instead, which a round reaches again each time. Left as it is
    where MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ is set, or without glibc."""
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK)
        libc.mallopt(M_TRIM_THRESHOLD, KEPT_BLOCK)
    except (OSError, AttributeError):
        pass  # not glibc (macOS, musl): its allocator is left as it is


def reset_peak_memory(device: torch.device) -> None:
    """Start this process's peak memory afresh: the allocator's peak on a GPU, the peak resident
    set size (VmHWM, which Linux resets to the current size) on a CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: tensors on the GPU (the allocator's peak, without the
    CUDA context), or resident set size on a CPU."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(peak_rss_bytes() / 2**20, 1)


def pss_bytes(pid: int | str = "self") -> int:
    """A process's proportional set size (Linux; this process's by default): its private memory
    plus its share of each page it shares, so that memory shared by N processes (the data, a
    frozen base) counts once over all of them, where resident set sizes count it N times; 0 where
    /proc does not say (another system, or a process gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform says, else "cpu"."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration, IndexError):
        return platform.processor() or "cpu"


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none): how busy the machine was."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


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


def exit_cause(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"


START_SECONDS_VARIABLE = "FEDSIM_WORKER_START_SECONDS"
DEFAULT_START_SECONDS = 60.0  # forking, the run's buffers, a CUDA context and the model take seconds


def start_seconds() -> float:
    """How long a pool waits for its workers to be ready: FEDSIM_WORKER_START_SECONDS, or 60 s.
    It bounds start-up alone; ``worker_timeout`` bounds rounds."""
    text = os.environ.get(START_SECONDS_VARIABLE, "").strip()
    if not text:
        return DEFAULT_START_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 1_000_000:  # also NaN
        raise ConfigError(
            f"{START_SECONDS_VARIABLE}: must be a number of seconds > 0 and at most 1,000,000, got {text[:40]!r}"
        )
    return seconds


def stop_resource_sharer() -> None:
    """Descriptors of CPU tensors that a dead worker never collected stay open in
    multiprocessing's resource sharer until it stops; release them. Its stop() waits for the
    sharer's thread to answer, which it cannot do while descriptors are exhausted, so the wait
    is bounded (the thread is a daemon and ends with the process)."""
    stopper = threading.Thread(target=multiprocessing.resource_sharer.stop, daemon=True)
    stopper.start()
    stopper.join(5)


_DESCRIPTOR_TARGET = 65536


def raise_descriptor_limit() -> None:
    """Lift the soft limit on open descriptors towards the hard one, as PyTorch advises for the
    file_descriptor sharing strategy (every shared CPU tensor is one descriptor per process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _DESCRIPTOR_TARGET if hard == resource.RLIM_INFINITY else min(hard, _DESCRIPTOR_TARGET)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def prepare_descriptor_sharing() -> None:
    """Ready this process to hand shared tensors to workers: a higher descriptor limit, and the
    resource sharer's broken connections kept off the terminal (see quiet_resource_sharer)."""
    raise_descriptor_limit()
    quiet_resource_sharer()


def quiet_resource_sharer() -> None:
    """A worker that dies while it takes its shared tensors' descriptors (killed, or out of memory,
    during start-up) breaks its connection to multiprocessing's resource sharer, whose thread then
    prints a traceback through sys.excepthook, once per descriptor; the pool names that worker and
    its exit cause in one line instead. Installs, once, a hook that drops exactly those reports
    (an OSError raised in the sharer's own code) and hands every other one to the hook before it."""
    if getattr(sys.excepthook, "quiets_resource_sharer", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        sharer = multiprocessing.resource_sharer.__file__
        if issubclass(kind, OSError) and trace is not None and trace.tb_frame.f_code.co_filename == sharer:
            return
        previous(kind, error, trace)

    hook.quiets_resource_sharer = True
    sys.excepthook = hook


def check_descriptors(buffers: RoundBuffers, num_workers: int) -> None:
    """Refuse to start, in one line, when the descriptor limit is too low to hand the buffers to
    the workers: running out midway leaves multiprocessing's resource sharer spinning on failed
    accepts, with a traceback each time. The server needs its open descriptors, plus for each
    worker its pipe, sentinel and handshake and, with file_descriptor, one per CPU tensor."""
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        return  # not Linux: nothing to count with
    per_tensor = torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    tensors = sum(t.device.type == "cpu" for t in buffers.tensors())
    needed = open_now + num_workers * (4 + tensors * per_tensor) + 16
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        alternative = " or set sharing_strategy: file_system" if per_tensor else ""
        raise ResourceError(
            f"too few file descriptors: {num_workers} worker(s) need about {needed} open at "
            f"once and the limit (ulimit -n) is {soft}; raise it (ulimit -n 65536){alternative}"
        )
