"""Errors that reach the user as one line, without a traceback."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


def cut(text: str, limit: int = 60) -> str:
    """``text``, shortened to ``limit`` characters for a one-line message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: object, limit: int = 60) -> str:
    """A value for an error message: its type and repr, cut short (it may be huge)."""
    text = repr(value)
    return f"{type(value).__name__} {cut(text, limit)}"


def plural(count: int, word: str) -> str:
    """``count`` and ``word``, with an s unless there is one: "1 round", "3 rounds"."""
    return f"{count:,} {word}" if count == 1 else f"{count:,} {word}s"


def did_you_mean(name: object, choices: Iterable[object]) -> str:
    """``" (did you mean 'median'?)"`` for a name close to one of ``choices``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def install(extra: str) -> str:
    """The command that installs an optional extra, for the line that says it is missing."""
    return f'pip install "fedsim-sync[{extra}]"'


class FedsimError(Exception):
    """A problem the user can fix (bad config, missing data, failed worker).

    The command line prints it as a single line and exits with ``exit_code``.
    """

    exit_code = 2


class ConfigError(FedsimError):
    """Invalid experiment file or option; the message names the file and the key."""


class DataError(FedsimError):
    """A dataset that cannot be found, downloaded or read; ``missing``: its files are not there."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


class WorkerError(FedsimError):
    """A worker process raised, died or hung; the message names worker, client and round."""

    exit_code = 1


class UnguardedScript(WorkerError):
    """The script that called fedsim.run did so outside ``if __name__ == "__main__":``, so each
    worker, which imports the script, would start the run again (see processes.py)."""

    def __init__(self):
        super().__init__(
            "this script calls fedsim.run (or resume, or sweep) outside an "
            '`if __name__ == "__main__":` block, so every worker process, which imports the script, '
            "would start the run again; put the call under that guard"
        )


class NonFiniteError(FedsimError):
    """A client update held NaN or Inf and the run was told to stop (on_nonfinite: fail)."""

    exit_code = 1


class UserCodeError(FedsimError):
    """Code the user brought (a rule, an algorithm, a callback) raised while the run went on."""

    exit_code = 1


@contextmanager
def user_code(what: str, error: type = UserCodeError) -> Iterator[None]:
    """Run code the user brought. Whatever it raises, an OSError or a sys.exit() included, becomes
    ``error``: one line, ``what`` followed by the exception, never taken for a failure of fedsim's
    own (a write, a worker) nor a reason to exit quietly. fedsim's own errors raised from inside
    it, and the exceptions of signals (KeyboardInterrupt, SIGTERM's), pass unchanged."""
    try:
        yield
    except FedsimError:
        raise
    except (Exception, SystemExit) as e:  # the machine running out (of GPU memory, say) is the machine's
        raise explain_resource_error(e) or error(f"{what} ({exception_text(e)})") from None


def exception_text(error: BaseException) -> str:
    """An exception in a few words: its type and the first line of its message."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({'' if error.code is None else repr(error.code)})"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class ResourceError(FedsimError):
    """The machine ran out of something (shared memory, file descriptors, GPU or host memory)."""

    exit_code = 1


class OutputError(FedsimError):
    """A file of the run could not be written (disk full, read-only, no permission)."""

    exit_code = 1


def resource_hint(text: str) -> str | None:
    """The knob to turn for an out-of-resource error message, or None if it is not one.

    The causes are told apart by the error's own words, most specific first: a low descriptor
    limit also makes shared-memory calls fail, and a full disk and a full /dev/shm both say
    "No space left on device".
    """
    if "Too many open files" in text:
        return "too many open file descriptors: raise the limit (ulimit -n 65536) or set sharing_strategy: file_system"
    if "CUDA out of memory" in text or "OutOfMemoryError" in text:
        return "the GPU is out of memory: lower workers, local.batch_size or eval_batch_size"
    if "Cannot allocate memory" in text or "can't allocate memory" in text:
        return "host memory is exhausted: lower workers or data.limit"
    if "No space left on device" in text:
        if any(where in text for where in ("shared memory", "/torch_", "/dev/shm")):
            return (
                "shared memory (/dev/shm) is full: CPU runs keep the dataset and the client weights there; "
                "give it more room (docker run --shm-size=2g) or lower data.limit or clients_per_round"
            )
        return "a disk is full (No space left on device): free some space"
    return None


def explain_resource_error(error: BaseException) -> ResourceError | None:
    """A one-line ResourceError for a known exhaustion, else None (re-raise the original)."""
    text = f"{type(error).__name__}: {error}"
    hint = resource_hint(text)
    return ResourceError(f"{hint} ({text.splitlines()[0]})") if hint else None


# errno -> (what it means for a file fedsim writes, exit with 1: the machine, not the input)
_WRITE_CAUSES = {
    errno.ENOSPC: ("the disk is full", True),
    errno.EDQUOT: ("the disk quota is exhausted", True),
    errno.EROFS: ("the file system is read-only", True),
    errno.EACCES: ("permission denied", True),
    errno.EPERM: ("permission denied", True),
    errno.EIO: ("an input/output error", True),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", False),
    errno.EISDIR: ("it is a directory", False),
    errno.ENAMETOOLONG: ("the name is too long", False),
}


def write_error(
    path: str | os.PathLike, error: OSError, advice: str = "choose another place with --out"
) -> FedsimError:
    """One line for a file that could not be written: the path, the cause, what to do."""
    cause, environment = _WRITE_CAUSES.get(error.errno, (error.strerror or str(error), True))
    message = f"cannot write {path}: {cause}; {advice}"
    return OutputError(message) if environment else FedsimError(message)
