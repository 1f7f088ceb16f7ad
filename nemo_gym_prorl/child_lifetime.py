"""Servers we start end with us, even when we are killed without a chance to stop them.

The local model server and `gym env start` run in sessions of their own, so that stopping one takes its whole
process group. But then nothing reaches them when the process that started them dies without running its cleanup
(SIGKILL, the OOM killer): they would keep their ports and memory for good. Linux's parent-death signal covers that
case: the kernel sends the child a signal when the thread that started it exits.

A SIGTERM (`kill`, `timeout`, Slurm's end of a job) is a chance to stop them: by default Python dies on it at
once, leaving the sandboxes' folders and whatever has no parent-death signal. `sigterm_exits` makes it unwind
like Ctrl-C, through every `finally`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it


def ends_with_parent(sig: signal.Signals, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A `preexec_fn` that has the kernel send the child `sig` when its parent dies, then runs `then`.

    The asyncio loop's thread starts the child: it lives as long as the loop that stops the child anyway."""
    parent = os.getpid()

    def arm() -> None:
        if then is not None:
            then()
        if _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # the parent died before the request took: nothing will send it now
            os.kill(os.getpid(), sig)

    return arm


TERMINATED = 128 + signal.SIGTERM
"""The exit status of a command that SIGTERM stopped, as a shell reports one killed by it."""


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Inside, SIGTERM raises SystemExit(TERMINATED): every `finally` (and asyncio.run's cancelling of its tasks)
    runs, so no sandbox, server or job is left."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(TERMINATED)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
