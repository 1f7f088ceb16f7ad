"""What our two Gym agents share: Gym's agent routes over a rollout service, and the policy's servers registered
with that service before the first rollout.

- ``responses_api_agents/prorl_service``: a relay to a ``prorl serve`` running elsewhere (rollout nodes);
- ``responses_api_agents/prorl_agent``: the service itself, run inside the agent's process (sandboxes on the node
  Gym runs on), so a recipe alone starts everything for a single-node run.

Both answer ``/run`` (one dataset row → one whole rollout → a Gym verify response) and ``/aggregate_metrics``;
``/v1/responses`` answers 501, as the service has no per-turn Responses API; ``GET /status`` is the service's
(stages, jobs, model backends and their health). Before the first ``/run`` they register
the training policy's servers that Gym's global config names (``gym.policy``), so every turn goes to them.
"""

from __future__ import annotations

from abc import abstractmethod

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from pydantic import Field, PrivateAttr

from nemo_gym_prorl.gym.policy import PolicyBackends, PolicyRegistration, policy_backends


class RolloutAgentConfig(BaseResponsesAPIAgentConfig):
    replace_llm_servers: bool = Field(
        True,
        description="the policy's servers from Gym's global config replace the service's other model backends "
        "(false: they join them, and turns are shared with models that are not the policy)",
    )


class RolloutAgent(SimpleResponsesAPIAgent):
    ray_enabled = False
    config: RolloutAgentConfig
    _policy: PolicyRegistration = PrivateAttr()

    def model_post_init(self, context: object) -> None:
        backends = policy_backends(self.server_client.global_config_dict, self.config.replace_llm_servers)
        self._policy = PolicyRegistration(backends, self.register_policy)
        super().model_post_init(context)

    def setup_webserver(self) -> FastAPI:
        app = FastAPI()
        app.post("/run")(self.run)
        app.post("/aggregate_metrics")(self.aggregate_metrics)
        app.post("/v1/responses")(self.responses)
        app.get("/status")(self.status)
        return app

    async def run(self, request: Request) -> Response:
        try:
            await self._policy.ensure()
        except Exception as e:
            detail = f"registering the policy's model servers with the rollout service failed: {type(e).__name__}: {e}"
            return JSONResponse({"detail": detail}, status_code=502)
        return await self.run_rollout(request)

    async def responses(self) -> JSONResponse:
        return JSONResponse({"detail": "the ProRL rollout service runs whole rollouts: POST /run"}, status_code=501)

    @abstractmethod
    async def register_policy(self, backends: PolicyBackends) -> None:
        """Make the service send every turn to these servers."""

    @abstractmethod
    async def run_rollout(self, request: Request) -> Response:
        """One dataset row's rollout: its verify response."""

    @abstractmethod
    async def aggregate_metrics(self, request: Request) -> Response:
        """Gym's run metrics over verify responses."""

    @abstractmethod
    async def status(self) -> Response:
        """The service's ``GET /status``: queues per stage, jobs, and its model backends with their health."""
