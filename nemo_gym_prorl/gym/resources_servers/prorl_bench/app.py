"""A resources server whose tool costs nothing, so a benchmark through it measures the orchestrator driving it.

The task: add numbers with the `add` tool, then give the total in ``\\boxed{}``. Each Gym session counts the `add`
calls it served (the rollout's cookie names the session); `/verify` grades the final assistant message against the
row's ``expected_answer`` and reports that count, so a caller can tell that the tools ran here. `/bench/stats`
says when the first session was seeded and the last verify finished (``time.monotonic()``, the host's clock): the
rollout phase as this server saw it, the same for every orchestrator that drives it.
"""

import re
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class ProrlBenchConfig(BaseResourcesServerConfig):
    pass


class ProrlBenchRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")  # the row: id, expected_answer, ...
    expected_answer: str


class ProrlBenchVerifyRequest(ProrlBenchRunRequest, BaseVerifyRequest):
    pass


class ProrlBenchVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    answer: str | None  # what the final assistant message put in \boxed{}
    tool_calls: int  # `add` calls this session served
    reason: str  # correct | wrong answer | no answer


class AddRequest(BaseModel):
    a: float
    b: float


class AddResponse(BaseModel):
    sum: float


class BenchStats(BaseModel):
    seeds: int = 0
    tool_calls: int = 0
    verifies: int = 0
    first_seed_at: float | None = None  # time.monotonic()
    last_verify_at: float | None = None


def final_answer(output: list[Any]) -> str | None:
    """The \\boxed{} answer of the last assistant message in a Responses output."""
    for item in reversed(output):
        if item.type == "message" and item.role == "assistant":
            text = "".join(getattr(part, "text", "") for part in item.content)
            found = _BOXED.findall(text)
            return found[-1].strip() if found else None
    return None


class ProrlBenchServer(SimpleResourcesServer):
    ray_enabled = False
    config: ProrlBenchConfig
    _tool_calls: dict[str, int] = PrivateAttr(default_factory=dict)
    _closed: set[str] = PrivateAttr(default_factory=set)  # sessions an environment server closed: never reseeded
    _stats: BenchStats = PrivateAttr(default_factory=BenchStats)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/add")(self.add)
        app.get("/bench/stats")(self.stats)
        app.post("/bench/reset")(self.reset)
        return app

    async def seed_session(
        self, request: Request, body: ResourcesSeedSessionRequest | ProrlBenchRunRequest
    ) -> ResourcesSeedSessionResponse | BaseSeedSessionResponse:
        if isinstance(body, ResourcesSeedSessionRequest):
            if body.resources_session_id in self._closed:
                raise HTTPException(409, f"session {body.resources_session_id!r} is closed; seed a new one")
            request.session[SESSION_ID_KEY] = body.resources_session_id
        self._tool_calls.setdefault(request.session[SESSION_ID_KEY], 0)
        if self._stats.first_seed_at is None:
            self._stats.first_seed_at = time.monotonic()
        self._stats.seeds += 1
        if isinstance(body, ResourcesSeedSessionRequest):
            return ResourcesSeedSessionResponse(resources_session_id=body.resources_session_id)
        return BaseSeedSessionResponse()

    async def close_resources_session(self, body: ResourcesCloseSessionRequest) -> ResourcesCloseSessionResponse:
        self._tool_calls.pop(body.resources_session_id, None)
        self._closed.add(body.resources_session_id)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def add(self, request: Request, body: AddRequest) -> AddResponse:
        session_id = request.session[SESSION_ID_KEY]
        self._tool_calls[session_id] = self._tool_calls.get(session_id, 0) + 1
        self._stats.tool_calls += 1
        return AddResponse(sum=body.a + body.b)

    async def verify(self, request: Request, body: ProrlBenchVerifyRequest) -> ProrlBenchVerifyResponse:
        answer = final_answer(body.response.output)
        correct = answer is not None and answer == body.expected_answer
        tool_calls = self._tool_calls.pop(request.session[SESSION_ID_KEY], 0)
        self._stats.verifies += 1
        self._stats.last_verify_at = time.monotonic()
        return ProrlBenchVerifyResponse(
            **body.model_dump(),
            reward=float(correct),
            answer=answer,
            tool_calls=tool_calls,
            reason="correct" if correct else ("no answer" if answer is None else "wrong answer"),
        )

    async def stats(self) -> BenchStats:
        return self._stats

    async def reset(self) -> BenchStats:
        """Start a new measurement: counters and the phase clock from zero."""
        self._stats = BenchStats()
        return self._stats


if __name__ == "__main__":
    ProrlBenchServer.run_webserver()
