"""Where a rollout's time went: timed spans on the trajectory, and OpenTelemetry traces when a collector is set.

Every rollout records its stages (``init``, ``run``, ``eval``) and, inside ``run``, each model request and tool call
as a ``TimedSpan`` in ``trajectory.timing.spans`` — always, so a viewer shows them without any collector. When
tracing is on (``tracing.otlp_endpoint`` in the service's config, or ``traced_by(provider)``), the same spans, with
the same times and attributes, also go out as OpenTelemetry spans: a ``rollout`` span per rollout, its stages as
children and the calls under ``run``, exported over OTLP/HTTP. Off (the default), no OpenTelemetry object is made.

The pipeline gives each rollout a ``RolloutTrace`` and runs every stage inside ``RolloutTrace.stage``; code running
inside a stage (the agent loop, the LLM pool) opens ``span("model")`` / ``span("tool")`` and adds attributes with
``annotate``: both find the rollout through a context variable, and do nothing outside a rollout. A run stage done
in another process (a Ray rollout worker) records its calls there in a ``DetachedRun``; the rollout's side then
``graft``s them under its own run stage.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_gym_prorl.contracts.trajectory import TimedSpan, Trajectory

TRACER_NAME = "nemo_gym_prorl"
OTLP_TRACES_PATH = "/v1/traces"


class TracingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    otlp_endpoint: str | None = Field(
        None,
        description="an OTLP/HTTP collector (http://host:4318, or its full traces URL); null: nothing is exported",
    )
    service_name: str = Field("prorl", description="the traces' service.name")
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every export (a collector's key)")
    shutdown_timeout_s: float = Field(
        5.0, gt=0, description="on stop, how long spans still buffered may take to reach the collector; what it has "
        "not taken by then is dropped, and one log line says how many",
    )  # fmt: skip

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError("expected an http(s)://host:port URL (OTLP over HTTP)")
        return url or None

    def traces_url(self) -> str | None:
        """The traces URL: a bare collector address gets OTLP's ``/v1/traces`` path, as OTel's own variable does."""
        if self.otlp_endpoint is None:
            return None
        if urlsplit(self.otlp_endpoint).path in ("", "/"):
            return self.otlp_endpoint.rstrip("/") + OTLP_TRACES_PATH
        return self.otlp_endpoint


_tracer: Any = None  # an OpenTelemetry Tracer while tracing is on; None: nothing is traced


@contextlib.contextmanager
def traced_by(provider: Any) -> Iterator[None]:
    """Rollouts started inside the block are traced by `provider` (an OpenTelemetry ``TracerProvider``)."""
    global _tracer
    saved, _tracer = _tracer, provider.get_tracer(TRACER_NAME)
    try:
        yield
    finally:
        _tracer = saved


@contextlib.asynccontextmanager
async def exporting(config: TracingConfig) -> AsyncIterator[None]:
    """Export rollouts' traces over OTLP/HTTP while the block runs, when `config` names a collector; on the way out
    what is still buffered is sent, off the event loop and for at most ``shutdown_timeout_s`` (``otlp_export``).
    Without an endpoint: nothing at all."""
    url = config.traces_url()
    if url is None:
        yield
        return
    from nemo_gym_prorl.telemetry.otlp_export import OtlpExport

    export = OtlpExport(url, config.service_name, config.headers, config.shutdown_timeout_s)
    try:
        with traced_by(export.provider):
            yield
    finally:
        await export.stop()


# One clock for the whole process: perf_counter for durations, mapped once onto the epoch for OpenTelemetry, so a
# span's OpenTelemetry times and its TimedSpan are the same numbers.
_PERF_ORIGIN = time.perf_counter()
_EPOCH_ORIGIN_NS = time.time_ns()


def _epoch_ns(perf: float) -> int:
    return _EPOCH_ORIGIN_NS + round((perf - _PERF_ORIGIN) * 1e9)


def _otel_value(value: Any) -> Any:
    """OpenTelemetry takes str, bool, int, float (or lists of one of them); anything else goes as its text."""
    return value if isinstance(value, (str, bool, int, float)) else str(value)


def _start_otel_span(name: str, parent: Any, attributes: dict[str, Any], start: float) -> Any:
    """An OpenTelemetry span under `parent`, begun at `start` (perf_counter seconds)."""
    from opentelemetry import trace as otel_trace

    assert _tracer is not None
    return _tracer.start_span(
        name,
        context=otel_trace.set_span_in_context(parent),
        attributes={k: _otel_value(v) for k, v in attributes.items()},
        start_time=_epoch_ns(start),
    )


class ActiveSpan:
    """A span being timed (``with``/``async with``); `set` adds attributes. Ends with the block, recording a
    ``TimedSpan`` on the trajectory and ending its OpenTelemetry span, if any."""

    def __init__(self, trace: RolloutTrace, name: str, parent: Any, attributes: dict[str, Any]) -> None:
        self.trace = trace
        self.name = name
        self.attributes = {k: v for k, v in attributes.items() if v is not None}
        self.start = 0.0
        self.duration_s = 0.0
        self._parent = parent  # the parent's OpenTelemetry span, or None
        self._otel: Any = None
        self._token: Token[ActiveSpan | None] | None = None

    def set(self, **attributes: Any) -> None:
        known = {k: v for k, v in attributes.items() if v is not None}
        self.attributes.update(known)
        if self._otel is not None:
            self._otel.set_attributes({k: _otel_value(v) for k, v in known.items()})

    def __enter__(self) -> ActiveSpan:
        self.start = time.perf_counter()
        if _tracer is not None and self._parent is not None:
            self._otel = _start_otel_span(self.name, self._parent, self.attributes, self.start)
        self._token = _current.set(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        end = time.perf_counter()
        self.duration_s = end - self.start
        if self._token is not None:
            _current.reset(self._token)
        if exc is not None:
            self.attributes["error"] = type(exc).__name__
        self.trace.timing_spans().append(
            TimedSpan(
                name=self.name,
                start_s=self.start - self.trace.submitted,
                duration_s=self.duration_s,
                attributes=self.attributes,
            )
        )
        if self._otel is not None:
            if exc is not None:
                from opentelemetry.trace import Status, StatusCode

                self._otel.set_attribute("error", type(exc).__name__)
                self._otel.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            self._otel.end(end_time=_epoch_ns(end))

    async def __aenter__(self) -> ActiveSpan:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)


class _NoSpan:
    """What `span` gives outside a rollout: the same interface, recording nothing."""

    def set(self, **attributes: Any) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    async def __aenter__(self) -> _NoSpan:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


_NO_SPAN = _NoSpan()
_current: ContextVar[ActiveSpan | None] = ContextVar("current_rollout_span", default=None)


class RolloutTrace:
    """One rollout's clock (from its submission) and, when tracing is on, its ``rollout`` OpenTelemetry span."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.submitted = time.perf_counter()
        self._otel: Any = None

    def timing_spans(self) -> list[TimedSpan]:
        return self.trajectory.timing.spans

    def start(self) -> None:
        """The rollout is handed to the pipeline now: spans count from here, and its trace begins."""
        self.submitted = time.perf_counter()
        if _tracer is not None and self._otel is None:
            t = self.trajectory
            attributes = {"instance_id": t.instance_id, "trajectory_id": t.trajectory_id}
            self._otel = _tracer.start_span("rollout", attributes=attributes, start_time=_epoch_ns(self.submitted))

    def stage(self, name: str) -> ActiveSpan:
        """The span of one stage; what runs inside it (its task and the tasks it starts) records under it."""
        return ActiveSpan(self, name, self._otel, {})

    def end(self) -> None:
        """The rollout is over: its outcome goes on its trace, which ends."""
        if self._otel is None:
            return
        t = self.trajectory
        outcome = {
            "reward": t.reward,
            "resolved": t.resolved,
            "finish": t.finish,
            "critical_error": t.critical_error,
            "queued_s": t.timing.queued,
        }
        self._otel.set_attributes({k: _otel_value(v) for k, v in outcome.items() if v is not None})
        if t.critical_error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._otel.set_status(Status(StatusCode.ERROR, f"{t.critical_error}: {t.error}"))
        self._otel.end(end_time=_epoch_ns(time.perf_counter()))
        self._otel = None


