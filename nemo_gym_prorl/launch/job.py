"""`prorl rollout`: a client of the rollout service — one job per task instance, `n_samples` samples each.

With ``service.url`` unset the service runs in-process (the same runtime ``prorl serve`` runs); with it set, the
jobs go to that service over HTTP. Either way the trajectories are the same. While they run, the service's count of
turns and tokens generated is polled, so a run whose rollouts take minutes each shows progress before the first ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.progress import Generated
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.task import TaskInstance, load_task
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.envs.dataset import load_instances
from nemo_gym_prorl.launch.runtime import ModelConfig, SandboxConfig, ServiceConfig, ServiceRuntime, ServiceSettings
from nemo_gym_prorl.service.client import RolloutClient, RolloutService, ServiceError
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig
from nemo_gym_prorl.telemetry.tracing import TracingConfig


class TaskChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="a task YAML under tasks/, e.g. math/arithmetic")


class RemoteService(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(None, description="a running `prorl serve`; unset: run the service in-process")
    token: str | None = None


class RolloutJobConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: TaskChoice
    model: ModelConfig
    sandbox: SandboxConfig
    service: RemoteService = Field(default_factory=RemoteService)
    n_samples: int = Field(1, ge=1)
    limit: int | None = Field(None, ge=1)
    concurrency: int = Field(4, ge=1)
    output: Path
    seed: int = 0
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    progress_interval_s: float = Field(1.0, gt=0, description="how often the turns and tokens generated are polled")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="the in-process service's traces")


class RolloutSink(Protocol):
    """Where finished trajectories go as they finish (a report, a file, a queue)."""

    def expect(self, total: int) -> None: ...

    def live(self, generated: Generated) -> None:
        """Turns and tokens generated for this run so far, unfinished rollouts included (on Ray: never called)."""

    def add(self, trajectory: Trajectory) -> None: ...


async def _generated(client: RolloutService) -> Generated | None:
    """The service's counts now; None where it keeps none (Ray) or does not answer (the run goes on without)."""
    with contextlib.suppress(ServiceError, httpx.HTTPError, ValidationError):  # progress never fails the rollouts
        if (counts := (await client.status()).get("generated")) is not None:
            return Generated.model_validate(counts)
    return None


async def _show_progress(client: RolloutService, sink: RolloutSink, since: Generated) -> None:
    """What was generated after `since` (a remote service may be serving others too), to the sink."""
    if (now := await _generated(client)) is not None:
        sink.live(now.since(since))


async def _report_progress(client: RolloutService, sink: RolloutSink, interval_s: float, since: Generated) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await _show_progress(client, sink, since)


def in_process_service(
    task: str, model: ModelConfig, sandbox: SandboxConfig, concurrency: int, tracing: TracingConfig | None = None
) -> ServiceConfig:
    """The service a command runs in its own process: one task, `concurrency` rollouts live, nothing stored."""
    stage = StageConfig(workers=concurrency)
    pipeline = PipelineConfig(init=stage, run=stage, eval=stage, max_live_sandboxes=concurrency)
    settings = ServiceSettings(
        tasks=[task], store=Path(":memory:"), pipeline=pipeline, tracing=tracing or TracingConfig()
    )
    return ServiceConfig(service=settings, model=model, sandbox=sandbox)


async def run_job(config: RolloutJobConfig, sink: RolloutSink | None = None) -> list[Trajectory]:
    task = load_task(config.task.name)
    instances = load_instances(task.dataset, config.limit)
    async with contextlib.AsyncExitStack() as stack:
        if config.service.url is None:
            service = in_process_service(config.task.name, config.model, config.sandbox, config.concurrency, config.tracing)
            runtime = await stack.enter_async_context(ServiceRuntime(service))
            assert runtime.orchestrator is not None
            client = RolloutClient.in_process(runtime.orchestrator)
        else:
            client = await stack.enter_async_context(RolloutClient(config.service.url, config.service.token))
        if sink is not None:  # once the service is up: a progress bar is not drawn for a run that cannot start
            sink.expect(len(instances) * config.n_samples)
            if (since := await _generated(client)) is not None:
                progress = asyncio.create_task(_report_progress(client, sink, config.progress_interval_s, since))
                stack.push_async_callback(_last_report, progress, client, sink, since)
        sampling = config.sampling.model_copy(update={"seed": config.seed})

        async def one_instance(instance: TaskInstance) -> list[Trajectory]:
            request = JobRequest(
                task=task.name, instance=instance.data, instance_id=instance.instance_id, sampling_params=sampling, n=config.n_samples
            )
            job_id = await client.submit(request)
            trajectories = []
            async for _, trajectory in client.stream(job_id):
                trajectories.append(trajectory)
                if sink is not None:
                    sink.add(trajectory)
            return trajectories

        per_instance = await asyncio.gather(*(one_instance(instance) for instance in instances))
    return [t for trajectories in per_instance for t in trajectories]


async def _last_report(progress: asyncio.Task[None], client: RolloutService, sink: RolloutSink, since: Generated) -> None:
    """Stop polling; the last counts, taken once every rollout has ended, are the run's whole."""
    progress.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await progress
    await _show_progress(client, sink, since)
