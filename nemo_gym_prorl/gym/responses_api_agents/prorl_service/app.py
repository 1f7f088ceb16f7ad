"""Our rollout service (`prorl serve`) as a NeMo Gym agent.

Gym reaches an agent only through a server it starts itself, so a service running elsewhere cannot simply be named
by its URL. This is that server: it relays `/run` (one whole rollout: the row in, the verify response out) and
`/aggregate_metrics` (the run's metrics) to the service at `url`, with `Authorization: Bearer <token>` when a token
is configured, and answers with the service's reply — body and status — unchanged.
"""

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import HttpUrl

from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.server_utils import MAX_NUM_TRIES
from nemo_gym.server_utils import request as http_request


class ProrlServiceAgentConfig(BaseResponsesAPIAgentConfig):
    url: HttpUrl  # the running `prorl serve`
    token: str | None = None  # the service's bearer token (service.token or $PRORL_SERVICE_TOKEN there)


class ProrlServiceAgent(SimpleResponsesAPIAgent):
    ray_enabled = False
    config: ProrlServiceAgentConfig

    def setup_webserver(self) -> FastAPI:
        app = FastAPI()
        app.post("/run")(self.run)
        app.post("/aggregate_metrics")(self.aggregate_metrics)
        app.post("/v1/responses")(self.responses)
        return app

    async def run(self, request: Request) -> Response:
        return await self._relay("/run", request)

    async def aggregate_metrics(self, request: Request) -> Response:
        return await self._relay("/aggregate_metrics", request)

    async def responses(self) -> JSONResponse:
        return JSONResponse({"detail": "the ProRL rollout service runs whole rollouts: POST /run"}, status_code=501)

    async def _relay(self, path: str, request: Request) -> Response:
        headers = {"content-type": "application/json"}
        if self.config.token is not None:
            headers["authorization"] = f"Bearer {self.config.token}"
        # A refused or dropped connection is tried again, at most Gym's usual number of tries, instead of forever
        # (a service that is down fails the rollout); the service's /run is safe to repeat.
        upstream = await http_request(
            "POST",
            f"{str(self.config.url).rstrip('/')}{path}",
            _max_connection_retries=MAX_NUM_TRIES,
            data=await request.body(),
            headers=headers,
        )
        return Response(await upstream.read(), status_code=upstream.status, media_type=upstream.content_type)


if __name__ == "__main__":
    ProrlServiceAgent.run_webserver()
