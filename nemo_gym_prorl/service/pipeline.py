"""The three-stage rollout pipeline: init → run → eval, each with its own queue and bounded worker pool.

Stages keep slow, bursty inits and evals from holding slots the model could use; live sandboxes are capped
separately, and the run stage closes its sandbox before eval. With ``fork_groups`` on, a GRPO group goes through
init as one (``group_fork``). Deadlines count stage time only; cancelling frees the sandbox at once; every rollout
ends in a trajectory whose ``critical_error`` says what ended it.

Design notes: docs/service.md#servicepipelinepy
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.contracts.trajectory import RolloutFailed, Trajectory
from nemo_gym_prorl.envs.base import Environment, Episode, Submission
from nemo_gym_prorl.harness.runner import HarnessRunner
from nemo_gym_prorl.sandbox.lifecycle import to_the_end
from nemo_gym_prorl.service.group_fork import ForkGroup
from nemo_gym_prorl.telemetry.stage_clock import StageClock, current_stage_clock
from nemo_gym_prorl.telemetry.tracing import RolloutTrace, graft

_log = logging.getLogger(__name__)

Stage = Literal["init", "run", "eval"]
STAGES: tuple[Stage, ...] = ("init", "run", "eval")


class StageConfig(BaseModel):
    workers: int = Field(ge=1)
    deadline_s: float | None = Field(None, gt=0)


class PipelineConfig(BaseModel):
    init: StageConfig = StageConfig(workers=8, deadline_s=300)
    run: StageConfig = StageConfig(workers=256, deadline_s=3600)
    eval: StageConfig = StageConfig(workers=8, deadline_s=900)
    job_deadline_s: float | None = Field(None, gt=0, description="init + run + eval time of one rollout")
    max_live_sandboxes: int = Field(256, ge=1)
    fork_groups: bool | None = Field(
        None, description="a job's samples (a GRPO group) share one init, forked into one sandbox per sample (one "
        "init, n forks: service/group_fork.py); where the task type and sandbox backend can fork, else one init each. "
        "None: as the task's environment asks (Environment.shares_group_init: SWE's verifier.fork_groups)",
    )


@dataclass
class Rollout:
    """One sample travelling through the pipeline."""

    env: Environment
    agent: AgentLoop | HarnessRunner  # our loop, or an unmodified harness behind a model proxy (the task's harness)
    instance: TaskInstance
    trajectory: Trajectory = field(default=None)  # type: ignore[assignment]  # set in __post_init__
    job_deadline_s: float | None = None
    stage_deadlines_s: dict[Stage, float | None] = field(default_factory=dict)
    # with it, a rollout that ends before its run stage gets the model's first turn alone, masked, in a run stage
    first_turn_agent: AgentLoop | None = None
    ended_early: tuple[str, str | None] | None = None  # (critical_error, error) of such a rollout, while it does
    episode: Episode | None = None
    submission: Submission | None = None
    stage_time: float = 0.0
    enqueued_at: float = 0.0
    current: asyncio.Task[None] | None = None
    cancelled: bool = False
    finished: bool = False
    holds_sandbox_slot: bool = False
    run_completed: bool = False
    group: ForkGroup | None = None  # the init it shares with the other samples of its group, while in init
    done: asyncio.Future[Trajectory] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    trace: RolloutTrace = field(init=False)

    def __post_init__(self) -> None:
        if self.trajectory is None:
            self.trajectory = Trajectory(instance_id=self.instance.instance_id, trajectory_id=uuid.uuid4().hex)
        self.trace = RolloutTrace(self.trajectory)

    def __hash__(self) -> int:
        return id(self)


@dataclass(eq=False)
class _Group:
    """Samples of one instance that go through init as one (fork_groups)."""

    members: list[Rollout]


class _StageTimeout(Exception):
    pass


class RolloutLost(Exception):
    """The rollout's work was lost with the process or node that ran it (a Ray worker): with `rerun`, the pipeline
    runs it again from init (elsewhere); without, it ends with this stage's critical_error and the message."""

    def __init__(self, message: str, rerun: bool) -> None:
        super().__init__(message)
        self.rerun = rerun