def span(name: str, **attributes: Any) -> ActiveSpan | _NoSpan:
    """A child of the span running now (a stage, or a call inside one); outside a rollout, a span that records
    nothing. Attributes that are None are left out."""
    parent = _current.get()
    if parent is None:
        return _NO_SPAN
    return ActiveSpan(parent.trace, name, parent._otel, attributes)


def annotate(**attributes: Any) -> None:
    """Add attributes to the span running now (the LLM pool names the backend that answered); else nothing."""
    current = _current.get()
    if current is not None:
        current.set(**attributes)


class DetachedRun:
    """The spans of a run stage that runs away from its rollout's trace (a Ray worker's run): inside `recording`,
    ``span`` / ``annotate`` record as they would in the rollout, and after it `spans` holds the calls, each timed
    from the run's start (clocks differ between processes, offsets do not), and `attributes` what was said of the
    run itself. Plain data, for the rollout's side to `graft`."""

    def __init__(self) -> None:
        self.spans: list[TimedSpan] = []
        self.attributes: dict[str, Any] = {}
        self.submitted = 0.0  # the run's start: what the spans' start_s count from

    def timing_spans(self) -> list[TimedSpan]:
        return self.spans

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        run = ActiveSpan(self, "run", None, {})  # type: ignore[arg-type]  # a trace as far as spans go
        try:
            with run:
                self.submitted = run.start
                yield
        finally:
            self.spans.pop()  # the run's own span: the rollout's run stage is it
            self.attributes = run.attributes


