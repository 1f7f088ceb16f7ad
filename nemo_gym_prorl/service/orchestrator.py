"""The orchestrator: jobs in, rollouts through the pipeline, results durable and streamed out.

It never knows which sandbox backend or task type it runs: environments come from task YAMLs, the model from the
LLM pool. A job is one task instance with sampling parameters and ``n`` samples (a GRPO group); each sample is a
rollout through init → run → eval, and each finished trajectory is stored before anyone is told about it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_prorl.agent.llm_pool import LLMPool
from nemo_gym_prorl.agent.loop import AgentLoop
from nemo_gym_prorl.agent.turns import GenerationMode, turn_generator
from nemo_gym_prorl.contracts.job import MAX_STALE_RERUNS, JobRequest, JobView
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskConfig, TaskInstance, ToolCallFormatName
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.envs import Environment, make_environment
from nemo_gym_prorl.harness.calls import ModelCalls
from nemo_gym_prorl.harness.runner import HarnessRunner
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.pipeline import Rollout, RolloutPipeline, Stage
from nemo_gym_prorl.service.store import JobState, JobStore, RecoveryPolicy, StoredJob
from nemo_gym_prorl.tool_calls import tool_call_format

log = logging.getLogger(__name__)


class RejectedJob(ValueError):
    """A job that cannot be accepted; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class JobConflict(KeyError):
    """A job with this id exists already."""


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="model name sent to the backends")
    generation_mode: GenerationMode = "tokens"
    tool_call_format: ToolCallFormatName = "codeact"
    context_window: int | None = Field(None, description="tokens mode: what a turn without max_tokens may fill")


class _LiveJob:
    def __init__(self, request: JobRequest, restart: Callable[[list[int]], None], usable: int = 0) -> None:
        self.request = request
        self.restart = restart  # runs samples of the job (again)
        self.rollouts: list[Rollout] = []
        self.finished = asyncio.Condition()
        self.usable = usable  # results a trainer can learn from (Trajectory.mask_reason() is None)
        self.stopping: asyncio.Task[None] | None = None  # the early stop's cancelling of the rest
        self.stale_reruns: Counter[int] = Counter()  # per sample


def sample_seed(base: int, instance_id: str, sample: int) -> int:
    """A seed per (instance, sample) that reruns reproduce and that differs across a GRPO group."""
    return int.from_bytes(hashlib.sha256(f"{base}:{instance_id}:{sample}".encode()).digest()[:4], "little")


def make_agent_loop(
    env: Environment, model: ModelSettings, pool: LLMPool, tokenizer: Tokenizer | None, trajectory_id: str,
    sampling: SamplingParams,
) -> AgentLoop:  # fmt: skip
    """A rollout's agent loop, its requests routed through `pool` as `trajectory_id` (in-process or on a worker)."""
    generator = turn_generator(
        model.generation_mode, pool.poster(trajectory_id), model.name, sampling, tokenizer, model.context_window
    )
    fmt = tool_call_format(env.task.tool_call_format or model.tool_call_format)
    return AgentLoop(generator, fmt, env.task.max_turns)


def make_harness_runner(
    env: Environment, model: ModelSettings, pool: LLMPool, tokenizer: Tokenizer | None, trajectory_id: str,
    sampling: SamplingParams,
) -> HarnessRunner:  # fmt: skip
    """The rollout's harness (the task's), its model calls through `pool` as `trajectory_id`, token-in/token-out:
    the proxy renders each call's chat template itself, so it needs the policy's tokenizer. The model's tool calls
    are read in the task's format, Hermes' (the chat templates' own) when it names none."""
    harness = env.task.harness
    assert harness is not None and tokenizer is not None  # Orchestrator.submit refuses such a job before
    calls = ModelCalls(
        pool.poster(trajectory_id), model.name, tokenizer, sampling, env.task.tool_call_format or "hermes",
        model.context_window,
    )  # fmt: skip
    return HarnessRunner(harness, calls)


class RemoteRollouts(Protocol):
    """Where rollouts run when not in this process (nemo_gym_prorl.cluster): a rollout's environment and agent loop
    as the pipeline sees them, their work done elsewhere."""

    def bind(
        self, env: Environment, group: str, trajectory_id: str, sampling: SamplingParams
    ) -> tuple[Environment, AgentLoop]: ...

    def status(self) -> dict[str, Any]: ...


