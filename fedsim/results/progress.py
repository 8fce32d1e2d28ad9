"""What a run prints: its per-round lines, as one updating line on a terminal, and its
messages (start, warnings, early stop), which go through ``logging.getLogger("fedsim")``.

With the display on, the per-round lines (``round  3/10  test acc ...``; a language model's
``round  3/10  test loss 2.1034  ppl 8.19  tok acc 0.4127 ...``) replace each other on one line,
led by a bar and followed by an estimate of the time left; any other line first ends that line
and then prints as usual. With the display off, every line prints as it comes, which
is what a log file or a CI job wants. A notebook user silences or redirects the messages with
the logging module (``logging.getLogger("fedsim").setLevel(logging.WARNING)``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

_BAR_WIDTH = 20


class RoundLog:
    """Prints a run's lines: ``round_end(row, rounds)`` for a round, ``(line)`` for any other.

    ``progress``: True shows the updating display, False prints every line, None shows it when
    the stream is a terminal. ``quiet``: print nothing but warnings. ``stream``: where to write;
    by default ``sys.stdout`` as it is at each call (Jupyter gives every cell its own).
    ``write``: a function that takes each line instead (no display). ``per_client``: the run scores
    each client on its own test split (eval_per_client), so each line also shows the mean of those
    accuracies, called ``personal acc`` where they score personal models, else ``client acc``
    (the global model's); "" for neither. ``tokens``: a
    token-level run (a language model), whose lines lead with test loss and perplexity (``ppl``)
    and call its accuracy token accuracy (``tok acc``); set by the first row that has a
    ``test_perplexity``, and kept, so that the rounds left unevaluated read alike.
    """

    def __init__(
        self,
        progress: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        quiet: bool = False,
        write: Callable[[str], None] | None = None,
    ):
        self.progress = False if write is not None else progress
        self.quiet = quiet
        self._stream = stream
        self._write_line = write
        self._clock = clock
        self._shown = 0  # characters of the progress line on screen; 0: no line open
        self._first = None  # (time, round) of the first round line, to measure the pace
        self.per_client = ""
        self.tokens = False

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def enabled(self) -> bool:
        if self.progress is not None:
            return self.progress
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __call__(self, line: str) -> None:
        if self.quiet:
            return
        self.close()
        if self._write_line is not None:
            self._write_line(line)
        else:
            self._write(line + "\n")

    def round_end(self, row: dict, rounds: int) -> None:
        """The line of a finished round: its own line, or the updating display."""
        self.tokens = self.tokens or row.get("test_perplexity") is not None
        if self.quiet:
            return
        metrics = _metrics(row, self.per_client, self.tokens)
        if not self.enabled():
            self(f"round {row['round']:>{len(str(rounds))}}/{rounds}  {metrics}")
            return
        text = self._render(row["round"], rounds, metrics)
        # spaces overwrite what is left of a longer previous line; "\r" goes back to its start
        self._write("\r" + text.ljust(self._shown))
        self._shown = len(text)
        if row["round"] >= rounds:
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
                return rest[: max(room - 3, 0)] + "..."
        return rest


SCORING_SHOWN = 0.25  # the share of a round's time from which the round line names the scoring's


def _metrics(row: dict, per_client: str = "", tokens: bool = False) -> str:
    named = "tok acc" if tokens else "acc"
    scored = row.get("test_samples") is not None  # evaluated: a NaN there is the model's, shown as nan
    acc = _cell(row["test_accuracy"], scored=scored)
    if per_client:  # beside the test set's: the mean over the clients' own test splits
        acc += f"  {per_client} {named} " + _cell(row.get("client_accuracy_mean"))
    loss = _cell(row["test_loss"], scored=scored)
    extra = f"  dropped {row['dropped_clients']}" if row["dropped_clients"] else ""
    if row.get("unavailable"):  # sampled while offline (system.availability)
        extra += f"  unavailable {row['unavailable']}"
    if row.get("epsilon") is not None:  # privacy spent so far (DP-FedAvg)
        extra += f"  eps {row['epsilon']:.3g}"
    scoring = row.get("eval_seconds") or 0.0
    # where scoring the test set takes a good part of the round (a language model's), say how much
    # and on how many samples: eval_subset's, or the whole set's
    took = f"{row['seconds']:.2f} s"
    if scoring > SCORING_SHOWN * row["seconds"]:
        scored = row.get("test_samples")
        took += f" ({scoring:.2f} s scoring" + (f" {scored:,} test samples)" if scored else ")")
    if row["round"] == 0:  # the model an initial_weights run starts from, scored before any training
        rest = f"before training  {took}"
    elif math.isnan(row["train_loss"]):
        rest = f"train loss {_cell(row['train_loss'])}  {took}{extra}  no client's work counted"
    else:
        rest = f"train loss {row['train_loss']:.4f}  {took}{extra}"
    if tokens:  # a language model is judged by its loss and perplexity first
        return f"test loss {loss}  ppl {_cell(row.get('test_perplexity'), '.2f', scored)}  tok acc {acc}  {rest}"
    return f"test acc {acc}  test loss {loss}  {rest}"


def final_line(summary: dict, run_dir: str | os.PathLike) -> str:
    """The line a finished run ends with: its final scores (a language model's loss and perplexity
    first; personal models' mean beside the global model's), its wall time, the figure of each
    feature it had on (summary.json's), and where its files are."""
    if summary.get("final_test_perplexity") is not None:
        final = (
            f"final test loss {summary['final_test_loss']:.4f}, perplexity {summary['final_test_perplexity']:.2f}, "
            f"token accuracy {summary['final_test_accuracy']:.4f}"
        )
    else:
        final = f"final test accuracy {summary['final_test_accuracy']:.4f}"
    if summary.get("global_model_trained") is False and summary.get("final_personal_accuracy") is None:
        final += (
            " (the global model, never trained: no weights are exchanged; eval_per_client: true scores the "
            "clients' own models)"
        )
    if summary.get("final_personal_accuracy") is not None:  # which model each figure scores, on which set
        untrained = summary.get("personal_untrained_clients")
        untouched = ", never trained: no weights are exchanged" if summary.get("global_model_trained") is False else ""
        final += (
            f" (the global model on the test set{untouched}; best {summary['best_test_accuracy']:.4f}), "
            f"personal accuracy {summary['final_personal_accuracy']:.4f} (the mean of {summary['personal_clients']} "
            f"clients' own models on their own test splits"
            + (f", {untrained} of them never trained and scored as they would start" if untrained else "")
            + f"; best {summary['best_personal_accuracy']:.4f})"
        )
    figures = []
    if summary.get("compression_ratio") not in (None, 1):
        figures.append(f"{summary['megabytes_sent']:.3g} MB sent, {summary['compression_ratio']:.3g} of uncompressed")
    if summary.get("final_epsilon") is not None:
        figures.append(f"epsilon {summary['final_epsilon']:.3g} at delta {summary['delta']:g}")
    if summary.get("staleness_mean") is not None:
        figures.append(f"staleness {summary['staleness_mean']:.2f} on average, {summary['staleness_max']} at most")
    if summary.get("clients_lost"):
        figures.append(f"{summary['clients_lost']} sampled clients' work lost")
    if summary.get("rounds_left_out"):
        left_out = summary["rounds_left_out"]
        figures.append(f"{left_out} round{'s' if left_out > 1 else ''} left out, too few updates for the rule")
    said = "".join(f"; {figure}" for figure in figures)
    return f"{final} after round {summary['rounds']} ({summary['wall_seconds']:.1f} s){said}; results in {run_dir}"


def _cell(value: float | None, spec: str = ".4f", scored: bool = False) -> str:
    """A figure of the line, or a dash where the round has none (not evaluated); a NaN the round
    ``scored`` (a model gone non-finite) is shown as nan."""
    return "   -  " if value is None or (math.isnan(value) and not scored) else format(value, spec)


class _ToRoundLog(logging.Handler):
    """fedsim's messages, printed by a RoundLog: information as lines, warnings on stderr."""

    def __init__(self, log: RoundLog):
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record):
        if record.levelno >= logging.WARNING:
            self.log.warn(record.getMessage())
        else:
            self.log(record.getMessage())


@contextmanager
def console_logging(log: RoundLog) -> Iterator[None]:
    """Print fedsim's messages through ``log`` while a run lasts, unless the program has set up
    logging itself (a handler on fedsim's logger or on the root): then its set-up decides.
    A level set on fedsim's logger (to silence it, say) is respected."""
    logger = logging.getLogger("fedsim")
    if logger.handlers or logging.getLogger().handlers:
        yield
        return
    handler, level = _ToRoundLog(log), logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _SaidOnce(logging.Filter):
    """Lets through once each message logged with ``extra={"once": key}`` (one key per kind of
    message: the same warning again, or a hint whose figures differ from run to run)."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "once", None)
        if key is None:
            return True
        seen = key in self.said
        self.said.add(key)
        return not seen


@contextmanager
def said_once() -> Iterator[None]:
    """While it lasts (a sweep's runs), a warning or hint marked ``once`` is printed for the first
    run that gives it, not for every run."""
    logger, once = logging.getLogger("fedsim"), _SaidOnce()
    logger.addFilter(once)
    try:
        yield
    finally:
        logger.removeFilter(once)


def write_or_silence(stream: TextIO, text: str) -> bool:
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
