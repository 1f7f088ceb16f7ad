"""The rollout service's HTTP API.

- ProRL Agent-compatible: ``POST /process`` (blocking, one trajectory), ``/start``, ``/stop``, ``GET /status``,
  ``/add_llm_server``, ``/clear_llm_server``, ``/cancel``. ``/stop`` pauses the pipeline (queued work waits, work in
  a stage goes on) instead of tearing the server down every training step; ``/start`` resumes it.
- Non-blocking jobs: ``POST /jobs`` → id; ``GET /jobs/{id}``; ``POST /jobs/{id}/cancel``; ``GET /jobs/{id}/stream``
  (NDJSON, one line per sample as it finishes; ``?consumer=NAME`` skips what that consumer acknowledged with
  ``POST /jobs/{id}/ack``, so a restarted trainer gets each result once).
- ``POST /llm/pause`` / ``/llm/resume`` (with the new ``policy_version``) for weight sync; ``GET /metrics``
  (Prometheus); the OpenAPI document.
- ``/ui/``: the rollout viewer over the stored results, with live plots of the pipeline (``viewer/``).
- NeMo Gym's agent ``POST /run`` and ``/aggregate_metrics`` live in ``gym_agent.py``.

Bad input is a 4xx whose message names the field; an accepted job is durable before its id is returned.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nemo_gym_prorl.contracts.job import Acknowledgement, JobRequest, JobView
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.service.metrics import ServiceMetrics
from nemo_gym_prorl.service.orchestrator import JobConflict, Orchestrator, RejectedJob


class ProcessRequest(JobRequest):
    """ProRL's ``/process`` body (``instance``, ``sampling_params``, ``job_id``): one sample, answered when done."""

    n: Literal[1] = 1


class AddLLMServerRequest(BaseModel):
    """ProRL's body (``address``), plus: several at once, the model name they serve (sent as each request's
    ``model`` there), their API key, and whether they replace every other backend (a trainer's policy servers)."""

    model_config = ConfigDict(extra="forbid")
    address: str | None = None
    addresses: list[str] = Field(default_factory=list)
    model: str | None = Field(None, description="the name these backends serve; default: the service's model name")
    api_key: str | None = Field(None, description="sent to these backends as a bearer token")
    replace: bool = Field(False, description="remove every other backend first")

    @model_validator(mode="after")
    def _some_address(self) -> AddLLMServerRequest:
        if self.address is None and not self.addresses:
            raise ValueError("give `address` or `addresses`")
        return self

    def all_addresses(self) -> list[str]:
        return ([self.address] if self.address is not None else []) + self.addresses


class JobIdRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: str


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int | None = Field(
        None, description="the version of the weights served from now on: every turn generated after it carries it"
    )


class Accepted(BaseModel):
    job_id: str


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field, "code": status}}, status_code=status)


