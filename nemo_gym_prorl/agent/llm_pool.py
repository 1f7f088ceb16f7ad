"""The service's pool of OpenAI-compatible model backends (vLLM, NeMo RL's server, our local one).

A new trajectory goes to the healthy backend with the fewest requests in flight and stays there (its prefix cache
holds the conversation). Transient failures are retried with backoff on another backend; a 4xx is the request's
fault (a 401/403/404 tries the other backends first); a 500 that a second backend repeats is judged the request's
and ejects no backend. Backends that keep failing are ejected until a health probe succeeds; ``pause()`` holds new
requests for a weight sync. Each backend may carry its own model name and API key. In-flight counts are kept per
attempt, in ``finally``: ProRL's balancer never decremented its counters.

Design notes: docs/service.md#agentllm_poolpy
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import random
import re
from collections import OrderedDict
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_prorl.agent.turns import LLMRequestError, PostJSON, refusal, request_fault
from nemo_gym_prorl.contracts.progress import Generated
from nemo_gym_prorl.json_http import HttpTransportError, JsonHttp
from nemo_gym_prorl.telemetry import tracing
from nemo_gym_prorl.telemetry.stage_clock import stage_deadline_held

log = logging.getLogger(__name__)
_BACKEND_REFUSALS = frozenset({401, 403, 404})


class LLMPoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_timeout_s: float = Field(600.0, gt=0, description="read timeout of one attempt: generations are long")
    connect_timeout_s: float = Field(10.0, gt=0)
    max_retries: int = Field(3, ge=0, description="attempts after the first, for transient failures only")
    backoff_base_s: float = Field(0.5, ge=0, description="delay before the first retry; doubles each retry")
    backoff_max_s: float = Field(8.0, ge=0)
    backoff_jitter: float = Field(0.25, ge=0, le=1, description="fraction of each delay drawn at random")
    wait_for_backend_s: float = Field(300.0, ge=0, description="how long a request waits for a healthy backend")
    health_interval_s: float = Field(10.0, ge=0, description="seconds between probe rounds; 0 turns probing off")
    health_timeout_s: float = Field(5.0, gt=0)
    health_path: str = Field("/models", description="probed under the /v1 base; any answer below 500 is alive")
    failures_to_eject: int = Field(3, ge=1, description="consecutive failed requests or probes that eject a backend")
    max_connections: int = Field(1024, ge=1)
    keepalive_s: float = Field(
        4.0, gt=0, description="idle connections kept this long: under the backends' own keep-alive (vLLM's is 5 s)"
    )
    max_tracked_trajectories: int = Field(100_000, ge=1, description="affinities kept; the oldest are forgotten")


class BackendState(BaseModel):
    """One backend as the pool sees it; ``backends()`` hands out copies."""

    address: str
    model: str | None = Field(None, description="sent as the request's `model` here; None: the request's own")
    healthy: bool = True
    in_flight: int = 0
    trajectories: int = Field(0, description="trajectories routed here and not yet released or moved")
    requests: int = Field(0, description="attempts sent, retries included")
    failures: int = 0
    consecutive_failures: int = Field(0, description="failed requests or probes since the last success")
    last_error: str | None = None


class LLMUnavailable(Exception):
    """No backend could answer: none healthy within ``wait_for_backend_s``, or every retry failed."""


class _Transient(Exception):
    """An attempt failed in a way another attempt may not (a 5xx, a 429, a body that is not JSON)."""


_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?")


def _is_host(host: str) -> bool:
    """An IP address or a DNS name (underscores allowed, as container and Slurm host names have them)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        labels = host.removesuffix(".").split(".")
        return bool(host) and all(len(label) <= 63 and _HOST_LABEL.fullmatch(label) for label in labels)


def normalize_address(address: str) -> str:
    """``host:port``, ``http://host:port`` or ``http://host:port/v1/`` → ``http://host:port/v1``; anything that is
    not such an address (``not a url``, ``http://``) is a ValueError."""
    text = address.strip()
    base = (text if "://" in text else "http://" + text).rstrip("/")
    try:
        url = httpx.URL(base)
    except httpx.InvalidURL as e:
        raise ValueError(f"not a model server address: {address!r} ({e})") from e
    if url.scheme not in ("http", "https") or not _is_host(url.host) or not 0 < (url.port or 80) < 65536:
        raise ValueError(f"not an http(s) model server address (http://HOST:PORT[/v1]): {address!r}")
    return base if base.endswith("/v1") else base + "/v1"


