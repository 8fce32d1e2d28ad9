"""A one-line progress display for the round loop.

The server hands every line it reports to a ``log`` callable. ``RoundLog`` is such a callable:
with the display on, the per-round lines (``round  3/10  test acc ...``) replace each other on
one line, led by a bar and followed by an estimate of the time left; any other line (start,
warnings, early stop) first ends that line and then prints as usual. With the display off,
every line prints as it comes, which is what a log file or a CI job wants.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import time

_ROUND_LINE = re.compile(r"round\s+(\d+)/(\d+)\s+(.*)")
_BAR_WIDTH = 20


class RoundLog:
    """``RoundLog(progress)(line)``: print ``line``, showing round lines as one updating line.

    ``progress``: True shows the display, False prints every line, None shows it when the
    stream is a terminal. ``quiet``: print nothing but warnings. ``stream``: where to write;
    by default ``sys.stdout`` as it is at each call (Jupyter gives every cell its own).
    """

    def __init__(self, progress: bool | None = None, stream=None, clock=time.monotonic, quiet: bool = False):
        self.progress = progress
        self.quiet = quiet
        self._stream = stream
        self._clock = clock
        self._shown = 0  # characters of the progress line on screen; 0: no line open
        self._first = None  # (time, round) of the first round line, to measure the pace

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stdout

    def enabled(self) -> bool:
        if self.progress is not None:
            return self.progress
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __call__(self, line: str) -> None:
        if self.quiet:
            return
        match = _ROUND_LINE.match(line) if self.enabled() else None
        if match is None:
            self.close()
            self._write(line + "\n")
            return
        rnd, total = int(match[1]), int(match[2])
        text = self._render(rnd, total, match[3])
        # spaces overwrite what is left of a longer previous line; "\r" goes back to its start
        self._write("\r" + text.ljust(self._shown))
        self._shown = len(text)
        if rnd >= total:
            self.close()

    def warn(self, message: str) -> None:
        """Warnings go to stderr even when quiet, after ending an open progress line."""
        self.close()
        write_or_silence(sys.stderr, f"fedsim: warning: {message}\n")

    def close(self) -> None:
        """End the progress line, if one is open, so that the next output starts on its own line."""
        if self._shown:
            self._shown = 0
            self._write("\n")

    def _write(self, text: str) -> None:
        if not write_or_silence(self.stream, text):
            self.quiet = True  # nobody reads any more (`fedsim run ... | head`): the run goes on silently

    def _render(self, rnd: int, total: int, rest: str) -> str:
        done = round(_BAR_WIDTH * rnd / total)
        head = f"[{'#' * done}{'.' * (_BAR_WIDTH - done)}] round {rnd:>{len(str(total))}}/{total}  "
        left = self._seconds_left(rnd, total)
        tail = "" if left is None else f"  ~{format_duration(left)} left"
        return head + self._fit(rest, len(head) + len(tail)) + tail

    def _seconds_left(self, rnd: int, total: int) -> float | None:
        """From the pace since the first round seen: that round includes the workers' start-up."""
        now = self._clock()
        if self._first is None or rnd <= self._first[1]:
            self._first = (now, rnd)
            return None
        if rnd >= total:
            return None
        started, first_round = self._first
        return (now - started) / (rnd - first_round) * (total - rnd)

    def _fit(self, rest: str, taken: int) -> str:
        """A terminal wraps a line longer than its width, and a carriage return then goes back
        only to the start of the wrapped part; so on a terminal the metrics are cut to fit,
        keeping the bar and the time left."""
        isatty = getattr(self.stream, "isatty", None)
        if isatty and isatty():
            room = shutil.get_terminal_size().columns - 1 - taken
            if len(rest) > room:
                return rest[:max(room - 3, 0)] + "..."
        return rest


def write_or_silence(stream, text: str) -> bool:
    """Write and flush; False if the output cannot take it (a closed pipe, a full disk). The
    stream's descriptor then points at /dev/null, so that later writes, and the interpreter's
    flush at exit, neither fail nor print an error; the run itself goes on."""
    try:
        stream.write(text)
        stream.flush()
        return True
    except OSError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, AttributeError, ValueError):
            pass  # not a file-backed stream
        return False


def format_duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 1 h 02 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
