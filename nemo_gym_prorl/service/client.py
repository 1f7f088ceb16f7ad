"""Clients of the rollout service, for trainers: async over HTTP, sync over HTTP, and in-process.

    async with RolloutClient("http://127.0.0.1:8100") as client:
        job_id = await client.submit(JobRequest(instance=row, sampling_params=params, n=8))
        async for sample, trajectory in client.stream(job_id):
            ...

    with SyncRolloutClient("http://127.0.0.1:8100") as client:
        view = client.wait(client.submit(JobRequest(instance=row, n=8)))
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, Self

import httpx
from pydantic import BaseModel

from nemo_gym_prorl.contracts.job import Acknowledgement, JobRequest, JobView
from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.contracts.trajectory import Trajectory

if TYPE_CHECKING:  # a trainer's import of the client loads no engine, dataset or sandbox code
    from nemo_gym_prorl.service.orchestrator import Orchestrator

# A connection that broke under a request: typically a keep-alive connection the server closed as it was reused.
_DROPPED = (httpx.NetworkError, httpx.RemoteProtocolError)


class ServiceError(Exception):
    """The service refused a request; `field` names what was wrong when it says."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.field = field


class StreamedSample(BaseModel):
    """One line of a job's result stream."""

    sample: int
    trajectory: Trajectory


class RolloutService(Protocol):
    async def submit(self, request: JobRequest) -> str: ...

    async def get(self, job_id: str, results: bool = True) -> JobView: ...

    async def cancel(self, job_id: str) -> JobView: ...

    def stream(self, job_id: str, consumer: str | None = None) -> AsyncIterator[tuple[int, Trajectory]]:
        """(sample, trajectory) as each finishes; for a named `consumer`, without what it acknowledged."""
        ...

    async def acknowledge(self, job_id: str, consumer: str, samples: list[int]) -> set[int]:
        """`consumer` took these samples: its later streams (after a restart too) skip them. All it acknowledged."""
        ...

    async def status(self) -> dict[str, Any]:
        """The service's `/status`: stages, live rollouts, jobs, model backends, what has been generated."""
        ...

    async def pause_llm(self) -> None:
        """Hold new model requests and return once none is in flight (a trainer's weight update)."""
        ...

    async def resume_llm(self, policy_version: int | None = None) -> None:
        """Let model requests go again; `policy_version`: the version of the weights now served, which every turn
        generated from here on carries (unless its server stamps its own)."""
        ...


class RolloutClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        # Streams and blocking /process calls last as long as rollouts do: no read timeout on them.
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout_s, read=None), trust_env=False
        )

    @staticmethod
    def in_process(orchestrator: Orchestrator) -> LocalRolloutClient:
        return LocalRolloutClient(orchestrator)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def _request(
        self, method: str, path: str, body: Any = None, retry: bool = False
    ) -> tuple[httpx.Response, bool]:
        """The response, and whether it answers a second attempt: with `retry` (only for requests that are safe to
        repeat), a dropped connection is retried once."""
        try:
            return await self._http.request(method, path, json=body), False
        except _DROPPED:
            if not retry:
                raise
        return await self._http.request(method, path, json=body), True

    async def _call(self, method: str, path: str, body: Any = None, retry: bool = False) -> Any:
        response, _ = await self._request(method, path, body, retry)
        _raise_for_error(response)
        return response.json()

    async def submit(self, request: JobRequest) -> str:
        """Submit a job. Only a job with a client `job_id` is resent after a dropped connection: the service
        refuses a second job with that id, so a 409 then means the first attempt was accepted."""
        body = request.model_dump(mode="json", exclude_none=True)
        response, retried = await self._request("POST", "/jobs", body, retry=request.job_id is not None)
        if retried and response.status_code == 409 and request.job_id is not None:
            return request.job_id
        _raise_for_error(response)
        return response.json()["job_id"]

    async def get(self, job_id: str, results: bool = True) -> JobView:
        """The job; with `results=False` its state and counts only (cheap to poll)."""
        path = f"/jobs/{job_id}" if results else f"/jobs/{job_id}?results=false"
        return JobView.model_validate(await self._call("GET", path, retry=True))

    async def cancel(self, job_id: str) -> JobView:
        # Cancelling a cancelled job changes nothing, so a dropped cancel is resent.
        return JobView.model_validate(await self._call("POST", f"/jobs/{job_id}/cancel", retry=True))

    async def stream(self, job_id: str, consumer: str | None = None) -> AsyncIterator[tuple[int, Trajectory]]:
        """(sample, trajectory) as each finishes. A dropped stream is reopened once (again after each new result):
        the service starts a stream with the results finished so far, and those already yielded are skipped."""
        yielded: set[int] = set()
        retried = False
        params = {"consumer": consumer} if consumer is not None else None
        while True:
            try:
                async with self._http.stream("GET", f"/jobs/{job_id}/stream", params=params) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        _raise_for_error(response)
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        item = StreamedSample.model_validate_json(line)
                        if item.sample in yielded:
                            continue
                        yielded.add(item.sample)
                        retried = False
                        yield item.sample, item.trajectory
                return
            except _DROPPED:
                if retried:
                    raise
                retried = True

    async def acknowledge(self, job_id: str, consumer: str, samples: list[int]) -> set[int]:
        # acknowledging twice changes nothing, so a dropped one is resent
        body = Acknowledgement(consumer=consumer, samples=samples).model_dump()
        return set((await self._call("POST", f"/jobs/{job_id}/ack", body, retry=True))["acknowledged"])

    async def wait(self, job_id: str) -> JobView:
        """The job once every sample has finished. The results come from the stream, so they cross the wire once."""
        streamed = dict([item async for item in self.stream(job_id)])
        view = await self.get(job_id, results=False)
        if view.finished != len(streamed):  # not expected: a finished job's stream holds all its results
            return await self.get(job_id)
        return view.model_copy(update={"results": [streamed[sample] for sample in sorted(streamed)]})

    async def process(self, instance: dict[str, Any], sampling_params: SamplingParams | None = None, task: str | None = None) -> Trajectory:
        body = {"instance": instance, "task": task, "sampling_params": (sampling_params or SamplingParams()).model_dump()}
        return Trajectory.model_validate(await self._call("POST", "/process", body))

    async def status(self) -> dict[str, Any]:
        return await self._call("GET", "/status", retry=True)

    async def add_llm_server(self, address: str) -> dict[str, Any]:
        return await self._call("POST", "/add_llm_server", {"address": address})

    async def register_llm_servers(
        self, addresses: list[str], model: str | None = None, replace: bool = False
    ) -> dict[str, Any]:
        """Model servers serving `model` (sent as each request's model name); with `replace`, the only ones."""
        return await self._call("POST", "/add_llm_server", {"addresses": addresses, "model": model, "replace": replace})

    async def clear_llm_servers(self) -> None:
        await self._call("POST", "/clear_llm_server")

    async def pause_llm(self) -> None:
        await self._call("POST", "/llm/pause")

    async def resume_llm(self, policy_version: int | None = None) -> None:
        await self._call("POST", "/llm/resume", {"policy_version": policy_version})


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        raise ServiceError(response.status_code, error["message"], error.get("field"))
    except (ValueError, KeyError, TypeError):
        raise ServiceError(response.status_code, response.text) from None