def graft(spans: list[TimedSpan], run_attributes: dict[str, Any]) -> None:
    """Add what a `DetachedRun` recorded to the span running now (the rollout's run stage): its attributes on it, the
    calls under it, timed from its start; as OpenTelemetry spans too when it has one. Outside a rollout, nothing."""
    current = _current.get()
    if current is None:
        return
    current.set(**run_attributes)
    trace = current.trace
    for recorded in spans:
        start = current.start + recorded.start_s
        trace.timing_spans().append(recorded.model_copy(update={"start_s": start - trace.submitted}))
        if _tracer is not None and current._otel is not None:
            otel = _start_otel_span(recorded.name, current._otel, recorded.attributes, start)
            if "error" in recorded.attributes:
                from opentelemetry.trace import Status, StatusCode

                otel.set_status(Status(StatusCode.ERROR, str(recorded.attributes["error"])))
            otel.end(end_time=_epoch_ns(start + recorded.duration_s))


_sandbox_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_sandbox_numbers = itertools.count(1)


def sandbox_id(sandbox: Any) -> str | None:
    """A name for a sandbox in traces: an Apptainer instance's own name, else one given here, unique across the
    service's processes and nodes (``bwrap-nodeA-4242-7``: host, pid, number), as Ray workers each number theirs."""
    if sandbox is None:
        return None
    name = getattr(sandbox, "name", None)
    if isinstance(name, str):
        return name
    try:
        known = _sandbox_ids.get(sandbox)
        if known is None:
            known = _sandbox_ids[sandbox] = f"{_backend_name(sandbox)}-{socket.gethostname()}-{os.getpid()}-{next(_sandbox_numbers)}"
        return known
    except TypeError:  # not weakly referenceable
        return f"{_backend_name(sandbox)}-{id(sandbox):x}"


def _backend_name(sandbox: Any) -> str:
    return type(sandbox).__name__.removesuffix("Sandbox").lower() or "sandbox"
