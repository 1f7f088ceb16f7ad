"""GRPO group forking, "one init, n forks": the samples of one instance share one init, each continuing on a
copy-on-write fork of its sandbox (``Environment.fork``).

Valid where an episode's whole state after init is its sandbox's workspace plus the Episode's own fields; Gym tasks
and backends without ``fork`` init one by one. Whether it forks: ``service.pipeline.fork_groups`` when set, else
each task's ``Environment.shares_group_init``. Members come and go independently; a failed init or fork fails every
member still waiting with ``GroupInitFailed`` and leaves no sandbox behind.

Design notes: docs/service.md#servicegroup_forkpy
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
from collections.abc import Hashable, Mapping
from typing import Any

from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.contracts.trajectory import TimedSpan
from nemo_gym_prorl.envs.base import Environment, Episode


class GroupInitFailed(RuntimeError):
    """The init (or the fork) a group's samples shared failed: every sample still waiting ends with it."""


@dataclasses.dataclass
class _Phase:
    name: str
    start: float
    end: float = 0.0
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)


class ForkGroup:
    """The samples of one instance sharing one init, `members` (any hashable id -> the sample's environment; the
    first one's runs the init): each calls `take` for its episode and, once it no longer waits for one (it took
    it, was cancelled, timed out), `detach`. An error of a type in `passed` reaches the members as it is (a lost
    Ray worker: each sample runs again), any other as `GroupInitFailed`."""

    def __init__(
        self, members: Mapping[Hashable, Environment], instance: TaskInstance,
        passed: tuple[type[BaseException], ...] = (),
    ) -> None:  # fmt: skip
        self._envs = dict(members)
        self.env, self.instance, self.passed = next(iter(self._envs.values())), instance, passed
        loop = asyncio.get_running_loop()
        self._waiting: dict[Hashable, asyncio.Future[Episode]] = {m: loop.create_future() for m in self._envs}
        self.size = len(self._waiting)
        self._shared: asyncio.Task[None] | None = None
        self._forking: set[Hashable] = set()  # members a fork in flight is being made for
        self._fork_over = asyncio.Event()
        self.phases: list[_Phase] = []
        self.inits = 0  # inits that finished (0 or 1)
        self.forks = 0  # sandboxes forked

    async def take(self, member: Hashable) -> Episode:
        """`member`'s episode, on its own fork of the group's init (which the first call starts)."""
        future = self._waiting[member]
        if self._shared is None:
            self._shared = asyncio.create_task(self._init_and_fork(), name="group-init")
        episode = await asyncio.shield(future)  # one member cancelled never cancels the others' init
        self._waiting.pop(member, None)
        return episode

    async def detach(self, member: Hashable) -> None:
        """`member` waits no more; returns once nothing made for it is left (a no-op once it took its episode)."""
        future = self._waiting.pop(member, None)
        if future is None:
            return
        if member in self._forking:  # its fork is being made: the group closes it when the fork is done
            await asyncio.shield(self._fork_over.wait())
            return
        if future.done():
            if not future.cancelled() and future.exception() is None:  # given but never taken
                await asyncio.shield(self._envs[member].close(future.result()))
            return
        future.cancel()
        if not self._waiting and self._shared is not None and not self._shared.done():  # no one left to init for
            self._shared.cancel()
            await asyncio.shield(asyncio.wait({self._shared}))

    def timed_spans(self, since: float) -> list[TimedSpan]:
        """The group's init and fork as spans timed from `since` (a member's init stage start, perf_counter)."""
        spans = []
        for phase in self.phases:
            end = phase.end or time.perf_counter()
            attributes = {"group_size": self.size, **phase.attributes}
            spans.append(TimedSpan(name=phase.name, start_s=phase.start - since, duration_s=end - phase.start,
                                   attributes=attributes))  # fmt: skip
        return spans

    async def _init_and_fork(self) -> None:
        try:
            await self._init_and_fork_once()
        finally:  # never a member left waiting on a group that is over
            self._fail("the group's init ended without a sandbox for this sample", RuntimeError("no fork left"))

    async def _init_and_fork_once(self) -> None:
        try:
            parent = await self._phase("group_init", self.env.init(self.instance))
        except Exception as e:
            self._fail("the group's init failed", e)
            return
        self.inits += 1
        members = list(self._waiting)
        if not members:
            await asyncio.shield(self.env.close(parent))
            return
        self._forking = set(members)
        envs = [self._envs[m] for m in members]
        try:
            try:
                episodes = await self._phase("fork", self.env.fork(parent, envs), forks=len(members))
            except BaseException:
                await asyncio.shield(self.env.close(parent))
                raise
            if not any(env is self.env for env in envs):  # the init's own sample left: what it held there goes
                await asyncio.shield(self.env.close(parent))
            self.forks += len(episodes)
            unclaimed = []
            for member, episode in zip(members, episodes, strict=True):
                future = self._waiting.get(member)
                if future is None or future.done():  # detached while its fork was being made
                    unclaimed.append(self._envs[member].close(episode))
                else:
                    future.set_result(episode)
            await asyncio.shield(asyncio.gather(*unclaimed, return_exceptions=True))
        except Exception as e:
            self._fail(f"forking the group's init into {len(members)} failed", e)
        finally:
            self._forking = set()
            self._fork_over.set()

    async def _phase(self, name: str, work: Any, **attributes: Any) -> Any:
        phase = _Phase(name, time.perf_counter(), attributes=attributes)
        self.phases.append(phase)
        try:
            return await work
        except BaseException as e:
            phase.attributes["error"] = type(e).__name__
            raise
        finally:
            phase.end = time.perf_counter()

    def _fail(self, what: str, error: BaseException) -> None:
        reason = "".join(traceback.format_exception_only(error)).strip()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error if isinstance(error, self.passed) else GroupInitFailed(f"{what}: {reason}"))