class RolloutPipeline:
    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._queues: dict[Stage, asyncio.Queue[Rollout | _Group]] = {stage: asyncio.Queue() for stage in STAGES}
        self._queued: dict[Stage, int] = dict.fromkeys(STAGES, 0)  # rollouts in the queue (a group counts each)
        self._active: dict[Stage, int] = dict.fromkeys(STAGES, 0)
        self._held: dict[Stage, int] = dict.fromkeys(STAGES, 0)  # taken by a worker, waiting on intake or a slot
        self._workers: list[asyncio.Task[None]] = []
        self._sandbox_slots = asyncio.Semaphore(config.max_live_sandboxes)
        self._slot_order = asyncio.Lock()  # a group takes its slots together: two never each hold part, waiting
        self.group_stats: Counter[str] = Counter()  # fork_groups: groups, their inits and the sandboxes forked
        self._live: set[Rollout] = set()
        self._intake = asyncio.Event()
        self._intake.set()

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutPipeline:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        if self._workers:
            return
        for stage in STAGES:
            stage_config: StageConfig = getattr(self.config, stage)
            self._workers += [asyncio.create_task(self._worker(stage)) for _ in range(stage_config.workers)]

    def pause(self) -> None:
        """Workers stop taking new rollouts; rollouts already in a stage go on. Queued ones wait for resume."""
        self._intake.clear()

    def resume(self) -> None:
        self._intake.set()

    @property
    def paused(self) -> bool:
        return not self._intake.is_set()

    async def close(self) -> None:
        """Cancel everything still live (their sandboxes are closed) and stop the workers."""
        await asyncio.gather(*(self.cancel(r) for r in list(self._live)))
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers.clear()

    # -- intake and cancel ---------------------------------------------------------------------------------------

    def submit(self, rollouts: Iterable[Rollout], group: bool = False) -> None:
        """Start `rollouts`. With `group` (they are the samples of one instance) and ``fork_groups`` on (or unset and
        their environment asking for it), they share one init where their environment can fork, in groups of at most
        ``max_live_sandboxes``."""
        rollouts = list(rollouts)
        for rollout in rollouts:
            self._live.add(rollout)
            rollout.trace.start()
        if group and len(rollouts) > 1 and self._forks_groups(rollouts[0]):
            size = self.config.max_live_sandboxes
            for i in range(0, len(rollouts), size):
                self._enqueue("init", _Group(rollouts[i : i + size]))
        else:
            for rollout in rollouts:
                self._enqueue("init", rollout)

    def _forks_groups(self, rollout: Rollout) -> bool:
        env = rollout.env
        wanted = self.config.fork_groups if self.config.fork_groups is not None else env.shares_group_init
        return wanted and env.can_fork and rollout.agent.can_share_init

    async def cancel(self, rollout: Rollout) -> None:
        """End `rollout` as cancelled now: a running stage is interrupted, a held sandbox is closed."""
        if rollout.finished or rollout.cancelled:
            return
        rollout.cancelled = True
        if rollout.current is not None and not rollout.current.done():
            rollout.current.cancel()  # its worker finishes it
            await asyncio.wait({rollout.done})
        elif rollout.ended_early is not None:  # queued for its first turn alone: it ends as it was to
            await self._finish(rollout, *self._ending(rollout, "cancelled while queued"))
        else:
            await self._finish(rollout, "cancelled", "cancelled while queued")

    def status(self) -> dict[str, dict[str, int]]:
        """Per stage: rollouts waiting for it (a worker may hold them while the pipeline is paused or every sandbox
        slot is taken), rollouts in it, and its workers."""
        return {
            stage: {
                "queued": self._queued[stage] + self._held[stage],
                "active": self._active[stage],
                "workers": getattr(self.config, stage).workers,
            }
            for stage in STAGES
        }

    @property
    def live(self) -> int:
        return len(self._live)

    # -- internals -----------------------------------------------------------------------------------------------

    def _enqueue(self, stage: Stage, item: Rollout | _Group) -> None:
        members = item.members if isinstance(item, _Group) else [item]
        for rollout in members:
            rollout.enqueued_at = time.perf_counter()
        self._queued[stage] += len(members)
        self._queues[stage].put_nowait(item)

    async def _worker(self, stage: Stage) -> None:
        queue = self._queues[stage]
        while True:
            item = await queue.get()
            members = item.members if isinstance(item, _Group) else [item]
            taken = len(members)
            self._queued[stage] -= taken
            self._held[stage] += taken
            try:
                await self._intake.wait()
                members = await self._take_slots(stage, members)
            finally:
                self._held[stage] -= taken
            if len(members) > 1:
                await self._init_group(members)
            elif members:
                await self._drive(stage, members[0])

    async def _take_slots(self, stage: Stage, members: list[Rollout]) -> list[Rollout]:
        """The members still live; at init each holds a sandbox slot (a group's members theirs all at once)."""
        if stage != "init":
            return [r for r in members if not r.cancelled]
        async with self._slot_order:
            for rollout in members:
                if rollout.cancelled:
                    continue
                await self._sandbox_slots.acquire()
                if rollout.cancelled:
                    self._sandbox_slots.release()
                    continue
                rollout.holds_sandbox_slot = True
        return [r for r in members if not r.cancelled]

    async def _init_group(self, members: list[Rollout]) -> None:
        """One init for `members`, forked into one sandbox each; each member's init stage waits for its own."""
        group = ForkGroup({r: r.env for r in members}, members[0].instance, passed=(RolloutLost,))
        for rollout in members:
            rollout.group = group
        try:
            await asyncio.gather(*(self._drive("init", rollout) for rollout in members))
        finally:
            self.group_stats.update(groups=1, inits=group.inits, forks=group.forks)

    async def _drive(self, stage: Stage, rollout: Rollout) -> None:
        """Run `stage` of `rollout` as its own task (what a cancel interrupts), then hand it on."""
        if rollout.cancelled:  # a group member cancelled between taking its slot and now (already finished)
            await self._leave_group(rollout)
            return
        rollout.trajectory.timing.queued += time.perf_counter() - rollout.enqueued_at
        self._active[stage] += 1
        rollout.current = asyncio.create_task(self._run_stage(stage, rollout))
        try:
            await asyncio.wait({rollout.current})
        except asyncio.CancelledError:  # the pipeline is closing
            rollout.current.cancel()
            await asyncio.wait({rollout.current})
            await self._leave_group(rollout)
            await self._finish(rollout, "cancelled", "the service stopped")
            raise
        finally:
            self._active[stage] -= 1
        try:
            await self._leave_group(rollout)
            await self._after_stage(stage, rollout, rollout.current)
        except Exception as e:  # a bug fails its rollout, never the worker (the next rollouts would wait forever)
            _log.exception("rollout %s: handing it on after %s failed", rollout.trajectory.trajectory_id, stage)
            await self._finish(rollout, stage, f"internal error after {stage}: {e!r}")

    @staticmethod
    async def _leave_group(rollout: Rollout) -> None:
        """After its init stage, a group member waits for the group no more (nothing made for it is left unless it
        took it); a later init (a re-run) is its own."""
        group, rollout.group = rollout.group, None
        if group is not None:
            await group.detach(rollout)

    async def _run_stage(self, stage: Stage, rollout: Rollout) -> None:
        budget = self._budget(stage, rollout)
        span = rollout.trace.stage(stage)  # times the stage; its spans hold the calls made inside
        clock: StageClock | None = None
        try:
            async with span, asyncio.timeout(budget) as timeout:
                clock = StageClock(timeout)
                current_stage_clock.set(clock)  # this stage's task only
                if stage == "init" and rollout.group is not None:
                    try:
                        rollout.episode = await rollout.group.take(rollout)
                    finally:  # its init is the group's: the shared init and the fork, under this stage
                        graft(rollout.group.timed_spans(since=span.start), {"group_size": rollout.group.size})
                elif stage == "init":
                    rollout.episode = await rollout.agent.init(rollout.env, rollout.instance)
                elif stage == "run" and rollout.ended_early is not None:
                    assert rollout.first_turn_agent is not None
                    episode = Episode(instance=rollout.instance, sandbox=None)
                    rollout.first_turn_agent.start(rollout.env, episode, rollout.trajectory)
                    reason = f"the rollout ended before its first turn ({rollout.ended_early[0]})"
                    await rollout.first_turn_agent.first_turn_only(rollout.trajectory, reason)
                elif stage == "run":
                    assert rollout.episode is not None
                    rollout.agent.start(rollout.env, rollout.episode, rollout.trajectory)
                    await rollout.agent.run(rollout.env, rollout.episode, rollout.trajectory)
                    rollout.submission = await rollout.env.collect(rollout.episode)
                else:
                    assert rollout.submission is not None
                    evaluation = await rollout.env.grade(rollout.instance, rollout.submission)
                    t = rollout.trajectory
                    t.reward, t.resolved, t.evaluation = evaluation.reward, evaluation.resolved, evaluation.details
        except TimeoutError as e:
            raise _StageTimeout(self._timeout_message(stage, rollout, budget)) from e
        finally:
            waited = clock.held_s if clock is not None else 0.0  # on a weight sync: queue time
            elapsed = span.duration_s - waited
            rollout.stage_time += elapsed
            setattr(rollout.trajectory.timing, stage, elapsed)
            rollout.trajectory.timing.queued += waited

    def _budget(self, stage: Stage, rollout: Rollout) -> float | None:
        limits = [rollout.stage_deadlines_s.get(stage, getattr(self.config, stage).deadline_s)]
        job_deadline = rollout.job_deadline_s if rollout.job_deadline_s is not None else self.config.job_deadline_s
        if job_deadline is not None and rollout.ended_early is None:  # a first turn alone has its stage's deadline
            limits.append(max(job_deadline - rollout.stage_time, 0.0))
        known = [limit for limit in limits if limit is not None]
        return min(known) if known else None

    def _timeout_message(self, stage: Stage, rollout: Rollout, budget: float | None) -> str:
        stage_limit = rollout.stage_deadlines_s.get(stage, getattr(self.config, stage).deadline_s)
        if stage_limit is not None and budget == stage_limit:
            return f"the {stage} stage ran past its deadline of {stage_limit:g} s"
        return f"the rollout ran past its job deadline during {stage} ({budget:g} s left when {stage} began)"

    async def _after_stage(self, stage: Stage, rollout: Rollout, task: asyncio.Task[None]) -> None:
        if rollout.ended_early is not None:  # its first turn alone, generated or not: it ends as it was to
            await self._finish(rollout, *self._ending(rollout, self._failure(rollout, task)))
            return
        if task.cancelled() or rollout.cancelled:
            await self._finish(rollout, "cancelled", f"cancelled during {stage}")
            return
        error = task.exception()
        if isinstance(error, _StageTimeout):
            await self._end(rollout, stage, "timeout", str(error))
        elif isinstance(error, RolloutLost) and error.rerun:
            _log.warning("rollout %s: %s; running it again", rollout.trajectory.trajectory_id, error)
            await self._close_sandbox(rollout)
            rollout.submission = None
            t = rollout.trajectory  # the lost run's turns are not this rollout's
            t.messages, t.tools, t.finish, t.num_tool_calls, t.num_format_errors = [], [], None, 0, 0
            rollout.run_completed = False
            self._enqueue("init", rollout)
        elif isinstance(error, RolloutFailed):
            await self._end(rollout, stage, error.critical_error, str(error))
        elif error is not None:
            detail = "".join(traceback.format_exception_only(error)).strip()
            await self._end(rollout, stage, stage, detail)
        elif stage == "init":
            self._enqueue("run", rollout)
        elif stage == "run":
            rollout.run_completed = True
            if failure := await self._close_sandbox(rollout):
                await self._finish(rollout, "run", failure)
            else:
                self._enqueue("eval", rollout)
        else:
            await self._finish(rollout, None, None)

    async def _end(self, rollout: Rollout, stage: Stage, critical_error: str, error: str) -> None:
        """Finish a rollout its `stage` failed; one with a ``first_turn_agent`` that never reached its run stage
        goes through one first, for that turn alone (under the run stage's deadline, traced, cancellable)."""
        if stage != "init" or rollout.first_turn_agent is None:
            await self._finish(rollout, critical_error, error)
            return
        rollout.ended_early = (critical_error, error)
        if failure := await self._close_sandbox(rollout):  # the first turn needs no sandbox: its slot goes back now
            rollout.ended_early = (critical_error, f"{error}; {failure}")
        self._enqueue("run", rollout)

    @staticmethod
    def _failure(rollout: Rollout, task: asyncio.Task[None]) -> str | None:
        if task.cancelled() or rollout.cancelled:
            return "cancelled"
        error = task.exception()
        if error is None or isinstance(error, _StageTimeout):
            return error and str(error)
        return "".join(traceback.format_exception_only(error)).strip()

    @staticmethod
    def _ending(rollout: Rollout, first_turn_failure: str | None) -> tuple[str, str | None]:
        """How a rollout that ended early ends: as it did, and why its first turn alone is missing, if it is."""
        assert rollout.ended_early is not None
        critical_error, error = rollout.ended_early
        if first_turn_failure is not None:
            error = f"{error}; its first turn alone could not be generated either: {first_turn_failure}"
        return critical_error, error

    async def _finish(self, rollout: Rollout, critical_error: str | None, error: str | None) -> None:
        """Close the sandbox if still open and hand the trajectory over, once."""
        if rollout.finished:
            return
        rollout.finished = True
        t = rollout.trajectory
        t.critical_error = critical_error  # type: ignore[assignment]
        t.error = error
        try:
            try:
                self._keep_submission(rollout)
            except Exception as e:  # a bug, said in the trajectory: never a result that looks whole
                _log.exception("rollout %s: keeping its submission failed", t.trajectory_id)
                t.critical_error = t.critical_error or "run"  # type: ignore[assignment]
                t.error = f"{t.error}; internal error keeping the submission: {e!r}" if t.error else repr(e)
            if failure := await self._close_sandbox(rollout):  # said, never hidden behind the first error
                t.critical_error = t.critical_error or "eval"  # type: ignore[assignment]
                t.error = f"{t.error}; {failure}" if t.error else failure
        finally:
            if t.critical_error is not None and not rollout.run_completed:
                t.finish = "error"
            self._live.discard(rollout)
            rollout.trace.end()
            if not rollout.done.done():
                rollout.done.set_result(t)

    @staticmethod
    def _keep_submission(rollout: Rollout) -> None:
        """What grading was given, on the trajectory, where the environment wants it kept (the run's turns are on
        it already: the agent loop writes them there as it goes)."""
        if rollout.submission is not None and rollout.env.keeps_submission:
            rollout.trajectory.submission = rollout.submission

    async def _close_sandbox(self, rollout: Rollout) -> str | None:
        """Close the rollout's sandbox and give its slot back; what went wrong closing it, if anything. A caller
        cancelled meanwhile (the service stopping) waits for the close to end (`to_the_end`): the slot is given back
        once the sandbox is gone, and a close that fails then is logged. A sandbox that will not close (processes
        that survive SIGKILL, a workspace that cannot be removed) fails its rollout, not the worker that runs it."""
        episode, rollout.episode = rollout.episode, None
        try:
            await to_the_end(self._release(rollout, episode))
        except Exception as e:
            _log.error("rollout %s: closing its sandbox failed", rollout.trajectory.trajectory_id, exc_info=e)
            return f"closing the sandbox failed: {''.join(traceback.format_exception_only(e)).strip()}"
        finally:
            if rollout.holds_sandbox_slot:
                rollout.holds_sandbox_slot = False
                self._sandbox_slots.release()
        return None

    @staticmethod
    async def _release(rollout: Rollout, episode: Episode | None) -> None:
        """The sandbox, and what the agent holds with it (a harness's model proxy), however either close ends."""
        try:
            await rollout.agent.close()
        finally:
            if episode is not None:
                await rollout.env.close(episode)


async def run_rollouts(
    rollouts: list[Rollout], config: PipelineConfig, on_done: Callable[[Trajectory], None] | None = None
) -> list[Trajectory]:
    """Run `rollouts` through a pipeline of their own; `on_done` sees each trajectory as it finishes."""
    async with RolloutPipeline(config) as pipeline:
        if on_done is not None:
            for rollout in rollouts:
                rollout.done.add_done_callback(lambda f: on_done(f.result()))
        pipeline.submit(rollouts)
        return list(await asyncio.gather(*(r.done for r in rollouts)))
