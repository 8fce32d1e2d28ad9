"""Files written whole or not at all, whatever happens while they are written; and the
checkpoint read back, whichever part of fedsim reads it."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from .errors import FedsimError, write_error

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


def read_checkpoint(path: Path) -> dict:
    """A run's checkpoint.pt (its round, global weights and the state saved with them), or one
    line naming ``path`` where it is not one. torch is imported here, so that loading and
    plotting results does not wait for it."""
    import pickle

    import torch

    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
        raise FedsimError(f"{path}: corrupt or not a fedsim checkpoint") from None
    if not isinstance(state, dict) or "round" not in state or not isinstance(state.get("global"), torch.Tensor):
        raise FedsimError(f"{path}: not a fedsim checkpoint (no round and global weights)")
    if (
        not isinstance(state["round"], int)
        or state["round"] < 0
        or not isinstance(state.get("elapsed_seconds", 0.0), (int, float))
    ):
        raise FedsimError(f"{path}: not a fedsim checkpoint (its round is {state['round']!r})")
    return state
