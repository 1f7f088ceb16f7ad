"""Our rollout service inside a NeMo Gym agent: the server Gym starts runs the service itself, in its own process.

For a single-node run a recipe then starts everything: Gym starts this agent, the agent starts the service
(pipeline, job store, LLM pool) and its sandboxes run on the node Gym runs on. `/run` and `/aggregate_metrics` are
the service's own (`nemo_gym_prorl.gym.agent_routes`), so a row gets the same rollout and the same verify response
as through the relay to a `prorl serve` (`responses_api_agents/prorl_service`). The model backends are the training
policy's servers from Gym's global config, registered before the first `/run`; `rollout_service.model` says how to
talk to them (chat mode for NeMo RL's server) and `rollout_service.service` which tasks, pipeline and limits to run.
"""

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from nemo_gym.base_resources_server import AggregateMetricsRequest
from pydantic import Field, PrivateAttr, ValidationError

from nemo_gym_prorl.gym.agent_routes import GymRunRequest, aggregate_metrics, run_row
from nemo_gym_prorl.gym.policy import PolicyBackends
from nemo_gym_prorl.gym.rollout_agent import RolloutAgent, RolloutAgentConfig
from nemo_gym_prorl.launch.runtime import ServiceConfig, ServiceRuntime
from nemo_gym_prorl.service.orchestrator import Orchestrator, RejectedJob


class ProrlAgentConfig(RolloutAgentConfig):
    rollout_service: ServiceConfig = Field(
        default_factory=ServiceConfig,
        description="`prorl serve`'s config (service/model/sandbox); service.host/port/token are unused here, and "
        "the job store is a temporary file unless service.store is set",
    )


class ProrlAgent(RolloutAgent):
    config: ProrlAgentConfig
    _orchestrator: Orchestrator | None = PrivateAttr(None)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.router.lifespan_context = self._service_lifespan
        return app

    @asynccontextmanager
    async def _service_lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """The service runs while the server does; on shutdown every rollout is stopped and its sandbox closed."""
        config = self.config.rollout_service
        if self._policy.backends is None and config.model.kind == "remote" and not config.model.addresses:
            raise ValueError(
                f"{self.config.name}: no model to roll out with: Gym's global config names no policy_base_url (NeMo "
                "RL writes it; `gym env start` takes --model-url) and rollout_service.model.addresses is empty"
            )
        with tempfile.TemporaryDirectory(prefix="prorl-agent-") as scratch:
            if "store" not in config.service.model_fields_set:
                config = config.model_copy(deep=True)
                config.service.store = Path(scratch) / "jobs.db"
            async with ServiceRuntime(config) as runtime:
                self._orchestrator = runtime.orchestrator
                try:
                    yield
                finally:
                    self._orchestrator = None

    def _service(self) -> Orchestrator:
        if self._orchestrator is None:
            raise HTTPException(503, "the rollout service is not running (starting or stopping)")
        return self._orchestrator

    async def status(self) -> Response:
        return JSONResponse(self._service().status())

    async def register_policy(self, backends: PolicyBackends) -> None:
        self._service().pool.register(backends.addresses, backends.model, backends.api_key, backends.replace)

    async def run_rollout(self, request: Request) -> Response:
        try:
            row = GymRunRequest.model_validate_json(await request.body())
            return JSONResponse(await run_row(self._service(), row))
        except (ValidationError, RejectedJob) as e:
            return JSONResponse({"detail": str(e)}, status_code=422)

    async def aggregate_metrics(self, request: Request) -> Response:
        try:
            body = AggregateMetricsRequest.model_validate_json(await request.body())
        except ValidationError as e:
            return JSONResponse({"detail": str(e)}, status_code=422)
        return JSONResponse((await aggregate_metrics(body)).model_dump(mode="json"))


if __name__ == "__main__":
    ProrlAgent.run_webserver()
