"""One rollout as the head's pipeline sees it, its work done on a rollout worker.

The pipeline calls ``env.init`` / ``agent.run`` / ``env.collect`` / ``env.close`` / ``env.grade`` as it does
in-process; here each call goes to the rollout's worker (placed by the fleet at init) and waits for it:

- cancelled (a job cancel, the service stopping, the init or eval deadline): the worker is told to stop the rollout
  and close its sandbox; a cancelled run brings back the turns it got to and its model and tool spans, as
  in-process. That close is awaited shielded, and its outcome retrieved even when the wait is cancelled again (the
  service stopping meanwhile) and the worker is lost after: no "Task exception was never retrieved".
- the run stage's deadline is kept by the worker (it can hold it still during a weight sync, as the in-process pool
  does); the head's clock stands still meanwhile and counts only what the worker says was held.
- the worker or its node lost (dead, or killed by the fleet as unresponsive): ``RolloutLost``, which the pipeline
  runs again from init (elsewhere) until the rollout has been lost more than ``ray.max_reruns`` times, then ends it
  with the stage's critical_error and the reason (the worker, its node, why it was lost). Such a rollout keeps only
  what the head has: its first prompt; the turns it got to were on the lost worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError, RayTaskError

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation, Submission
from nemo_gym_prorl.service.pipeline import RolloutLost
from nemo_gym_prorl.telemetry.stage_clock import current_stage_clock
from nemo_gym_prorl.telemetry.tracing import graft
from nemo_gym_prorl.tool_calls import ToolCall, ToolCallFormat
from nemo_gym_prorl.tools import ToolOutput

if TYPE_CHECKING:
    from nemo_gym_prorl.cluster.placement import Placement, WorkerRef
    from nemo_gym_prorl.cluster.worker import RunReport


def _shielded(ref: Any) -> asyncio.Future[Any]:
    """`ref` awaited so that cancelling the waiter leaves the call be. asyncio.shield forgets its inner task when the
    waiter is cancelled first, so an error the call ends with later (its worker lost) would be logged as "Task
    exception was never retrieved": here it is retrieved whoever waits."""
    inner = asyncio.ensure_future(ref)
    inner.add_done_callback(_retrieve)
    return asyncio.shield(inner)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class RemoteEnvironment(Environment):
    """The task's environment for one rollout, its episodes living on the worker the fleet placed it on."""

    def __init__(self, local: Environment, fleet: Placement, group: str, key: str) -> None:
        self.task, self.sandbox_backend, self.tools = local.task, local.sandbox_backend, local.tools
        self.plain_reply_ends_episode = local.plain_reply_ends_episode  # type: ignore[misc]
        self.keeps_submission = local.keeps_submission  # type: ignore[misc]
        self._local = local
        self.fleet, self.group, self.key = fleet, group, key
        self.worker: WorkerRef | None = None  # holding a sandbox slot there, from init to close
        self.last_worker: WorkerRef | None = None
        self.report: RunReport | None = None
        self.closing: Any = None  # the close a cancelled call sent (a Ray ObjectRef): the run's outcome so far
        self.losses = 0

    @property
    def shares_group_init(self) -> bool:
        return self._local.shares_group_init

    @property
    def can_fork(self) -> bool:
        return self._local.can_fork

    def prompt_messages(self, instance: TaskInstance) -> list[dict[str, Any]]:
        return self._local.prompt_messages(instance)

    def tool_schemas(self, instance: TaskInstance | None = None) -> list[dict[str, Any]]:
        return self._local.tool_schemas(instance)

    async def init(self, instance: TaskInstance) -> Episode:
        self.report = self.closing = None
        self.worker = await self.fleet.place(self.group)
        try:
            await self.call(self.worker, "init", self.task.name, instance)
        except BaseException:
            self._release()
            raise
        return Episode(instance=instance, sandbox=None)

    async def fork(self, episode: Episode, into: list[Environment]) -> list[Episode]:
        """A group's forks (``pipeline.fork_groups``), made on the worker that ran its init (this rollout's): each
        sample's rollout is held there under its own key, holding a slot of that worker."""
        assert self.worker is not None
        worker, members = self.worker, [m for m in into if m is not self]
        for member in members:
            assert isinstance(member, RemoteEnvironment)
            member.report = member.closing = None
            member.worker = self.fleet.place_on(worker, member.group)
        try:
            await self.call(worker, "fork", self.task.name, [m.key for m in into])  # type: ignore[attr-defined]
        except BaseException:
            for member in members:
                member._release()  # type: ignore[attr-defined]
            raise
        return [Episode(instance=episode.instance, sandbox=None) for _ in into]

    async def call_tool(self, episode: Episode, call: ToolCall) -> ToolOutput:
        raise RuntimeError("a remote rollout's tools run on its worker")

    async def collect(self, episode: Episode) -> Submission:
        assert self.report is not None and self.report.submission is not None
        return self.report.submission

    async def close(self, episode: Episode) -> None:
        if self.worker is None:
            return
        try:
            if self.report is not None and self.report.closed:  # the worker closed it when the run ended
                if self.report.close_error is not None:
                    raise self.report.close_error
                return
            await self.call(self.worker, "close")
        finally:
            self._release()

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        worker = await self.fleet.any_worker(prefer=self.last_worker)
        return await self.call(worker, "grade", self.task.name, instance, submission)

    def _release(self) -> None:
        if self.worker is not None:
            self.fleet.release(self.worker, self.group)
            self.last_worker, self.worker = self.worker, None

    async def call(self, worker: WorkerRef, method: str, *args: Any) -> Any:
        """`method(key, *args)` on `worker`; a cancel stops it there, a lost worker is `RolloutLost`."""
        ref = getattr(worker.actor, method).remote(self.key, *args)
        try:
            return await ref
        except asyncio.CancelledError:
            if method != "close":  # the head gave up on it: the worker stops it and closes its sandbox
                self.closing = worker.actor.close.remote(self.key)
            raise
        except RayTaskError as e:  # the environment's own error, as in-process
            if isinstance(e.cause, BaseException) and not isinstance(e.cause, asyncio.CancelledError):
                raise e.cause from None
            raise
        except RayActorError as e:
            self.fleet.lost(worker, e)
            if method == "close":  # its sandboxes went with it; the node's next worker sweeps what is left
                return None
            self.losses += 1
            rerun = self.losses <= self.fleet.settings.max_reruns
            where = f"worker {worker.name} on node {worker.node_id[:12]}"
            why = worker.lost_reason or type(e).__name__
            raise RolloutLost(
                f"its {where} was lost during {method} ({why}; lost {self.losses} time(s), "
                f"re-runs allowed: {self.fleet.settings.max_reruns})",
                rerun=rerun,
            ) from None


