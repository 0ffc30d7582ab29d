"""Start-up of a child process of `tokenmill serve`: signals, parent death, logging.

The API server owns shutdown: on SIGINT/SIGTERM it terminates its children and waits for them.
Children therefore ignore SIGINT (a terminal's Ctrl-C reaches the whole process group, and a child
dying first would look like a crash) and exit cleanly on SIGTERM. If the server is killed outright,
the kernel sends the child SIGTERM (PR_SET_PDEATHSIG), and the loops also poll the parent id, so a
child is never orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from types import FrameType

from tokenmill.errors import TokenmillError
from tokenmill.ipc.messages import ProcessFailed

_PR_SET_PDEATHSIG = 1
_parent_pid: int | None = None


def child_process_setup(name: str, log_level: str, parent_pid: int | None = None) -> None:
    """parent_pid: the server's pid as it passed it on the command line (None: the current parent)."""
    global _parent_pid
    _parent_pid = parent_pid if parent_pid is not None else os.getppid()
    if sys.platform.startswith("linux"):
        # If this fails, the parent-id poll in the loops still notices an orphan.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if os.getppid() != _parent_pid:  # the parent died before the death signal was armed
        raise SystemExit(0)
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s"
    )


def parent_alive() -> bool:
    return _parent_pid is None or os.getppid() == _parent_pid


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def startup_failure(log: logging.Logger, process: str, exc: BaseException) -> ProcessFailed:
    """The message a child sends its parent when it cannot start. A TokenmillError (a model file that
    cannot load, a bad setting: the user's to fix) is logged as one line; anything else, a bug, with
    its traceback."""
    if isinstance(exc, TokenmillError):
        log.error("%s start-up failed: %s", process, exc)
        return ProcessFailed(process, str(exc))
    log.exception("%s start-up failed", process)
    return ProcessFailed(process, f"{type(exc).__name__}: {exc}")
