"""RolloutClient over connections that drop: the real service app, served by uvicorn, behind an ASGI layer that has
uvicorn close a chosen request's connection mid-response (as a server dropping a keep-alive connection, or a proxy
cutting one, leaves the client).

Reads (a job, the results stream) are retried once; a job submit only when it carries a client job_id, and then a
409 for that id means the dropped attempt was accepted. The model is the deterministic stand-in server; the
rollouts run in real bubblewrap sandboxes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from standin_helpers import ROW, SCRIPT, running_standin

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.launch.runtime import (
    ModelConfig,
    ServiceConfig,
    ServiceRuntime,
    ServiceSettings,
)
from nemo_gym_prorl.service.app import create_app
from nemo_gym_prorl.service.client import RolloutClient, ServiceError
from nemo_gym_prorl.service.orchestrator import Orchestrator

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ConnectionDropped(Exception):
    """Raised after a response has started: uvicorn then closes the connection instead of finishing it."""


class Dropper:
    """ASGI layer over the service app. Each armed (method, path) request runs through the app as usual, but its
    connection is closed once the response head and `keep` body chunks (stream lines) have gone out."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.armed: list[tuple[str, str, int]] = []
        self.dropped = 0

    def drop_next(self, method: str, path: str, keep: int = 0) -> None:
        self.armed.append((method, path, keep))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = (scope.get("method"), scope.get("path"))
        rule = next((r for r in self.armed if r[:2] == request), None)
        if rule is None:
            await self.app(scope, receive, send)
            return
        self.armed.remove(rule)
        keep = rule[2]

        async def cutting(message: Message) -> None:
            nonlocal keep
            if message["type"] == "http.response.body":
                if keep == 0:
                    self.dropped += 1
                    raise ConnectionDropped
                keep -= 1
            await send(message)

        await self.app(scope, receive, cutting)


@dataclass
class Service:
    url: str
    orchestrator: Orchestrator
    dropper: Dropper

    def jobs(self) -> int:
        return sum(self.orchestrator.store.counts().values())


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    yield from running_standin(SCRIPT)


@pytest.fixture
async def service(model_url: str, tmp_path: Path) -> AsyncIterator[Service]:
    model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin", tool_call_format="codeact")
    config = ServiceConfig(service=ServiceSettings(port=0, store=tmp_path / "service.db"), model=model)
    sock = socket.create_server(("127.0.0.1", 0))  # listening now: requests queue until uvicorn serves them
    async with ServiceRuntime(config) as runtime:
        assert runtime.orchestrator is not None
        dropper = Dropper(create_app(runtime.orchestrator))
        # The drops are exceptions uvicorn logs with a traceback; they are the point here, not news.
        server = uvicorn.Server(uvicorn.Config(dropper, log_level="critical", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            yield Service(f"http://127.0.0.1:{sock.getsockname()[1]}", runtime.orchestrator, dropper)
        finally:
            server.should_exit = True
            await serving


async def test_a_dropped_job_read_is_retried_once(service: Service) -> None:
    async with RolloutClient(service.url) as client:
        job_id = await client.submit(JobRequest(instance=ROW))
        service.dropper.drop_next("GET", f"/jobs/{job_id}")

        view = await client.get(job_id)

        assert (view.job_id, service.dropper.dropped) == (job_id, 1)
        service.dropper.drop_next("GET", f"/jobs/{job_id}")
        service.dropper.drop_next("GET", f"/jobs/{job_id}")
        with pytest.raises(httpx.RemoteProtocolError):  # once: a connection that drops again is an error
            await client.get(job_id)
        assert service.dropper.dropped == 3


async def test_a_dropped_results_stream_resumes_without_repeating_a_result(service: Service) -> None:
    async with RolloutClient(service.url) as client:
        job_id = await client.submit(JobRequest(instance=ROW, n=2))
        service.dropper.drop_next("GET", f"/jobs/{job_id}/stream", keep=1)  # cut after the first result's line

        results = [(sample, trajectory) async for sample, trajectory in client.stream(job_id)]

        # The reopened stream started again with the result already had, and the client passed it over.
        assert sorted(sample for sample, _ in results) == [0, 1] and service.dropper.dropped == 1
        assert [(t.critical_error, t.reward) for _, t in results] == [(None, 1.0)] * 2


async def test_a_submit_with_a_job_id_is_resent_and_its_409_means_the_dropped_attempt_was_accepted(
    service: Service,
) -> None:
    async with RolloutClient(service.url) as client:
        service.dropper.drop_next("POST", "/jobs")

        assert await client.submit(JobRequest(instance=ROW, job_id="trainer-step-7")) == "trainer-step-7"

        assert (service.dropper.dropped, service.jobs()) == (1, 1)
        assert (await client.wait("trainer-step-7")).results[0].reward == 1.0
        with pytest.raises(ServiceError) as refused:  # without a drop, a second job with that id is refused
            await client.submit(JobRequest(instance=ROW, job_id="trainer-step-7"))
        assert (refused.value.status, refused.value.field) == (409, "job_id")


async def test_a_submit_without_a_job_id_is_never_resent(service: Service) -> None:
    async with RolloutClient(service.url) as client:
        service.dropper.drop_next("POST", "/jobs")

        with pytest.raises(httpx.RemoteProtocolError):
            await client.submit(JobRequest(instance=ROW))

        assert (service.dropper.dropped, service.jobs()) == (1, 1)  # the dropped attempt's job, and no second one