class LLMPool:
    """``async with LLMPool(config, addresses) as pool: await pool.post(trajectory_id, "/completions", body)``."""

    def __init__(self, config: LLMPoolConfig | None = None, addresses: Iterable[str] = ()) -> None:
        self.config = config = config or LLMPoolConfig()
        self._http = JsonHttp(
            max_connections=config.max_connections,
            timeout_s=config.request_timeout_s,
            connect_timeout_s=config.connect_timeout_s,
            keepalive_s=config.keepalive_s,
        )
        self._backends: dict[str, BackendState] = {}
        self._auth: dict[str, dict[str, str]] = {}  # address -> its Authorization header (kept out of the states)
        self._affinity: OrderedDict[str, BackendState] = OrderedDict()
        self._round_robin = 0
        self._in_flight = 0
        self._waiting = 0
        self._generated = Generated()
        self._paused = False
        self._changed = asyncio.Event()  # set and replaced on every change waiters care about
        self._health_task: asyncio.Task[None] | None = None
        self._on_demand_probe: asyncio.Task[None] | None = None
        for address in addresses:
            self.add(address)

    # -- backends ---------------------------------------------------------------------------------------------------

    def add(self, address: str, model: str | None = None, api_key: str | None = None) -> str:
        """Add a backend, or give one already present this model name and key; returns its normalised ``/v1`` base.
        `model` replaces the request's model name on this backend; `api_key` is sent as a bearer token."""
        base = normalize_address(address)
        backend = self._backends.get(base)
        if backend is None:
            self._backends[base] = BackendState(address=base, model=model)
            self._notify()
        else:
            backend.model = model
        if api_key:
            self._auth[base] = {"Authorization": f"Bearer {api_key}"}
        else:
            self._auth.pop(base, None)
        return base

    def register(
        self, addresses: Iterable[str], model: str | None = None, api_key: str | None = None, replace: bool = False
    ) -> list[str]:
        """Add (or update) backends serving one model; with `replace`, every other backend is removed. All addresses
        are checked before anything changes; returns their normalised bases."""
        bases = [normalize_address(a) for a in addresses]
        if replace:
            for other in [a for a in self._backends if a not in bases]:
                self.remove(other)
        return [self.add(base, model, api_key) for base in bases]

    def remove(self, address: str) -> bool:
        """Route nothing more to it; requests already there finish, its trajectories move on their next request."""
        backend = self._backends.pop(normalize_address(address), None)
        if backend is None:
            return False
        self._auth.pop(backend.address, None)
        for trajectory_id in [t for t, b in self._affinity.items() if b is backend]:
            self.release(trajectory_id)
        return True

    def clear(self) -> None:
        for address in list(self._backends):
            self.remove(address)

    def backends(self) -> list[BackendState]:
        return [b.model_copy() for b in self._backends.values()]

    def release(self, trajectory_id: str) -> None:
        """Forget a finished trajectory's backend."""
        backend = self._affinity.pop(trajectory_id, None)
        if backend is not None:
            backend.trajectories -= 1

    @property
    def in_flight(self) -> int:
        """Requests at a server now, removed backends included."""
        return self._in_flight

    @property
    def generated(self) -> Generated:
        """A copy of the answers and completion tokens counted so far."""
        return self._generated.model_copy()

    @property
    def waiting(self) -> int:
        """Requests waiting for ``resume()`` or for a healthy backend."""
        return self._waiting

    @property
    def paused(self) -> bool:
        return self._paused

    # -- requests ---------------------------------------------------------------------------------------------------

    def poster(self, trajectory_id: str) -> PostJSON:
        """The ``PostJSON`` a rollout's turn generator uses: every call routed as this trajectory."""
        return functools.partial(self.post, trajectory_id)

    async def post(self, trajectory_id: str, path: str, json: dict[str, Any]) -> dict[str, Any]:
        """POST ``json`` to ``<backend>/v1<path>``; raises ``LLMRequestError`` when the request is at fault (a 4xx, a
        500 it caused), ``LLMUnavailable`` when no backend answers."""
        tried: set[str] = set()
        error: Exception | None = None
        refused_by: list[tuple[BackendState, LLMRequestError]] = []  # a refusal another backend may not repeat
        failed_500: list[tuple[BackendState, str]] = []  # 500s not yet told apart: the request's or the backend's?
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            backend = await self._acquire(trajectory_id, tried)
            try:
                backend.requests += 1
                body = json if backend.model is None else {**json, "model": backend.model}
                response = await self._http.post(backend.address + path, body, headers=self._auth.get(backend.address))
                if response.status == 500:
                    message = response.error_message()[:2000]
                    if (fault := request_fault(response.status, message)) is not None:
                        self._succeeded(backend)  # it said why: the request, not the server
                        raise fault
                    failed_500.append((backend, message))
                    tried.add(backend.address)
                    error = _Transient(f"HTTP 500: {message[:500]}")
                    if len({b.address for b, _ in failed_500}) >= 2:
                        raise LLMRequestError(500, self._same_500(failed_500)) from None
                    continue
                if response.status >= 500 or response.status == 429:
                    raise _Transient(f"HTTP {response.status}: {response.error_message()[:500]}")
                if response.status >= 400:
                    refused = refusal(response.status, response.error_message())
                    if response.status in _BACKEND_REFUSALS and self._untried_healthy(tried | {backend.address}):
                        refused_by.append((backend, refused))
                        tried.add(backend.address)
                        error = refused
                        continue
                    self._succeeded(backend)  # the server is fine; the request is not
                    raise refused
                try:
                    answer = response.json()
                except ValueError as e:
                    raise _Transient(f"HTTP {response.status} with a body that is not JSON") from e
                for other, message in failed_500:  # the request was fine: those 500s were the servers'
                    self._failed(other, f"HTTP 500: {message[:500]} (the same request was answered later)")
                self._succeeded(backend)
                self._generated.count(answer)
                tracing.annotate(backend=backend.address, attempts=attempt + 1)
                for other, refused in refused_by:  # this backend took what they refused: the fault was theirs
                    self._failed(other, f"{refused} (another backend answered the same request)")
                return answer
            except (HttpTransportError, _Transient) as e:
                error = e
                tried.add(backend.address)
                self._failed(backend, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                log.warning("model request to %s failed (attempt %d): %s", backend.address, attempt + 1, e)
            finally:
                backend.in_flight -= 1
                self._in_flight -= 1
                self._notify()
        if len(failed_500) == self.config.max_retries + 1:  # one backend, the same answer every time
            raise LLMRequestError(500, self._same_500(failed_500)) from None
        for other, message in failed_500:  # never told apart, and nothing answered: count them as the backends'
            self._failed(other, f"HTTP 500: {message[:500]}")
        if isinstance(error, LLMRequestError):  # every backend it reached refused it; none failed
            raise error
        raise LLMUnavailable(f"{path} failed {self.config.max_retries + 1} times; last: {error}") from error

    @staticmethod
    def _same_500(failed: list[tuple[BackendState, str]]) -> str:
        backends = sorted({b.address for b, _ in failed})
        where = f"{len(backends)} backends" if len(backends) > 1 else f"{backends[0]}, {len(failed)} times"
        return (
            f"the model server answered HTTP 500 to this request ({where}): {failed[-1][1][:500]!r}; a 500 every "
            "backend repeats is the request's (NeMo RL's server rejects sampling parameters with an assertion)"
        )

    def _untried_healthy(self, tried: set[str]) -> bool:
        return any(b.healthy and b.address not in tried for b in self._backends.values())

    async def _acquire(self, trajectory_id: str, tried: set[str]) -> BackendState:
        """Wait until not paused and a backend is healthy, then count a request in flight on it."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        self._waiting += 1
        try:
            while True:
                if self._paused:
                    deadline = None  # the wait for a backend starts when weight sync is over
                elif backend := self._route(trajectory_id, tried):
                    backend.in_flight += 1
                    self._in_flight += 1
                    return backend
                else:
                    if deadline is None:
                        deadline = loop.time() + self.config.wait_for_backend_s
                    self._probe_ejected_soon()
                changed = self._changed
                # A weight sync is queue time, not the rollout's own: its stage deadline waits too.
                held = stage_deadline_held() if self._paused else contextlib.nullcontext()
                try:
                    with held:
                        async with asyncio.timeout_at(deadline):
                            await changed.wait()
                except TimeoutError:
                    errors = {b.address: b.last_error for b in self._backends.values()}
                    raise LLMUnavailable(
                        f"no healthy model backend for {self.config.wait_for_backend_s:g} s (last errors: {errors})"
                    ) from None
        finally:
            self._waiting -= 1

    def _route(self, trajectory_id: str, tried: set[str]) -> BackendState | None:
        """The trajectory's backend while it is healthy (and has not failed this request), else the least busy one."""
        current = self._affinity.get(trajectory_id)
        if current is not None and current.healthy and current.address not in tried:
            self._affinity.move_to_end(trajectory_id)
            return current
        healthy = [b for b in self._backends.values() if b.healthy]
        candidates = [b for b in healthy if b.address not in tried] or healthy
        if not candidates:
            return None
        n, turn = len(candidates), self._round_robin
        self._round_robin += 1
        _, chosen = min(enumerate(candidates), key=lambda ib: (ib[1].in_flight, ib[1].trajectories, (ib[0] - turn) % n))
        self.release(trajectory_id)
        self._affinity[trajectory_id] = chosen
        chosen.trajectories += 1
        while len(self._affinity) > self.config.max_tracked_trajectories:
            self.release(next(iter(self._affinity)))
        return chosen

    def _backoff(self, attempt: int) -> float:
        delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (attempt - 1))
        return delay * (1 - self.config.backoff_jitter * random.random())

    # -- health -----------------------------------------------------------------------------------------------------

    def _failed(self, backend: BackendState, error: str) -> None:
        backend.failures += 1
        backend.consecutive_failures += 1
        backend.last_error = error
        if backend.healthy and backend.consecutive_failures >= self.config.failures_to_eject:
            backend.healthy = False
            log.warning("ejected model backend %s: %s", backend.address, error)

    def _succeeded(self, backend: BackendState) -> None:
        backend.consecutive_failures = 0
        if not backend.healthy:
            backend.healthy = True
            log.info("re-admitted model backend %s", backend.address)
            self._notify()

    async def check_health(self) -> None:
        """Probe every backend once (the background task calls this every ``health_interval_s``)."""
        await asyncio.gather(*(self._probe(b) for b in list(self._backends.values())))

    async def _probe(self, backend: BackendState) -> None:
        try:
            url = backend.address + self.config.health_path
            response = await self._http.get(url, timeout_s=self.config.health_timeout_s)
        except HttpTransportError as e:
            self._failed(backend, f"health probe: {type(e).__name__}: {e}")
            return
        if response.status >= 500:
            self._failed(backend, f"health probe: HTTP {response.status}")
        else:
            self._succeeded(backend)

    def _probe_ejected_soon(self) -> None:
        """Requests are waiting and every backend is ejected: probe them now instead of at the next round (there
        may be no rounds at all), at most once a second."""
        if self._on_demand_probe is None or self._on_demand_probe.done():
            self._on_demand_probe = asyncio.get_running_loop().create_task(self._probe_ejected())

    async def _probe_ejected(self) -> None:
        await asyncio.gather(*(self._probe(b) for b in list(self._backends.values()) if not b.healthy))
        await asyncio.sleep(1.0)  # a rate limit: the next on-demand round starts no sooner
        self._on_demand_probe = None
        self._notify()  # requests still waiting look again, and start the next round if none came back

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)  # a period, not a synchronisation
            await self.check_health()

    # -- weight sync ------------------------------------------------------------------------------------------------

    async def pause(self) -> None:
        """Stop new requests from starting and return once every request in flight has finished (none is aborted)."""
        self._paused = True
        self._notify()
        while self._in_flight:
            await self._changed.wait()

    def resume(self) -> None:
        self._paused = False
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- lifetime ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background health probe (``__aenter__`` does); needs a running event loop."""
        if self._health_task is None and self.config.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="llm-pool-health")

    async def aclose(self) -> None:
        for task in (self._health_task, self._on_demand_probe):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._health_task = self._on_demand_probe = None
        await self._http.aclose()

    async def __aenter__(self) -> LLMPool:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
