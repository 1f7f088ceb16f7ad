"""The running stage's deadline, held still while the rollout waits on something it does not own.

Deadlines count stage time, not queue time. A rollout whose model request waits while the trainer syncs weights
(the LLM pool is paused) is queued, not working: that wait must not bring its stage or job deadline closer, or a
weight sync would time rollouts out. The pipeline sets a clock for each stage it runs; the pool holds it while a
request waits for the sync, from inside the stage's task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextvars import ContextVar


class StageClock:
    def __init__(self, timeout: asyncio.Timeout) -> None:
        self._timeout = timeout
        self.held_s = 0.0  # time the stage waited on others: not its own

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (None: no deadline), for a stage whose work runs elsewhere."""
        when = self._timeout.when()
        return None if when is None else max(when - asyncio.get_running_loop().time(), 0.0)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The deadline stands still while the block runs, and is later by as much after it."""
        loop = asyncio.get_running_loop()
        started, when = loop.time(), self._timeout.when()
        if not self._timeout.expired():
            self._timeout.reschedule(None)
        try:
            yield
        finally:
            held = loop.time() - started
            self.held_s += held
            if when is not None and not self._timeout.expired():
                self._timeout.reschedule(when + held)


current_stage_clock: ContextVar[StageClock | None] = ContextVar("current_stage_clock", default=None)


def stage_deadline_held() -> contextlib.AbstractContextManager[None]:
    """`StageClock.held` of the running stage; nothing outside a stage."""
    clock = current_stage_clock.get()
    return clock.held() if clock is not None else contextlib.nullcontext()