class RemoteAgentLoop(AgentLoop):
    """The agent loop of a remote rollout: `start` here (the same first prompt), `run` on the worker."""

    def __init__(
        self, env: RemoteEnvironment, tool_format: ToolCallFormat, max_turns: int, trajectory_id: str,
        sampling: SamplingParams,
    ) -> None:  # fmt: skip
        super().__init__(None, tool_format, max_turns)  # type: ignore[arg-type]  # generation happens remotely
        self.remote, self.trajectory_id, self.sampling = env, trajectory_id, sampling

    async def run(self, env: Environment, episode: Episode, trajectory: Trajectory) -> None:
        remote = self.remote
        assert remote.worker is not None
        clock = current_stage_clock.get()
        budget = clock.remaining_s() if clock is not None else None
        loop = asyncio.get_running_loop()
        started, report = loop.time(), None
        try:
            with clock.held() if clock is not None else contextlib.nullcontext():  # the worker keeps the deadline
                report = await remote.call(
                    remote.worker, "run", remote.task.name, self.trajectory_id, self.sampling, budget
                )
        except asyncio.CancelledError:
            closing = remote.closing or remote.worker.actor.close.remote(remote.key)
            with contextlib.suppress(Exception):  # what the run got to, as a cancelled in-process run keeps it
                partial = await _shielded(closing)
                if partial is not None:
                    graft(partial.spans, partial.run_attributes)
                    _apply(partial, trajectory)
            raise
        finally:
            if clock is not None:  # the stage's time is the worker's; only what it held counts as queued
                clock.held_s -= loop.time() - started - (report.held_s if report is not None else 0.0)
        remote.report = report
        graft(report.spans, report.run_attributes)  # the worker's model and tool spans, under this run stage
        _apply(report, trajectory)
        if report.error is not None:
            raise report.error
        if report.timed_out:
            raise TimeoutError


def _apply(report: RunReport, trajectory: Trajectory) -> None:
    trajectory.messages[:] = report.messages  # in place: the episode holds the same list
    trajectory.tools[:] = report.tools
    trajectory.finish = report.finish  # type: ignore[assignment]
    trajectory.num_tool_calls, trajectory.num_format_errors = report.num_tool_calls, report.num_format_errors
