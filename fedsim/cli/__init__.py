"""The ``fedsim`` command: run (and resume), sweep, partition, plot, list.

User errors print one line on stderr and exit with status 2 (``--debug`` shows the
traceback). Ctrl-C and SIGTERM stop the run after stopping the workers, keep what was
written, and exit with 130 and 143 (129 after SIGHUP, a closed terminal); a second Ctrl-C ends everything at once.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence

from ..core.errors import FedsimError
from ..execution.interrupts import Terminated, exiting
from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what ranks started by --ranks run
    try:
        code = args.func(args)
    except FedsimError as e:
        if args.debug:
            raise
        if str(e):  # a rank stopped by another has nothing to add: that one says why
            print(f"fedsim: error: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:  # before a command's own handling began (fedsim run while importing torch)
        print("fedsim: interrupted", file=sys.stderr)
        code = 130
    except Terminated as e:
        code = e.exit_code
    except BrokenPipeError:  # `fedsim list | head`: the reader has all it wanted
        from ..results.progress import write_or_silence

        write_or_silence(sys.stdout, "")
        code = 0
    except OSError as e:  # the output itself failed (fedsim list > /dev/full)
        # only that: a failed write to the output names no file, fedsim's own files are named by
        # their own errors, and an OSError of the user's code by its component (errors.user_code)
        if args.debug or e.filename is not None:
            raise
        from ..results.progress import write_or_silence

        write_or_silence(sys.stdout, "")
        print(f"fedsim: error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        code = 1
    if argv is None:  # the process's own command line (not a call from Python): its signals are its own
        exiting()
        _skip_the_collections_of_shut_down()
    sys.exit(code)


def _skip_the_collections_of_shut_down() -> None:
    """The interpreter's shut-down collects garbage over every object alive, several times: with
    torch imported, about half a second of CPU after the command is done. The garbage of now is
    collected here, its finalizers run; what is alive now is left out of those collections
    (``gc.freeze``), and is freed by reference counting as modules are emptied, as it was."""
    gc.collect()
    gc.freeze()
