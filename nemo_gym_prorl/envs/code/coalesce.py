"""Concurrent gradings share grading sandboxes: callers that queue while every slot is busy go into one batch.

A sandbox's start is most of what grading one program costs (docs/code-and-stem.md), and a GRPO group's rollouts
finish, and are graded, together. So at most `slots` batches run at once per kind of sandbox; a caller arriving
while all run waits, and the next free slot takes every waiting caller (up to `max_items` items) into one batch.
A caller alone with a free slot runs at once, as before. A cancelled caller leaves its batch; a batch whose callers
are all gone is cancelled (its sandbox closed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Caller(Generic[Item, Result]):
    items: list[Item]
    future: asyncio.Future[list[Result]]


@dataclass
class Coalescer(Generic[Item, Result]):
    """`run(items)` through `batch(all items of a batch)`, which returns one result per item, in order."""

    batch: Callable[[list[Item]], Awaitable[list[Result]]]
    slots: int
    max_items: int
    _waiting: list[_Caller[Item, Result]] = field(default_factory=list)
    _running: set[asyncio.Task] = field(default_factory=set)

    async def run(self, items: Sequence[Item]) -> list[Result]:
        caller: _Caller[Item, Result] = _Caller(list(items), asyncio.get_running_loop().create_future())
        self._waiting.append(caller)
        self._start()
        return await caller.future

    def _start(self) -> None:
        while self._waiting and len(self._running) < self.slots:
            callers, size = [], 0
            while self._waiting and (not callers or size + len(self._waiting[0].items) <= self.max_items):
                caller = self._waiting.pop(0)
                if not caller.future.done():  # cancelled while it waited
                    callers.append(caller)
                    size += len(caller.items)
            if not callers:
                continue
            task = asyncio.get_running_loop().create_task(self._run(callers))
            self._running.add(task)
            for caller in callers:
                caller.future.add_done_callback(lambda _, t=task, cs=callers: self._abandoned(t, cs))

    @staticmethod
    def _abandoned(task: asyncio.Task, callers: list[_Caller]) -> None:
        if all(c.future.cancelled() for c in callers):
            task.cancel()

    async def _run(self, callers: list[_Caller[Item, Result]]) -> None:
        try:
            results = await self.batch([item for c in callers for item in c.items])
            at = 0
            for caller in callers:
                if not caller.future.done():
                    caller.future.set_result(results[at : at + len(caller.items)])
                at += len(caller.items)
        except Exception as error:
            for caller in callers:
                if not caller.future.done():
                    caller.future.set_exception(error)
        except BaseException:
            for caller in callers:
                caller.future.cancel()
            raise
        finally:
            self._running.discard(asyncio.current_task())
            self._start()
