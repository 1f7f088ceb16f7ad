"""The rollout worker: a Ray actor on one node that runs rollouts' init / run / eval with sandboxes local to it.

The head's pipeline decides when each stage runs; the worker does the work, keyed by the rollout's id, and holds
each rollout's episode (its live sandbox) between calls. It talks to the model backends itself through an LLM pool
of its own, with the pool's rules (least in flight, one backend per trajectory, health, pause for weight sync),
so a turn never goes through the head.

The run stage keeps its own deadline here (the time the head had left for it), on a stage clock, so a weight sync
that holds this worker's requests holds the deadline as it would in-process; the report says how long it was held.
``close(key)`` (or ``abort(key)``) interrupts whatever the rollout is doing and closes its sandbox: that is how the
head's cancel and deadlines reach it; a run closed that way reports the turns and spans it got to. A worker that
starts sweeps what dead sandbox owners left on its node; `sweep_after` sweeps again once workers the head killed
are gone. The head pings it (`ping`) to tell a wedged worker from a busy one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from nemo_gym_prorl.agent.llm_pool import LLMPool, LLMPoolConfig
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskConfig, TaskInstance
from nemo_gym_prorl.contracts.trajectory import TimedSpan, Trajectory
from nemo_gym_prorl.envs import Environment, Episode, make_environment
from nemo_gym_prorl.envs.base import Evaluation, Submission
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.sandbox.bwrap import sweep_orphans
from nemo_gym_prorl.service.orchestrator import ModelSettings, make_agent_loop
from nemo_gym_prorl.telemetry.stage_clock import StageClock, current_stage_clock
from nemo_gym_prorl.telemetry.tracing import DetachedRun

_log = logging.getLogger(__name__)
_CLOSED_KEPT = 10_000


class Backend(BaseModel):
    address: str
    model: str | None = None
    api_key: str | None = None


class WorkerSpec(BaseModel):
    """What a worker needs to run any rollout of the service: its tasks, sandbox backend and model settings."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    tasks: list[TaskConfig]
    sandbox_backend: str
    model: ModelSettings
    llm_pool: LLMPoolConfig
    backends: list[Backend]
    paused: bool = False
    policy_version: int | None = None
    gguf: str | None = None  # tokens mode: the tokenizer's GGUF, a path every node sees


class RunReport(BaseModel):
    """What the run stage did: the outcome so far (also when it timed out or failed), what grading needs, how
    long its deadline stood still for a weight sync, and its model requests and tool calls as spans (timed from the
    worker's run start) with what was said of the run (its sandbox), for the head's trace."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    finish: str
    num_tool_calls: int
    num_format_errors: int
    submission: Submission | None = None
    timed_out: bool = False
    held_s: float = 0.0
    error: BaseException | None = None
    closed: bool = False  # a finished run closes its sandbox at once (one call less per rollout)
    close_error: BaseException | None = None
    spans: list[TimedSpan] = []
    run_attributes: dict[str, Any] = {}

    @classmethod
    def of(cls, run: Trajectory, **extra: Any) -> RunReport:
        return cls(
            messages=run.messages, tools=run.tools, finish=run.finish,
            num_tool_calls=run.num_tool_calls, num_format_errors=run.num_format_errors, **extra,
        )  # fmt: skip


@dataclass
class _Held:
    """A rollout as this worker holds it between the head's calls."""

    task: str | None = None
    episode: Episode | None = None
    run: Trajectory | None = None  # what the run got to, as the head's trajectory will have it
    recorded: DetachedRun | None = None  # the run's spans so far
    busy: asyncio.Task[Any] | None = None
    closed: bool = False