class Orchestrator:
    def __init__(
        self,
        tasks: list[TaskConfig],
        sandbox_backend: str,
        model: ModelSettings,
        tokenizer: Tokenizer | None,
        pool: LLMPool,
        pipeline: RolloutPipeline,
        store: JobStore,
        max_n: int = 1024,
        remote: RemoteRollouts | None = None,
    ) -> None:
        if not tasks:
            raise ValueError("the service needs at least one task")
        self.envs: dict[str, Environment] = {t.name: make_environment(t, sandbox_backend) for t in tasks}
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.pipeline = pipeline
        self.store = store
        self.max_n = max_n
        self.remote = remote
        self._live: dict[str, _LiveJob] = {}
        self.finished_rollouts: Counter[str] = Counter()
        self.reward_sum = 0.0
        self.stale_reruns = 0  # rollouts found stale (max_version_lag), whether run again or recorded masked
        self._closing = False

    # -- jobs ----------------------------------------------------------------------------------------------------

    def submit(self, request: JobRequest) -> str:
        """Accept a job (durably) and start its rollouts; RejectedJob / JobConflict when it cannot be."""
        env = self._job_env(request.task)
        if request.n > self.max_n:
            raise RejectedJob("n", f"at most {self.max_n} samples per job, got {request.n}")
        instance = self._instance(env, request)
        job_id = request.job_id or uuid.uuid4().hex
        try:
            self.store.add_job(job_id, request.model_dump(mode="json") | {"job_id": job_id}, request.n)
        except KeyError:
            raise JobConflict(job_id) from None
        self._start(job_id, request, env, instance, range(request.n))
        return job_id

    def _job_env(self, task: str | None) -> Environment:
        """The env a job of `task` runs in, if this service can run it (a new job's or a recovered one's)."""
        env = self._env(task)
        if env.task.harness is None:
            return env
        if self.remote is not None:
            raise RejectedJob("task", f"{env.task.name} runs a harness, which runs in the service's own process, "
                              "not on the Ray cluster this service uses (cluster.ray)")  # fmt: skip
        if self.tokenizer is None:
            raise RejectedJob("task", f"{env.task.name} runs a harness: its model proxy renders each call's prompt "
                              "itself and needs the policy's tokenizer: model.generation_mode=tokens")  # fmt: skip
        return env

    def _env(self, task: str | None) -> Environment:
        if task is None:
            return next(iter(self.envs.values()))
        if task not in self.envs:
            raise RejectedJob("task", f"unknown task {task!r}; this service runs: {', '.join(self.envs)}")
        return self.envs[task]

    @staticmethod
    def _instance(env: Environment, request: JobRequest) -> TaskInstance:
        id_key = env.task.dataset.id_key
        instance_id = request.instance_id or str(request.instance.get(id_key or "", "")) or "instance"
        instance = TaskInstance(instance_id=instance_id, data=request.instance)
        try:  # checked and rendered once, here: a row the task cannot use is refused; init and the loop reuse it
            return instance.model_copy(update={"prompt": env.check_row(instance)})
        except ValueError as e:
            raise RejectedJob("instance", str(e)) from None

    def _start(self, job_id: str, request: JobRequest, env: Environment, instance: TaskInstance, samples: range | list[int]) -> None:
        if job_id not in self._live:  # recovered jobs count the usable results they already have
            usable = sum(1 for t in self.store.results(job_id).values() if t.mask_reason() is None)
            restart = functools.partial(self._start, job_id, request, env, instance)
            self._live[job_id] = _LiveJob(request, restart, usable)
        live = self._live[job_id]
        deadlines: dict[Stage, float | None] = {}
        for stage in ("init", "run", "eval"):
            value = getattr(request.deadlines, f"{stage}_s")
            if value is not None:
                deadlines[stage] = value  # type: ignore[index]
        rollouts = []
        for sample in samples:
            trajectory_id = f"{job_id}:{sample}"
            sampling = request.sampling_params
            if sampling.seed is not None:  # reproducible, and different across the samples of a group
                sampling = sampling.model_copy(update={"seed": sample_seed(sampling.seed, instance.instance_id, sample)})
            if self.remote is None:
                rollout_env, agent = env, self._agent(env, trajectory_id, sampling)
            else:
                rollout_env, agent = self.remote.bind(env, job_id, trajectory_id, sampling)
            # A first turn alone is generated here by our loop: a remote one generates on its worker, and a harness
            # that never started has no prompt of its own to give (the turn is masked: its tokens are what counts).
            first_turn_agent = None
            if request.first_turn_fallback:
                first_turn_agent = agent if isinstance(agent, AgentLoop) and self.remote is None else make_agent_loop(
                    env, self.model, self.pool, self.tokenizer, trajectory_id, sampling
                )
            rollout = Rollout(
                env=rollout_env,
                agent=agent,
                instance=instance,
                job_deadline_s=request.deadlines.total_s,
                stage_deadlines_s=deadlines,
                first_turn_agent=first_turn_agent,
            )
            rollout.trajectory.trajectory_id = trajectory_id
            rollout.done.add_done_callback(lambda f, s=sample: self._record(job_id, s, f.result()))
            rollouts.append(rollout)
        live.rollouts += rollouts
        self.store.set_state(job_id, "running")
        # one group: with pipeline.fork_groups, one init forked into its samples (on Ray, on the init's worker)
        self.pipeline.submit(rollouts, group=True)

    def _agent(self, env: Environment, trajectory_id: str, sampling: SamplingParams) -> AgentLoop | HarnessRunner:
        make = make_agent_loop if env.task.harness is None else make_harness_runner
        return make(env, self.model, self.pool, self.tokenizer, trajectory_id, sampling)

    def _record(self, job_id: str, sample: int, trajectory: Trajectory) -> None:
        if self._closing:  # stopped by the shutdown, not finished: the job stays in flight for `recover`
            return
        live = self._live.get(job_id)
        if live is not None and live.stopping is not None and trajectory.critical_error == "cancelled":
            trajectory.error = f"early stop: {live.usable} of the group's samples were usable (stop_at_usable)"
        if live is not None and (stale := self._staleness(live, sample, trajectory)) is not None:
            if stale == "rerun":
                return
            trajectory.stale = stale
        self.store.add_result(job_id, sample, trajectory)
        self.finished_rollouts[trajectory.critical_error or "ok"] += 1
        self.reward_sum += trajectory.reward
        self.pool.release(trajectory.trajectory_id)
        progress = self.store.progress(job_id)
        stop_at = live.request.stop_at_usable if live is not None else None
        if live is not None and stop_at is not None and trajectory.mask_reason() is None:
            live.usable += 1
            if live.usable >= stop_at and live.stopping is None:
                live.stopping = asyncio.get_running_loop().create_task(self._stop_early(live))
        if progress is not None and progress.finished >= progress.n:
            if progress.state == "running":
                self.store.set_state(job_id, "done")
            self._live.pop(job_id, None)
        if live is not None:
            asyncio.get_running_loop().create_task(self._notify(live))

    def _staleness(self, live: _LiveJob, sample: int, trajectory: Trajectory) -> str | None:
        """None for a rollout within the job's max_version_lag; else "rerun" (it runs again from its start) or
        why it is stale (it is recorded masked)."""
        lag, first, last = live.request.max_version_lag, trajectory.first_policy_version, trajectory.last_policy_version
        if lag is None or first is None or last is None or last - first <= lag:
            return None
        self.stale_reruns += 1
        reason = f"its turns span policy versions {first} to {last}, more than max_version_lag={lag}"
        if live.request.on_stale == "rerun" and live.stale_reruns[sample] < MAX_STALE_RERUNS and live.stopping is None:
            live.stale_reruns[sample] += 1
            log.info("rollout %s is stale (%s): run again from its start", trajectory.trajectory_id, reason)
            self.pool.release(trajectory.trajectory_id)
            live.restart([sample])
            return "rerun"
        if live.stale_reruns[sample]:
            reason += f" (after {live.stale_reruns[sample]} reruns)"
        return reason

    async def _stop_early(self, live: _LiveJob) -> None:
        """The group has enough: cancel its other samples (their sandboxes are freed as for a cancel)."""
        await asyncio.gather(*(self.pipeline.cancel(r) for r in live.rollouts if not r.finished))

    @staticmethod
    async def _notify(live: _LiveJob) -> None:
        async with live.finished:
            live.finished.notify_all()

    def view(self, job_id: str, results: bool = True) -> JobView | None:
        """The job's state and its finished samples; without `results`, only how many have finished."""
        if not results:
            progress = self.store.progress(job_id)
            if progress is None:
                return None
            return JobView(job_id=job_id, state=progress.state, n=progress.n, finished=progress.finished, results=[])
        job = self.store.job(job_id)
        if job is None:
            return None
        done = list(self.store.results(job_id).values())
        return JobView(job_id=job_id, state=job.state, n=job.n, finished=len(done), results=done)

    async def cancel(self, job_id: str) -> bool:
        """Cancel every unfinished sample of a job; their sandboxes are freed before this returns."""
        job = self.store.job(job_id)
        if job is None:
            return False
        live = self._live.get(job_id)
        if job.state in ("queued", "running"):
            self.store.set_state(job_id, "cancelled")
        if live is not None:
            await asyncio.gather(*(self.pipeline.cancel(r) for r in live.rollouts))
        return True

    async def wait(self, job_id: str) -> JobView:
        """The job once every sample has finished: the trajectories as streamed (each parsed once), by sample."""
        results = {sample: trajectory async for sample, trajectory in self.stream(job_id)}
        progress = self.store.progress(job_id)
        assert progress is not None
        done = [results[sample] for sample in sorted(results)]
        return JobView(job_id=job_id, state=progress.state, n=progress.n, finished=len(done), results=done)

    async def stream(self, job_id: str, consumer: str | None = None) -> AsyncIterator[tuple[int, Trajectory]]:
        """(sample, trajectory) as each finishes, starting with those already finished (and not acknowledged by
        `consumer`)."""
        async for sample, text in self.stream_json(job_id, consumer):
            yield sample, Trajectory.model_validate_json(text)

    async def stream_json(self, job_id: str, consumer: str | None = None) -> AsyncIterator[tuple[int, str]]:
        """`stream()` with each trajectory as its stored JSON, for a caller that only sends it on; for a named
        `consumer`, without the samples it has acknowledged."""
        progress = self.store.progress(job_id)
        if progress is None:
            raise KeyError(job_id)
        sent: set[int] = self.store.acknowledged(consumer, job_id) if consumer is not None else set()
        while True:
            live = self._live.get(job_id)
            for sample in sorted(self.store.result_samples(job_id) - sent):
                text = self.store.result_json(job_id, sample)
                assert text is not None
                sent.add(sample)
                yield sample, text
            if len(sent) >= progress.n or live is None:
                return
            async with live.finished:
                if self.store.finished(job_id) == len(sent):
                    await live.finished.wait()

    def acknowledge(self, job_id: str, consumer: str, samples: list[int]) -> set[int]:
        """Record that `consumer` took these finished samples; all it has acknowledged of the job."""
        progress = self.store.progress(job_id)
        if progress is None:
            raise KeyError(job_id)
        unfinished = sorted(set(samples) - self.store.result_samples(job_id))
        if unfinished:
            raise RejectedJob("samples", f"samples {unfinished} of job {job_id!r} have no result to acknowledge")
        self.store.acknowledge(consumer, job_id, samples)
        return self.store.acknowledged(consumer, job_id)

    async def close(self) -> None:
        """Stop the pipeline (rollouts it cuts short are not recorded, so a restart recovers their jobs), then
        release what the environments hold, once no rollout uses them."""
        self._closing = True
        try:
            await self.pipeline.close()
        finally:
            await asyncio.gather(*(env.aclose() for env in self.envs.values()))

    # -- restart -------------------------------------------------------------------------------------------------

    def recover(self, policy: RecoveryPolicy) -> list[str]:
        """Jobs that were in flight when the service stopped: run their unfinished samples again, or fail them.

        One job that cannot run here any more (its task gone, its row no longer fitting the task) fails, naming
        why, instead of keeping the service from starting; a job whose samples were all recorded is marked done,
        and a cancelled job gets its unrecorded samples as cancelled."""
        recovered = []
        for job in self.store.unfinished_jobs():
            done = self.store.result_samples(job.job_id)
            missing = [s for s in range(job.n) if s not in done]
            recovered.append(job.job_id)
            if job.state == "cancelled":
                reason = "cancelled; the service stopped before this sample ended"
                self._fail_unfinished(job, missing, reason, state="cancelled")
            elif not missing:  # the stop came between the last result and the job's state
                self.store.set_state(job.job_id, "done")
            elif policy == "fail":
                self._fail_unfinished(job, missing, "the service restarted while this sample was in flight")
            else:
                try:
                    request = JobRequest.model_validate(job.request | {"job_id": job.job_id})
                    env = self._job_env(request.task)
                    instance = self._instance(env, request)
                except (ValidationError, RejectedJob) as e:
                    reason = f"the service restarted while this sample was in flight; its job cannot run here now: {e}"
                    self._fail_unfinished(job, missing, reason)
                else:
                    self._start(job.job_id, request, env, instance, missing)
        return recovered

    def _fail_unfinished(self, job: StoredJob, samples: list[int], reason: str, state: JobState = "done") -> None:
        for sample in samples:
            instance_id = str(job.request.get("instance_id") or "instance")
            trajectory = Trajectory(
                instance_id=instance_id,
                trajectory_id=f"{job.job_id}:{sample}",
                finish="error",
                critical_error="cancelled",
                error=reason,
            )
            self.store.add_result(job.job_id, sample, trajectory)
        self.store.set_state(job.job_id, state)

    def _where_generated(self) -> dict[str, Any]:
        """On Ray the workers' pools generate, and the head's counts would say nothing of the run."""
        if self.remote is not None:
            return {"workers": self.remote.status()}
        return {"generated": self.pool.generated.model_dump()}

    def status(self) -> dict[str, Any]:
        return {
            "paused": self.pipeline.paused,
            "stages": self.pipeline.status(),
            "live_rollouts": self.pipeline.live,
            "fork_groups": dict(self.pipeline.group_stats),
            "jobs": self.store.counts(),
            "llm_backends": [b.model_dump() for b in self.pool.backends()],
            "llm_paused": self.pool.paused,
            "policy_version": self.pool.policy_version,
            "stale_rollouts": self.stale_reruns,
            **self._where_generated(),
        }
