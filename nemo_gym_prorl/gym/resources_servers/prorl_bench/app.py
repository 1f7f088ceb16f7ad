"""A resources server whose tool costs nothing, so a benchmark through it measures the orchestrator driving it.

The task: add numbers with the `add` tool, then give the total in ``\\boxed{}``. `/verify` grades the final
assistant message against the row's ``expected_answer`` and reports how many `add` calls the rollout's session
made, so a caller can tell that the tools ran here. `/bench/stats` says when the first session was seeded and the
last verify finished (``time.monotonic()``, the host's clock): the rollout phase as this server saw it, the same for
every orchestrator that drives it.

It keeps no state in memory, so it runs under Gym's ``num_workers`` (uvicorn worker processes) like any other
server: a session's count lives in its signed session cookie, and the counters behind `/bench/stats` in an event
log every worker appends to (see `EventLog`). One worker would cap a benchmark at one core's worth of requests.
"""

import atexit
import os
import re
import struct
import tempfile
import time
from enum import IntEnum
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
)
from nemo_gym.server_utils import is_nemo_gym_fastapi_entrypoint
from pydantic import BaseModel, ConfigDict, PrivateAttr

from nemo_gym_prorl.gym.row_session_server import RowSessionServer, RowVerifyRequest

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
ADD_CALLS_KEY = "prorl_bench_add_calls"  # in the session cookie
EVENT_LOG_ENV = "PRORL_BENCH_EVENT_LOG"  # the main process's log, handed to the uvicorn workers it spawns


class ProrlBenchConfig(BaseResourcesServerConfig):
    pass


class ProrlBenchVerifyRequest(RowVerifyRequest):
    expected_answer: str


class ProrlBenchVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    answer: str | None  # what the final assistant message put in \boxed{}
    tool_calls: int  # `add` calls this session made
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


class Event(IntEnum):
    SEED = 1
    TOOL_CALL = 2
    VERIFY = 3


class EventLog:
    """Fixed-size records (event, monotonic time) appended to one file by every worker process.

    An O_APPEND write of 16 bytes to a local file is atomic, so workers need no lock, and any worker can total the
    log for `/bench/stats`. `reset` truncates it: a new measurement.
    """

    RECORD = struct.Struct("<B7xd")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def append(self, event: Event) -> None:
        os.write(self._fd, self.RECORD.pack(event, time.monotonic()))

    def stats(self) -> BenchStats:
        data = self.path.read_bytes()
        data = data[: len(data) - len(data) % self.RECORD.size]  # a record being written right now: not yet
        times: dict[int, list[float]] = {event: [] for event in Event}
        for event, at in self.RECORD.iter_unpack(data):
            times[event].append(at)
        seeds, verifies = times[Event.SEED], times[Event.VERIFY]
        return BenchStats(
            seeds=len(seeds), tool_calls=len(times[Event.TOOL_CALL]), verifies=len(verifies),
            first_seed_at=min(seeds, default=None), last_verify_at=max(verifies, default=None),
        )  # fmt: skip

    def reset(self) -> None:
        os.truncate(self.path, 0)


def _shared_event_log() -> EventLog:
    """The process that starts first makes the log (removed when it exits); its uvicorn workers inherit the path."""
    if path := os.environ.get(EVENT_LOG_ENV):
        return EventLog(Path(path))
    fd, path = tempfile.mkstemp(prefix="prorl-bench-", suffix=".events")
    os.close(fd)
    os.environ[EVENT_LOG_ENV] = path
    atexit.register(Path(path).unlink, missing_ok=True)
    return EventLog(Path(path))


def final_answer(output: list[Any]) -> str | None:
    """The \\boxed{} answer of the last assistant message in a Responses output."""
    for item in reversed(output):
        if item.type == "message" and item.role == "assistant":
            text = "".join(getattr(part, "text", "") for part in item.content)
            found = _BOXED.findall(text)
            return found[-1].strip() if found else None
    return None


class ProrlBenchServer(RowSessionServer):
    config: ProrlBenchConfig
    _events: EventLog = PrivateAttr(default_factory=_shared_event_log)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/add")(self.add)
        app.get("/bench/stats")(self.stats)
        app.post("/bench/reset")(self.reset)
        return app

    async def seed_row(self, request: Request, row: dict[str, Any]) -> None:
        request.session[ADD_CALLS_KEY] = 0
        self._events.append(Event.SEED)

    async def close_resources_session(self, body: ResourcesCloseSessionRequest) -> ResourcesCloseSessionResponse:
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)  # nothing kept here

    async def add(self, request: Request, body: AddRequest) -> AddResponse:
        request.session[ADD_CALLS_KEY] = request.session.get(ADD_CALLS_KEY, 0) + 1
        self._events.append(Event.TOOL_CALL)
        return AddResponse(sum=body.a + body.b)

    async def verify(self, request: Request, body: ProrlBenchVerifyRequest) -> ProrlBenchVerifyResponse:
        answer = final_answer(body.response.output)
        correct = answer is not None and answer == body.expected_answer
        self._events.append(Event.VERIFY)
        return ProrlBenchVerifyResponse(
            **body.model_dump(),
            reward=float(correct),
            answer=answer,
            tool_calls=request.session.get(ADD_CALLS_KEY, 0),
            reason="correct" if correct else ("no answer" if answer is None else "wrong answer"),
        )

    async def stats(self) -> BenchStats:
        return self._events.stats()

    async def reset(self) -> BenchStats:
        """Start a new measurement: counters and the phase clock from zero."""
        self._events.reset()
        return BenchStats()


if __name__ == "__main__":
    ProrlBenchServer.run_webserver()
elif is_nemo_gym_fastapi_entrypoint(__file__):  # a uvicorn worker under num_workers
    app = ProrlBenchServer.run_webserver()  # noqa: F401