def bearer_guard(token: str | None) -> Any:
    """A route dependency: with a token set, requests must carry ``Authorization: Bearer <token>``."""

    async def authorized(request: Request) -> None:
        if token is None:
            return
        supplied = request.headers.get("authorization", "")
        if not secrets.compare_digest(supplied.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong bearer token")

    return Depends(authorized)


def create_app(orchestrator: Orchestrator, token: str | None = None, max_body_bytes: int = 8 << 20) -> FastAPI:
    """The app over a running orchestrator; with `token`, every route but /health wants ``Bearer <token>``."""
    app = FastAPI(title="nemo-gym-prorl rollout service", version="1")
    metrics = ServiceMetrics(orchestrator)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next: Any) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return _error(413, f"request body larger than {max_body_bytes} bytes")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # not a request to check field by field: a body that is no JSON
            offset = first["loc"][1] if len(first["loc"]) > 1 else 0
            return _error(400, f"malformed JSON body at byte {offset}: {first.get('ctx', {}).get('error', first['msg'])}")
        field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return _error(422, f"{field}: {first['msg']}", field)

    @app.exception_handler(ValidationError)
    async def _invalid_model(_: Request, exc: ValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        return _error(422, f"{field}: {first['msg']}", field)

    @app.exception_handler(RejectedJob)
    async def _rejected(_: Request, exc: RejectedJob) -> JSONResponse:
        return _error(422, str(exc), exc.field)

    @app.exception_handler(JobConflict)
    async def _conflict(_: Request, exc: JobConflict) -> JSONResponse:
        return _error(409, f"job_id {exc.args[0]!r} exists already", "job_id")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    guarded = [bearer_guard(token)]

    # -- ProRL-compatible --------------------------------------------------------------------------------------

    @app.post("/process", dependencies=guarded)
    async def process(body: ProcessRequest) -> Trajectory:
        view = await orchestrator.wait(orchestrator.submit(body))
        return view.results[0]

    @app.post("/start", dependencies=guarded)
    async def start() -> dict[str, Any]:
        orchestrator.pipeline.resume()
        return orchestrator.status()

    @app.post("/stop", dependencies=guarded)
    async def stop() -> dict[str, Any]:
        orchestrator.pipeline.pause()
        return orchestrator.status()

    @app.get("/status", dependencies=guarded)
    async def status() -> dict[str, Any]:
        return orchestrator.status()

    @app.post("/add_llm_server", dependencies=guarded)
    async def add_llm_server(body: AddLLMServerRequest) -> dict[str, Any]:
        try:
            added = orchestrator.pool.register(body.all_addresses(), body.model, body.api_key, body.replace)
        except ValueError as e:
            raise RejectedJob("address" if body.address is not None else "addresses", str(e)) from None
        backends = [b.model_dump() for b in orchestrator.pool.backends()]
        return {"address": added[0], "addresses": added, "backends": backends}

    @app.post("/clear_llm_server", dependencies=guarded)
    async def clear_llm_server() -> dict[str, Any]:
        orchestrator.pool.clear()
        return {"backends": []}

    @app.post("/cancel", dependencies=guarded)
    async def cancel(body: JobIdRequest) -> dict[str, Any]:
        if not await orchestrator.cancel(body.job_id):
            raise HTTPException(404, f"no job {body.job_id!r}")
        return {"job_id": body.job_id, "cancelled": True}

    # -- non-blocking jobs ---------------------------------------------------------------------------------------

    @app.post("/jobs", status_code=202, dependencies=guarded)
    async def submit(body: JobRequest) -> Accepted:
        return Accepted(job_id=orchestrator.submit(body))

    @app.get("/jobs/{job_id}", dependencies=guarded)
    async def get_job(
        job_id: str, results: Annotated[bool, Query(description="false: state and counts only, for polling")] = True
    ) -> JobView:
        view = orchestrator.view(job_id, results)
        if view is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return view

    @app.post("/jobs/{job_id}/cancel", dependencies=guarded)
    async def cancel_job(job_id: str) -> JobView:
        if not await orchestrator.cancel(job_id):
            raise HTTPException(404, f"no job {job_id!r}")
        view = orchestrator.view(job_id)
        assert view is not None
        return view

    @app.get("/jobs/{job_id}/stream", dependencies=guarded)
    async def stream_job(
        job_id: str,
        consumer: Annotated[str | None, Query(description="skip the samples this consumer acknowledged")] = None,
    ) -> StreamingResponse:
        if orchestrator.view(job_id, results=False) is None:
            raise HTTPException(404, f"no job {job_id!r}")

        async def lines() -> AsyncIterator[bytes]:
            async for sample, trajectory in orchestrator.stream_json(job_id, consumer):
                yield f'{{"sample": {sample}, "trajectory": {trajectory}}}\n'.encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/jobs/{job_id}/ack", dependencies=guarded)
    async def acknowledge(job_id: str, body: Acknowledgement) -> dict[str, Any]:
        try:
            acknowledged = orchestrator.acknowledge(job_id, body.consumer, body.samples)
        except KeyError:
            raise HTTPException(404, f"no job {job_id!r}") from None
        return {"job_id": job_id, "consumer": body.consumer, "acknowledged": sorted(acknowledged)}

    # -- weight sync and metrics ---------------------------------------------------------------------------------

    @app.post("/llm/pause", dependencies=guarded)
    async def pause_llm() -> dict[str, Any]:
        await orchestrator.pool.pause()
        return {"paused": True, "in_flight": orchestrator.pool.in_flight}

    @app.post("/llm/resume", dependencies=guarded)
    async def resume_llm(body: ResumeRequest | None = None) -> dict[str, Any]:
        version = body.policy_version if body is not None else None
        orchestrator.pool.resume(version)
        return {"paused": False, "policy_version": orchestrator.pool.policy_version}

    @app.get("/metrics", dependencies=guarded)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
