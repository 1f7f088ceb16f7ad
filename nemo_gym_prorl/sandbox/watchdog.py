"""Ties an Apptainer instance's life to its owner's: run as a script, it SIGKILLs the instance's init when the
process that started it dies, whatever killed it.

An Apptainer instance is a daemon: its init is not our child, so unlike bwrap (`--die-with-parent`) nothing inside
would notice a SIGKILLed service, and a `nohup`ed process would run on until the next start reaped the instance. The
sandbox starts this watchdog (`python -I -S watchdog.py FD`) with FD a pidfd of the instance's init and a pipe as
stdin. It waits for either its parent to exit (a pidfd of the parent, so it works whatever the parent did with its
other file descriptors) or the pipe to close (the sandbox is closing, or its owner died), then kills the init through
the pidfd — never a recycled pid — which takes the instance's whole pid namespace along, and exits.

Standard library only, and nothing but `os`, `select` and `signal`: it starts in a few milliseconds.
"""

from __future__ import annotations

import os
import select
import signal
import sys


def main(init_fd: int) -> None:
    owner = os.getppid()
    try:
        owner_fd = os.pidfd_open(owner)
    except OSError:
        owner_fd = None
    if owner_fd is not None and os.getppid() == owner:  # the pidfd is of our parent, alive when it was opened
        poller = select.poll()
        poller.register(owner_fd, select.POLLIN)
        poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
        poller.poll()
    try:
        signal.pidfd_send_signal(init_fd, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
