"""GRPO group forking, "one init, n forks": the samples of one instance share one init, each continuing on a
copy-on-write fork of its sandbox (``Environment.fork``).

Every sample of a GRPO group starts from the same staged task (the same first prompt, the same workspace), so the
n inits of a group do the same work n times; for SWE that is a repository staged n times. With the pipeline's
``fork_groups`` on, the group's init runs once and its sandbox is forked into one sandbox per sample still
waiting (``Sandbox.fork(n, close=True)``: the parent closes on the way and hands its workspace over instead of
copying it). Each sample then runs and is graded on its own sandbox exactly as without forking.

What it is valid for: an episode whose whole state after init is its sandbox's workspace (files; a fork starts a
fresh shell, so nothing init left in the shell's state carries over) plus the Episode's own fields (copied). That
holds for every task type whose init stages files into our sandbox; a Gym task's episode is a session on the Gym
server (no sandbox of ours to fork), so its samples init one by one. Backends without ``fork`` (Apptainer today)
init one by one too. On Ray, the group's init runs on one rollout worker and its forks are made and held there
(``RemoteEnvironment.fork``), each taking a sandbox slot of that worker.

Whether it can fork is the environment's to say (``Environment.can_fork``: its task type and its backend). Whether
it does: the service's ``service.pipeline.fork_groups`` when set; unset, each task's environment says
(``Environment.shares_group_init``: where staging costs more than a fork, as SWE's repositories do). Forking changes nothing a sample sees, only what
its init costs and when the samples of a group start (together, once the shared init is done, with all n sandbox
slots taken before it).

Members come and go independently: one that is cancelled or runs past its deadline while the group's init runs
only stops waiting (the last one to go cancels the init, whose sandbox is closed); one that goes while the fork is
being made waits for it and has its fork closed. A failed init or fork fails every member still waiting with
``GroupInitFailed`` naming the cause, and leaves no sandbox behind.
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
