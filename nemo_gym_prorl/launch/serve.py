"""`prorl serve`: the rollout service on uvicorn, until SIGINT/SIGTERM; then every sandbox is closed, and the last
line says what the job store kept for the next start."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import uvicorn

from nemo_gym_prorl.gym.agent_routes import add_gym_agent_routes
from nemo_gym_prorl.launch.runtime import TOKEN_ENV, ServiceConfig, ServiceRuntime
from nemo_gym_prorl.service.app import create_app, is_loopback
from nemo_gym_prorl.service.gc_tuning import tuned_gc
from nemo_gym_prorl.service.orchestrator import Orchestrator
from nemo_gym_prorl.service.store import JobStore
from nemo_gym_prorl.viewer.service_ui import service_viewer


class InsecureBindError(ValueError):
    """Refusing to listen beyond loopback without a bearer token."""


@dataclass
class RunningService:
    url: str
    port: int
    orchestrator: Orchestrator
    server: uvicorn.Server
    serving: asyncio.Task[None]


@asynccontextmanager
async def run_service(config: ServiceConfig) -> AsyncIterator[RunningService]:
    """The service listening (requests queue from the moment this yields) until the block exits or uvicorn is
    told to stop; then the runtime closes every sandbox, the model and the pool."""
    token = config.bearer_token()
    if token is None and not is_loopback(config.service.host):
        raise InsecureBindError(
            f"binding {config.service.host} (not loopback) needs a bearer token: set service.token or ${TOKEN_ENV}"
        )
    sock = socket.create_server((config.service.host, config.service.port))
    port = sock.getsockname()[1]
    async with ServiceRuntime(config) as runtime:
        assert runtime.orchestrator is not None
        app = create_app(runtime.orchestrator, token, config.service.max_body_bytes)
        add_gym_agent_routes(app, runtime.orchestrator, token)
        app.mount("/ui", service_viewer(runtime.orchestrator, token))  # the rollout viewer, behind the same token
        server = uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", lifespan="off", timeout_graceful_shutdown=config.service.shutdown_grace_s
            )
        )
        with _stop_signals_end_serving_only():
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            try:
                with tuned_gc(config.service.gc):
                    yield RunningService(
                        f"http://{config.service.host}:{port}", port, runtime.orchestrator, server, serving
                    )
            finally:
                server.should_exit = True
                await serving


@contextmanager
def _stop_signals_end_serving_only() -> Iterator[None]:
    """SIGINT and SIGTERM stop uvicorn, and then the runtime closes every sandbox, the model and the pool.

    uvicorn stops serving on either signal and then raises it again for the handler that was there before it: the
    default SIGTERM would kill the process right there, before the runtime closes anything (and the handler
    `ray.init` installs exits in the middle of it). While the service runs, that earlier handler is one that does
    nothing. Signals can only be handled on the main thread; elsewhere (a service inside a test) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _stop_requested) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stop_requested(signum: int, frame: object) -> None:
    """uvicorn has stopped serving by now; the service's own shutdown follows."""


def kept_line(config: ServiceConfig, store: JobStore) -> str:
    """What a stopped service leaves for the next start, as its last line."""
    counts, unfinished = store.counts(), len(store.unfinished_jobs())
    total = sum(counts.values())
    jobs = f"{total} job{'' if total == 1 else 's'} ({counts.get('done', 0)} done, {unfinished} unfinished)"
    if str(config.service.store) == ":memory:":
        return f"prorl serve: stopped; {jobs} were in memory (service.store=:memory:), none kept"
    again = {"requeue": "run their missing samples", "fail": "fail them"}[config.service.recovery]
    return (f"prorl serve: stopped; {config.service.store} keeps {jobs}; the next start will {again} "
            f"(service.recovery={config.service.recovery})")  # fmt: skip


async def serve_async(
    config: ServiceConfig, on_ready: Callable[[int], None] | None = None, on_stop: Callable[[str], None] | None = None
) -> None:
    async with run_service(config) as service:
        if on_ready is not None:
            on_ready(service.port)
        await service.serving
        if on_stop is not None:  # counted before the runtime closes the store
            on_stop(kept_line(config, service.orchestrator.store))


def serve(config: ServiceConfig) -> None:
    def announce(port: int) -> None:
        tasks = ", ".join(config.service.tasks)
        print(f"prorl serve: listening on http://{config.service.host}:{port} (tasks: {tasks})", flush=True)

    asyncio.run(serve_async(config, announce, lambda line: print(line, flush=True)))
