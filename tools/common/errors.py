"""The one error type every stage raises for bad input.

A UserError carries a single line naming the input and the fix; CLIs print it as
`error: <line>` and exit 2, never with a traceback. run_cli also turns SIGTERM and SIGHUP into an
exception, as Python already does for Ctrl-C, so every `finally` and `except BaseException`
cleanup (temp files, `.part` downloads, child processes) runs when a CLI is told to stop.
"""
from __future__ import annotations

import errno
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Callable, Sequence

# Signals that ask a process to stop; the default action would exit without any cleanup.
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class UserError(Exception):
    """Bad input or environment: the message is one line naming the input and the fix."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so cleanup that handles that handles this."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def cannot_write(path: Path, error: OSError, *, no_space_fix: str, access_fix: str) -> UserError:
    """The one line for an OSError while writing `path`: a full disk (or quota) with
    `no_space_fix`, anything else (permission, read-only file system) with `access_fix`."""
    if error.errno in NO_SPACE_ERRNOS:
        return UserError(f"no space left on device writing {path}: free space or {no_space_fix}")
    return UserError(f"cannot write {path} ({error.strerror or error}): {access_fix}")


def _raise_terminated(signum: int, _frame: FrameType | None) -> None:
    # A second signal while the cleanup runs ends the process the default way.
    for sig in TERMINATING_SIGNALS:
        if signal.getsignal(sig) is _raise_terminated:
            signal.signal(sig, signal.SIG_DFL)
    raise Terminated(signum)


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a stage's main(), turning a UserError into a one-line message and exit code 2, and
    SIGINT/SIGTERM/SIGHUP into an exception that unwinds (cleanup runs), exit 128 + signal."""
    installed: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():  # only there can handlers be set
        # Only where the default would kill: an ignored SIGHUP (nohup) stays ignored.
        installed = [sig for sig in TERMINATING_SIGNALS if signal.getsignal(sig) is signal.SIG_DFL]
        for sig in installed:
            signal.signal(sig, _raise_terminated)
    try:
        return main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Terminated as e:
        print(f"error: terminated by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig in installed:
            signal.signal(sig, signal.SIG_DFL)
