"""Commands in a sandbox can be interrupted even when the service was started ignoring interrupts.

A process started as a background job of a non-interactive shell (`prorl serve &` in a batch script, a CI runner,
`nohup` under one) inherits SIGINT and SIGQUIT ignored, and every process it starts inherits that in turn. The
sandbox's interactive bash catches Ctrl-C itself, but the commands it runs would ignore Ctrl-C and Ctrl-\\: a
timed-out command could only be stopped by restarting its shell, losing the session's state.

An ignored signal stays ignored across exec; a caught one is reset to its default. So the service catches them
with a handler that does nothing, which to the service itself is the same as ignoring them. Python can only do that
on its main thread; started elsewhere, the child resets them itself (`preexec_fn`), which costs a full fork instead
of a vfork (tens of ms in a large process), so it is the fallback only.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

INTERRUPTS = (signal.SIGINT, signal.SIGQUIT)


def interruptible_children() -> Callable[[], None] | None:
    """Arrange that children start with SIGINT and SIGQUIT at their defaults. Returns a `preexec_fn` for the child
    to do it itself when that could not be arranged here (off the main thread), else None."""
    ignored = [sig for sig in INTERRUPTS if signal.getsignal(sig) == signal.SIG_IGN]
    if not ignored:
        return None
    if threading.current_thread() is not threading.main_thread():
        return _default_interrupts
    for sig in ignored:
        signal.signal(sig, _still_ignored)
    return None


def _still_ignored(signum: int, frame: object) -> None:
    """The service's own handling of a signal it was started ignoring: none."""


def _default_interrupts() -> None:
    for sig in INTERRUPTS:
        signal.signal(sig, signal.SIG_DFL)