class RolloutWorker:
    """Made with ``ray.remote(RolloutWorker).options(...).remote(spec)``; `start()` before the first rollout."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.envs: dict[str, Environment] = {t.name: make_environment(t, spec.sandbox_backend) for t in spec.tasks}
        self.tokenizer = Tokenizer.from_gguf(spec.gguf) if spec.gguf else None
        self.pool: LLMPool | None = None
        self._rollouts: dict[str, _Held] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()  # closed before their init arrived (calls may overtake)
        self.swept: list[str] = []
        try:  # sandboxes of a worker that died on this node before
            self.swept = sweep_orphans()
        except OSError as e:  # another process sweeping the same leftovers (a cgroup going away under us)
            _log.warning("sweeping orphaned sandboxes failed: %s", e)

    async def start(self) -> dict[str, Any]:
        """Open the LLM pool (in the actor's event loop); returns where this worker runs."""
        import ray

        if self.pool is None:
            self.pool = LLMPool(self.spec.llm_pool)
            for backend in self.spec.backends:
                self.pool.add(backend.address, backend.model, backend.api_key)
            self.pool.policy_version = self.spec.policy_version
            self.pool.start()
            if self.spec.paused:
                await self.pool.pause()
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "pid": os.getpid(), "swept": len(self.swept)}

    # -- rollout stages ---------------------------------------------------------------------------------------------

    async def init(self, key: str, task: str, instance: TaskInstance) -> None:
        if key in self._closed:
            raise asyncio.CancelledError("the rollout was closed")
        held = self._rollouts.setdefault(key, _Held())
        held.task = task
        async with self._busy(held):
            episode = await self.envs[task].init(instance)
        if held.closed:  # closed while its sandbox was starting
            await self.envs[task].close(episode)
            return
        held.episode = episode

    async def fork(self, key: str, task: str, into: list[str]) -> None:
        """GRPO group forking: `key`'s sandbox (its group's init) forked into one rollout per key of `into`, each
        held here as if it had had an init of its own; `key`'s is closed on the way (it may be one of `into`)."""
        held = self._rollouts.pop(key, None)
        if held is None or held.episode is None:
            raise RuntimeError(f"rollout {key} holds no sandbox to fork (closed meanwhile)")
        env = self.envs[task]
        try:
            episodes = await env.fork(held.episode, [env] * len(into))
        finally:
            await env.close(held.episode)  # closed by the fork already, whatever happened
        for member, episode in zip(into, episodes, strict=True):
            if member in self._closed:  # closed while its fork was being made
                await env.close(episode)
            else:
                self._rollouts[member] = _Held(task=task, episode=episode)

    async def run(
        self, key: str, task: str, trajectory_id: str, sampling: SamplingParams, budget_s: float | None
    ) -> RunReport:
        recorded = self._rollouts[key].recorded = DetachedRun()
        with recorded.recording():
            report = await self._run(key, task, trajectory_id, sampling, budget_s)
        return report.model_copy(update={"spans": recorded.spans, "run_attributes": recorded.attributes})

    async def _run(
        self, key: str, task: str, trajectory_id: str, sampling: SamplingParams, budget_s: float | None
    ) -> RunReport:
        held = self._rollouts[key]
        assert held.episode is not None and self.pool is not None
        env = self.envs[task]
        agent = make_agent_loop(env, self.spec.model, self.pool, self.tokenizer, trajectory_id, sampling)
        run = Trajectory(instance_id=held.episode.instance.instance_id, trajectory_id=trajectory_id)
        agent.start(env, held.episode, run)
        held.run = run  # once started: a close reports what it got to
        clock: StageClock | None = None
        try:
            async with self._busy(held), asyncio.timeout(budget_s) as timeout:
                clock = StageClock(timeout)
                current_stage_clock.set(clock)
                await agent.run(env, held.episode, run)
                submission = await env.collect(held.episode)
        except TimeoutError:
            return RunReport.of(run, timed_out=True, held_s=clock.held_s if clock else 0.0)
        except Exception as e:  # the stage failed: said with what the run got to, as in-process
            return RunReport.of(run, error=e, held_s=clock.held_s if clock else 0.0)
        finally:
            self.pool.release(trajectory_id)
        self._rollouts.pop(key, None)
        close_error = None
        try:
            await env.close(held.episode)
        except Exception as e:  # said by the head's close, as in-process
            close_error = e
        held.episode = None
        return RunReport.of(run, submission=submission, held_s=clock.held_s, closed=True, close_error=close_error)

    async def grade(self, key: str, task: str, instance: TaskInstance, submission: Submission) -> Evaluation:
        held = self._rollouts.setdefault(key, _Held())
        try:
            async with self._busy(held):
                return await self.envs[task].grade(instance, submission)
        finally:
            self._rollouts.pop(key, None)

    async def close(self, key: str) -> RunReport | None:
        """Interrupt what the rollout is doing and close its sandbox; the run's outcome so far, if it had one."""
        held = self._rollouts.pop(key, None)
        if held is None:
            self._closed[key] = None  # an init still on its way finds it closed
            while len(self._closed) > _CLOSED_KEPT:
                self._closed.popitem(last=False)
            return None
        held.closed = True
        if held.busy is not None:
            held.busy.cancel()
            with contextlib.suppress(BaseException):
                await held.busy
        episode, held.episode = held.episode, None
        if episode is not None and held.task is not None:
            await self.envs[held.task].close(episode)
        if held.run is None:
            return None
        recorded = held.recorded or DetachedRun()  # its recording ended with the interrupted run
        return RunReport.of(held.run, spans=recorded.spans, run_attributes=recorded.attributes)

    @contextlib.asynccontextmanager
    async def _busy(self, held: _Held):  # type: ignore[no-untyped-def]
        if held.closed:
            raise asyncio.CancelledError("the rollout was closed")
        held.busy = asyncio.current_task()
        try:
            yield
        finally:
            held.busy = None

    # -- model backends and weight sync -----------------------------------------------------------------------------

    def add_backend(self, backend: Backend) -> None:
        if self.pool is None:  # not started yet: `start` adds it
            self.spec.backends.append(backend)
        else:
            self.pool.add(backend.address, backend.model, backend.api_key)

    def remove_backend(self, address: str) -> None:
        if self.pool is None:
            self.spec.backends = [b for b in self.spec.backends if b.address != address]
        else:
            self.pool.remove(address)

    async def pause_llm(self) -> None:
        """Returns once no request of this worker is at a model server."""
        self.spec.paused = True
        if self.pool is not None:
            await self.pool.pause()

    def resume_llm(self, policy_version: int | None = None) -> None:
        self.spec.paused = False
        if policy_version is not None:
            self.spec.policy_version = policy_version
        if self.pool is not None:
            self.pool.resume(policy_version)

    def llm_waiting(self) -> int:
        """Requests of this worker waiting for a resume or a healthy backend."""
        return self.pool.waiting if self.pool is not None else 0

    def live(self) -> int:
        return sum(1 for held in self._rollouts.values() if held.episode is not None)

    async def ping(self) -> None:
        """Answered by this worker's event loop: the head's sign that it is not wedged."""

    async def sweep_after(self, pids: list[int], within_s: float = 120.0) -> list[str]:
        """Once the processes `pids` on this node (workers the head killed) are gone, sweep what their sandboxes
        left (the sweep touches only dead owners' sandboxes: Ray kills a stopped process some seconds after
        ``ray.kill``). Gives up waiting after `within_s` and sweeps what is dead by then."""
        deadline = time.monotonic() + within_s
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # nothing to wait on for another process's exit but looking
        return await asyncio.to_thread(sweep_orphans)

    async def shutdown(self) -> None:
        """Close every sandbox this worker holds (the head is going away)."""
        await asyncio.gather(*(self.close(key) for key in list(self._rollouts)), return_exceptions=True)
        if self.pool is not None:
            await self.pool.aclose()
        await asyncio.gather(*(env.aclose() for env in self.envs.values()))
