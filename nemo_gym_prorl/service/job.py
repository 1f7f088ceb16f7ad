"""A rollout job: the config `prorl rollout` composes, and running it end to end."""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.envs import make_environment
from nemo_gym_prorl.envs.dataset import TaskInstance, load_instances
from nemo_gym_prorl.envs.task import load_task
from nemo_gym_prorl.models.engine import SamplingParams
from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.agent_loop import AgentLoop
from nemo_gym_prorl.service.llm_client import GenerationMode, http_poster, turn_generator
from nemo_gym_prorl.service.rollout import run_rollouts
from nemo_gym_prorl.service.trajectory import Trajectory
from nemo_gym_prorl.tool_calls import ToolCallFormatName, tool_call_format


class TaskChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="a task YAML under tasks/, e.g. math/arithmetic")


class ModelChoice(LocalModelConfig):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["local"]
    tool_call_format: ToolCallFormatName = "codeact"
    generation_mode: GenerationMode = "tokens"


class SandboxChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: Literal["bwrap"]


class RolloutJobConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: TaskChoice
    model: ModelChoice
    sandbox: SandboxChoice
    n_samples: int = Field(1, ge=1)
    limit: int | None = Field(None, ge=1)
    concurrency: int = Field(4, ge=1)
    output: Path
    seed: int = 0
    sampling: SamplingParams = Field(default_factory=SamplingParams)


class RolloutSink(Protocol):
    """Where finished trajectories go as they finish (a report, a file, a queue)."""

    def expect(self, total: int) -> None: ...

    def add(self, trajectory: Trajectory) -> None: ...


def sample_seed(base: int, instance_id: str, sample: int) -> int:
    """A seed per (instance, sample) that reruns reproduce and that differs across a GRPO group."""
    digest = hashlib.sha256(f"{base}:{instance_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


async def run_job(config: RolloutJobConfig, sink: RolloutSink | None = None) -> list[Trajectory]:
    task = load_task(config.task.name)
    instances = load_instances(task.dataset, config.limit)
    env = make_environment(task, config.sandbox.backend)
    tool_format = tool_call_format(task.tool_call_format or config.model.tool_call_format)
    tokenizer = Tokenizer.from_gguf(config.model.gguf or default_gguf())
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(LocalModelServer(config.model))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(600.0)))
        post = http_poster(http, server.base_url)

        def agent_for(instance: TaskInstance, sample: int) -> AgentLoop:
            sampling = config.sampling.model_copy(update={"seed": sample_seed(config.seed, instance.instance_id, sample)})
            generator = turn_generator(config.model.generation_mode, post, config.model.served_model_name, sampling, tokenizer)
            return AgentLoop(generator, tool_format, task.max_turns)

        jobs = [(instance, agent_for(instance, s)) for instance in instances for s in range(config.n_samples)]
        if sink is not None:
            sink.expect(len(jobs))
        return await run_rollouts(jobs, env, config.concurrency, sink.add if sink else None)
