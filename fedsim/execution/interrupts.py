"""Ctrl-C, SIGTERM and SIGHUP (a closed terminal): the first stops a run cleanly, a second ends
everything at once.

A run writes its files in short critical sections (a round's row, checkpoint and line; the
summary and plot at the end). A signal that arrives inside one is held until the section
ends, so an interrupt never leaves those files half-written or out of step with each other.
"""

from __future__ import annotations

import atexit
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so that the run unwinds and cleans up; the
    command then exits as the signal would have ended it (143, or 129 after SIGHUP)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# what stops a run: Ctrl-C, a stop asked of the process, and the terminal it ran in closed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


_exiting = False  # the command has its exit status: a signal has nothing left to stop


def install_handlers(kill_workers: Callable[[], object]) -> None:
    """The command line's handlers: the first SIGINT raises KeyboardInterrupt in the main
    thread, the first SIGTERM or SIGHUP Terminated; a second calls ``kill_workers()`` and exits at once. Once
    the command has its exit status (``exiting``), both are ignored: a signal then (torchrun
    stops the ranks that are left once one has ended) must not change that status."""
    global _exiting
    _exiting = False

    def at_once(signum, frame):
        if not _exiting:
            kill_workers()
            os._exit(128 + signum)

    def first(signum, frame):
        if _exiting:
            return
        for stop in STOP_SIGNALS:
            signal.signal(stop, at_once)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    def swallowed(unraisable):
        """Python cannot raise out of a finalizer or a weakref callback: it prints "Exception
        ignored in ..." and goes on. A first signal handled there would be lost, and the run
        would go on as if nothing came; it is sent again a moment later (from a timer thread:
        sent from here, it would land here again), to be raised where it can be."""
        if not isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
            default_hook(unraisable)
        elif not _exiting:
            for stop in STOP_SIGNALS:
                signal.signal(stop, first)
            stopped = unraisable.exc_value
            signum = signal.SIGINT if isinstance(stopped, KeyboardInterrupt) else stopped.signum
            resend = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            resend.daemon = True
            resend.start()

    default_hook = sys.__unraisablehook__
    sys.unraisablehook = swallowed
    for stop in STOP_SIGNALS:
        signal.signal(stop, first)
    # the interpreter's shut-down runs no Python handler, and restores the default action (death
    # by the signal) for every signal that had one; an ignored signal stays ignored
    atexit.unregister(_ignore_stop_signals)
    atexit.register(_ignore_stop_signals)


def exiting() -> None:
    """The command has its exit status; from here on a signal changes nothing, and neither does a
    KeyboardInterrupt the command caught and handled."""
    global _exiting
    _exiting = True
    _forget_caught_interrupts()


def _forget_caught_interrupts() -> None:
    """Under ``python -m``, CPython ends the process by SIGINT instead of with its exit status when
    a KeyboardInterrupt once ended code run from source text (``exec`` of a string, as dataclasses
    and namedtuples make their methods), even one caught and handled since: a Ctrl-C that lands
    there while a run starts. Each such run forgets that as it begins, so an empty one forgets it."""
    exec("", {})


def _ignore_stop_signals() -> None:
    if _exiting:
        for stop in STOP_SIGNALS:
            signal.signal(stop, signal.SIG_IGN)


@contextmanager
def shielded() -> Iterator[None]:
    """Hold the stop signals until the block ends, then deliver the first that came to the
    handler that was in place; a second signal inside the block is delivered at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are only ever handled in the main thread
        return
    held: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def hold(signum, frame):
        if held:  # asked twice: do not wait for the block
            _deliver(signum, previous[signum])
        held.append(signum)

    try:
        for signum in previous:  # inside the try: a signal between the two still restores both
            signal.signal(signum, hold)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if held:
            _deliver(held[0], previous[held[0]])


def then_shielded(body: Callable[[], object], end: Callable[[BaseException | None], object]) -> None:
    """``body()``, then ``end(ended_by)`` with signals held, whatever happens (``ended_by``: the
    exception that ended the body, or None). A first signal can land in the instant between the
    two, before the signals are held: ``end`` still runs, and that signal is raised once it has."""
    began = False

    def shielded_end(ended_by):
        nonlocal began
        with shielded():
            began = True
            end(ended_by)

    try:
        try:
            body()
        finally:
            shielded_end(sys.exc_info()[1])
    except (KeyboardInterrupt, Terminated) as stop:
        if not began:
            shielded_end(stop.__context__ or stop)  # what ended the body, if the signal came as it ended
        raise


def _deliver(signum: int, handler) -> None:
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # the default action, now that it is back in place


@contextmanager
def children_born_blocking(signals: set[int]) -> Iterator[None]:
    """Start child processes inside this block: they are born with ``signals`` blocked, and a
    signal that comes meanwhile is held here until the block ends, as ``shielded`` holds it.

    Ctrl-C reaches every process of the terminal's group (torchrun's SIGTERM every process of a
    rank's group), and the server decides what it means; a child still importing torch would print
    a traceback, or die before the server could stop it. A blocked signal stays blocked across fork
    and exec, and pending until the child ignores it: the fork server ignores SIGINT once its
    imports are done, a worker both as it begins. (Ignoring them here for the child to inherit
    that would lose one: only this thread can block them, and one delivered to another thread
    while they are ignored is discarded.) Held, a Ctrl-C cannot cut multiprocessing's start of a
    child short either. It waits for the start to end, a second one too."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are only ever handled in the main thread
        return
    # multiprocessing starts its resource tracker with a child's first start, and unblocks
    # SIGINT and SIGTERM in this thread as it does: start it before they are blocked
    multiprocessing.resource_tracker.ensure_running()
    with shielded():
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one pending is held by shielded now
