"""Files written whole or not at all, whatever happens while they are written."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from .errors import write_error

OUT_ADVICE = "choose another place with --out"


def write_atomically(path: Path, write: Callable[[Path], object], advice: str = OUT_ADVICE) -> None:
    """Write ``path`` whole or not at all: ``write(tmp)`` fills a temporary file beside it,
    which then replaces ``path``. A full disk, a crash or an interrupt leaves the old file whole
    and no temporary file behind; a failure is one line naming the path and what to do."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(path, e, advice) from None
    except RuntimeError as e:  # torch.save reports a failed write as a RuntimeError
        raise write_error(path, _as_os_error(path, e), advice) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # could not be created in the first place


def atomic_write_text(path: Path, text: str, advice: str = OUT_ADVICE) -> None:
    """``text`` into ``path``, whole or not at all (see ``write_atomically``)."""
    write_atomically(path, lambda tmp: tmp.write_text(text), advice)


def _as_os_error(path: Path, error: RuntimeError) -> OSError:
    """The OSError behind a library's failed write: a full disk when it has no room left."""
    try:
        stats = os.statvfs(path.parent)
        if stats.f_bavail * stats.f_frsize < 1 << 20:
            return OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        pass
    return OSError(errno.EIO, str(error).splitlines()[0])
