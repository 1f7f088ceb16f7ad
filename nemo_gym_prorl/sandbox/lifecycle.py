"""How every sandbox ends: once, whoever ends it (`close()`, leaving `async with`, the wall-clock limit), and
completely even when the caller is cancelled meanwhile.

A backend subclasses `SandboxLifecycle`, implements `start()` and `_close()` (kill everything, remove what
`start()` made; also after a start that failed half-way), calls `_arm_wall_clock()` once started and
`_check_open()` before each operation. What `start()` makes in a thread it runs with `to_thread_to_the_end`, so a
cancelled start never leaves the thread making something after `close()` has looked.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Self

from nemo_gym_prorl.contracts.sandbox import SandboxError, SandboxSpec

_log = logging.getLogger(__name__)


class SandboxLifecycle(abc.ABC):
    spec: SandboxSpec
    _close_task: asyncio.Task[None] | None = None
    _wall_timer: asyncio.TimerHandle | None = None
    _expired = False

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def _close(self) -> None:
        """Kill everything the sandbox runs and remove what `start()` made, however far it got."""

    async def close(self) -> None:
        """Tear the sandbox down. Idempotent; finishes even if the caller is cancelled meanwhile."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close_once())
        await asyncio.shield(self._close_task)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _arm_wall_clock(self) -> None:
        """Close the sandbox when `spec.limits.wall_clock_s` has passed from now."""
        self._wall_timer = asyncio.get_running_loop().call_later(self.spec.limits.wall_clock_s, self._expire)

    def _check_open(self) -> None:
        """SandboxError if the sandbox is closing or closed, saying why."""
        if self._close_task is not None:
            raise SandboxError(self._closed_reason())

    def _closed_reason(self) -> str:
        if self._expired:
            return f"sandbox killed: wall-clock limit of {self.spec.limits.wall_clock_s:g}s reached"
        return "sandbox is closed"

    def _expire(self) -> None:
        self._expired = True
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close_once())

    async def _close_once(self) -> None:
        if self._wall_timer is not None:
            self._wall_timer.cancel()
        await self._close()


async def to_the_end[T](awaitable: Awaitable[T]) -> T:
    """What `awaitable` gives; cancelled meanwhile, wait for it to end before the cancellation goes on (the
    cancellation is what the caller gets; an error the work ends with then is logged here, as nobody else sees it).
    For work whose end others count on: a sandbox closed before its slot is given back, a start's thread done before
    `close()` looks."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            _log.warning("%r failed after its caller was cancelled", awaitable, exc_info=task.exception())
        raise


async def to_thread_to_the_end(function: Callable[..., object], *args: object) -> None:
    """`function(*args)` in a thread, `to_the_end` (so that `close()` sees everything it made)."""
    await to_the_end(asyncio.to_thread(function, *args))
