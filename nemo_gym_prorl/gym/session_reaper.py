"""The last word on a `gym env start` session when the process that started it is killed without cleanup.

The kernel then sends `gym env start` SIGINT (child_lifetime), and gym stops its servers and Ray, but only as well
as a loaded machine lets it: a server still starting may miss it and live on. This watchdog, started beside the
session with a parent-death signal of its own, waits a grace period for the session to end and then SIGKILLs what
is left of it. `python -m nemo_gym_prorl.gym.session_reaper SID GRACE_S`; standard library and psutil only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import psutil


def session_members(sid: int) -> set[int]:
    """The live processes of session `sid` (a zombie has exited: only its parent can take it away)."""
    members = set()
    for pid in psutil.pids():
        with contextlib.suppress(OSError, psutil.Error):  # gone meanwhile
            if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.add(pid)
    return members


def reap(sid: int, grace_s: float) -> None:
    """Wait up to `grace_s` for session `sid` to end by itself, then SIGKILL its members until none is left."""
    deadline = time.monotonic() + grace_s
    while (members := session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    while members:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        members = session_members(sid)


def block_sigterm() -> None:
    """In the watchdog's preexec, before exec (a signal mask survives it): a parent-death SIGTERM that comes while
    the interpreter starts waits for `main` instead of killing the watchdog before it could act."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])


def main(argv: list[str]) -> None:
    sid, grace_s = int(argv[0]), float(argv[1])
    block_sigterm()  # the parent-death signal, taken synchronously below
    while signal.sigtimedwait([signal.SIGTERM], 1.0) is None:
        if not session_members(sid):
            return  # the session ended without us: nothing to watch
    reap(sid, grace_s)


if __name__ == "__main__":
    main(sys.argv[1:])
