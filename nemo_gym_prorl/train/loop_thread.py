"""An asyncio event loop in a thread of its own, so that synchronous code (TRL's training loop) can drive the
asynchronous service, model server and clients, which all live on that one loop.

A caller interrupted while it waits (Ctrl-C, SIGTERM turned into an exception) cancels the coroutine it was waiting
on and waits for that cancellation to finish, so whatever the coroutine held is released before the caller goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

T = TypeVar("T")


class LoopThread:
    """``with LoopThread() as loop: loop.run(coroutine)``; the loop stops and its thread ends on exit."""

    def __init__(self, name: str = "prorl-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the loop and return its result; interrupted, cancel it and wait until it has ended."""
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        ended = threading.Event()
        tasks: list[asyncio.Task[T]] = []

        def settle(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                outcome.cancel()
            elif (error := task.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(task.result())
            ended.set()

        def start() -> None:
            tasks.append(self._loop.create_task(coroutine))
            tasks[0].add_done_callback(settle)

        self._loop.call_soon_threadsafe(start)
        try:
            return outcome.result()
        except BaseException:
            self._loop.call_soon_threadsafe(lambda: tasks[0].cancel())  # runs after start(): the loop keeps order
            ended.wait()  # its cleanup (cancelling jobs, closing sandboxes) has run to the end
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
