"""Our rollout service (`prorl serve`) as a NeMo Gym agent.

Gym reaches an agent only through a server it starts itself, so a service running elsewhere cannot simply be named
by its URL. This is that server: it relays `/run` (one whole rollout: the row in, the verify response out) and
`/aggregate_metrics` (the run's metrics) to the service at `url`, with `Authorization: Bearer <token>` when a token
is configured, and answers with the service's reply — body and status — unchanged. Before the first `/run` it
registers the training policy's servers from Gym's global config with the service (`nemo_gym_prorl.gym.policy`).
"""

import aiohttp
from fastapi import Request, Response
from nemo_gym.server_utils import MAX_NUM_TRIES
from nemo_gym.server_utils import request as http_request
from pydantic import HttpUrl

from nemo_gym_prorl.gym.policy import PolicyBackends
from nemo_gym_prorl.gym.rollout_agent import RolloutAgent, RolloutAgentConfig


class ProrlServiceAgentConfig(RolloutAgentConfig):
    url: HttpUrl  # the running `prorl serve`
    token: str | None = None  # the service's bearer token (service.token or $PRORL_SERVICE_TOKEN there)


class ProrlServiceAgent(RolloutAgent):
    config: ProrlServiceAgentConfig

    async def run_rollout(self, request: Request) -> Response:
        return await self._relay("/run", await request.body())

    async def aggregate_metrics(self, request: Request) -> Response:
        return await self._relay("/aggregate_metrics", await request.body())

    async def status(self) -> Response:
        return await self._relay("/status", None, method="GET")

    async def register_policy(self, backends: PolicyBackends) -> None:
        answer = await self._relay("/add_llm_server", backends.model_dump_json().encode())
        if answer.status_code != 200:
            raise RuntimeError(f"{self.config.url} answered HTTP {answer.status_code}: {answer.body.decode()[:1000]}")

    async def _relay(self, path: str, body: bytes | None, method: str = "POST") -> Response:
        headers = {"content-type": "application/json"}
        if self.config.token is not None:
            headers["authorization"] = f"Bearer {self.config.token}"
        # A refused or dropped connection is tried again, at most Gym's usual number of tries, instead of forever
        # (a service that is down fails the rollout); the service's /run is safe to repeat.
        upstream: aiohttp.ClientResponse = await http_request(
            method,
            f"{str(self.config.url).rstrip('/')}{path}",
            _max_connection_retries=MAX_NUM_TRIES,
            data=body,
            headers=headers,
        )
        return Response(await upstream.read(), status_code=upstream.status, media_type=upstream.content_type)


if __name__ == "__main__":
    ProrlServiceAgent.run_webserver()
