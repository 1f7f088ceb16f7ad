"""Everything a running rollout service holds, started and stopped as one: the embedded model (when configured),
the LLM pool, the job store, the pipeline and the orchestrator. On exit every live rollout is cancelled and its
sandbox closed before the model and the pool go.
"""

from __future__ import annotations

import os
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.agent.llm_pool import LLMPool, LLMPoolConfig
from nemo_gym_prorl.agent.turns import GenerationMode
from nemo_gym_prorl.cluster.settings import RaySettings
from nemo_gym_prorl.contracts.task import ToolCallFormatName, load_task
from nemo_gym_prorl.models.launcher import LocalModelConfig, LocalModelServer
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.gc_tuning import GcSettings
from nemo_gym_prorl.service.orchestrator import ModelSettings, Orchestrator
from nemo_gym_prorl.service.pipeline import PipelineConfig, RolloutPipeline
from nemo_gym_prorl.service.store import JobStore, RecoveryPolicy
from nemo_gym_prorl.telemetry.tracing import TracingConfig, exporting

TOKEN_ENV = "PRORL_SERVICE_TOKEN"


class ModelConfig(LocalModelConfig):
    """`kind: local` starts the embedded server; `kind: remote` uses only `addresses` (and /add_llm_server)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["local", "remote"] = "local"
    addresses: list[str] = Field(default_factory=list)
    tool_call_format: ToolCallFormatName = "codeact"
    generation_mode: GenerationMode = "tokens"


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str = "bwrap"


class ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    token: str | None = Field(None, description=f"bearer token; also read from ${TOKEN_ENV}")
    tasks: list[str] = Field(default_factory=lambda: ["math/arithmetic"])
    store: Path = Path("prorl-service.db")
    recovery: RecoveryPolicy = "requeue"
    max_n: int = Field(1024, ge=1)
    max_body_bytes: int = Field(8 << 20, ge=1024)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    llm_pool: LLMPoolConfig = Field(default_factory=LLMPoolConfig)
    gc: GcSettings = Field(default_factory=GcSettings)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    shutdown_grace_s: float = Field(
        5.0, ge=0, description="on stop, how long open requests may go on before they are cut (a stream, a blocking "
        "/process or /run would otherwise hold the stop until its rollout ends); their jobs stay for the next start",
    )


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    service: ServiceSettings = Field(default_factory=ServiceSettings)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    ray: RaySettings = Field(default_factory=RaySettings)

    def bearer_token(self) -> str | None:
        return self.service.token or os.environ.get(TOKEN_ENV) or None


class ServiceRuntime:
    """``async with ServiceRuntime(config) as runtime: runtime.orchestrator``."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self._stack = AsyncExitStack()
        self.orchestrator: Orchestrator | None = None

    async def __aenter__(self) -> ServiceRuntime:
        config = self.config
        tasks = [load_task(name) for name in config.service.tasks]
        try:
            await self._stack.enter_async_context(exporting(config.service.tracing))  # left last: flushes the others' spans
            pool_type = LLMPool
            if config.ray.enabled:  # rollouts on Ray workers, each with a pool of its own that this one drives
                from nemo_gym_prorl.cluster.fleet_pool import FleetPool

                pool_type = FleetPool
            pool = await self._stack.enter_async_context(pool_type(config.service.llm_pool, config.model.addresses))
            tokenizer = None
            if config.model.kind == "local":
                server = await self._stack.enter_async_context(LocalModelServer(config.model))
                pool.add(server.base_url)
            if config.model.generation_mode == "tokens":
                tokenizer = Tokenizer.from_gguf(config.model.gguf or default_gguf())
            model = ModelSettings(
                name=config.model.served_model_name,
                generation_mode=config.model.generation_mode,
                tool_call_format=config.model.tool_call_format,
                context_window=config.model.n_ctx,
            )
            remote = None
            if config.ray.enabled:  # closed after the pipeline has cancelled what still runs on the workers
                from nemo_gym_prorl.cluster.fleet import WorkerFleet
                from nemo_gym_prorl.cluster.worker import WorkerSpec

                gguf = str(config.model.gguf or default_gguf()) if tokenizer is not None else None
                spec = WorkerSpec(
                    tasks=tasks, sandbox_backend=config.sandbox.backend, model=model,
                    llm_pool=config.service.llm_pool, backends=[], gguf=gguf,
                )  # fmt: skip
                fleet = WorkerFleet(config.ray, spec, pool)  # type: ignore[arg-type]  # a FleetPool
                remote = await self._stack.enter_async_context(fleet)
            store = JobStore(config.service.store)
            self._stack.callback(store.close)
            pipeline = await self._stack.enter_async_context(RolloutPipeline(config.service.pipeline))
            self.orchestrator = Orchestrator(
                tasks,
                config.sandbox.backend,
                model,
                tokenizer,
                pool,
                pipeline,
                store,
                max_n=config.service.max_n,
                remote=remote,
            )
            self._stack.push_async_callback(self.orchestrator.close)
            self.orchestrator.recover(config.service.recovery)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()