class LocalRolloutClient:
    """The same calls on an orchestrator in this process (``prorl rollout`` without ``service.url``)."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    async def submit(self, request: JobRequest) -> str:
        return self._orchestrator.submit(request)

    async def get(self, job_id: str, results: bool = True) -> JobView:
        view = self._orchestrator.view(job_id, results)
        if view is None:
            raise ServiceError(404, f"no job {job_id!r}")
        return view

    async def cancel(self, job_id: str) -> JobView:
        await self._orchestrator.cancel(job_id)
        return await self.get(job_id)

    async def stream(self, job_id: str, consumer: str | None = None) -> AsyncIterator[tuple[int, Trajectory]]:
        async for item in self._orchestrator.stream(job_id, consumer):
            yield item

    async def acknowledge(self, job_id: str, consumer: str, samples: list[int]) -> set[int]:
        return self._orchestrator.acknowledge(job_id, consumer, samples)

    async def status(self) -> dict[str, Any]:
        return self._orchestrator.status()

    async def pause_llm(self) -> None:
        await self._orchestrator.pool.pause()

    async def resume_llm(self, policy_version: int | None = None) -> None:
        self._orchestrator.pool.resume(policy_version)


class SyncRolloutClient:
    """RolloutClient for synchronous code: each call runs on a private event loop."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = RolloutClient(url, token, timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.run_until_complete(self._client.__aexit__())
        self._loop.close()

    def submit(self, request: JobRequest) -> str:
        return self._loop.run_until_complete(self._client.submit(request))

    def get(self, job_id: str, results: bool = True) -> JobView:
        return self._loop.run_until_complete(self._client.get(job_id, results))

    def cancel(self, job_id: str) -> JobView:
        return self._loop.run_until_complete(self._client.cancel(job_id))

    def wait(self, job_id: str) -> JobView:
        return self._loop.run_until_complete(self._client.wait(job_id))

    def acknowledge(self, job_id: str, consumer: str, samples: list[int]) -> set[int]:
        return self._loop.run_until_complete(self._client.acknowledge(job_id, consumer, samples))

    def stream(self, job_id: str, consumer: str | None = None) -> Iterator[tuple[int, Trajectory]]:
        items = self._client.stream(job_id, consumer)
        while True:
            try:
                yield self._loop.run_until_complete(anext(items))
            except StopAsyncIteration:
                return

    def process(self, instance: dict[str, Any], sampling_params: SamplingParams | None = None, task: str | None = None) -> Trajectory:
        return self._loop.run_until_complete(self._client.process(instance, sampling_params, task))

    def status(self) -> dict[str, Any]:
        return self._loop.run_until_complete(self._client.status())
