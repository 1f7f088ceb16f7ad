"""Traces of real rollouts (real bubblewrap sandboxes, the stand-in model server over HTTP): the OpenTelemetry span
tree, its times against the trajectory's ``timing``, the spans on the trajectory without any tracer, and the export
over OTLP/HTTP to a collector."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError
from standin_helpers import ROW, SCRIPT, running_standin

from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceRuntime, ServiceSettings
from nemo_gym_prorl.service.client import RolloutClient
from nemo_gym_prorl.telemetry import otlp_export, tracing
from nemo_gym_prorl.telemetry.tracing import TracingConfig

STAGES = ("init", "run", "eval")


@pytest.fixture(scope="module")
def standin_model() -> Iterator[str]:
    yield from running_standin(SCRIPT)


@asynccontextmanager
async def in_process_service(model_url: str, **settings):
    model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin", tool_call_format="codeact")
    config = ServiceConfig(service=ServiceSettings(port=0, store=Path(":memory:"), **settings), model=model)
    async with ServiceRuntime(config) as runtime:
        assert runtime.orchestrator is not None
        yield RolloutClient.in_process(runtime.orchestrator)


async def rollouts(client, n: int) -> list[Trajectory]:
    job_id = await client.submit(JobRequest(instance=ROW, n=n, sampling_params={"seed": 1}))
    return [trajectory async for _, trajectory in client.stream(job_id)]


def seconds(ns: int) -> float:
    return ns / 1e9


def check_trace(trajectory: Trajectory, spans: list[ReadableSpan], model_url: str) -> None:
    """`spans` (all of one trace) form the rollout's tree, with the times and attributes its `timing` holds."""
    (root,) = [s for s in spans if s.name == "rollout"]
    assert root.parent is None and root.attributes["trajectory_id"] == trajectory.trajectory_id
    assert root.attributes["reward"] == trajectory.reward == 1.0 and root.attributes["finish"] == "answer"
    by_name = {name: [s for s in spans if s.name == name] for name in (*STAGES, "model", "tool")}
    assert len(spans) == 1 + len(STAGES) + 2 + 1  # two model turns, one bash call
    stage = {name: by_name[name][0] for name in STAGES}
    for name, span in stage.items():
        assert span.parent.span_id == root.context.span_id
        # a stage's time is its span's (no weight sync waited here)
        assert seconds(span.end_time - span.start_time) == pytest.approx(getattr(trajectory.timing, name), abs=1e-6)
    assert stage["init"].end_time <= stage["run"].start_time and stage["run"].end_time <= stage["eval"].start_time
    run = stage["run"]
    calls = by_name["model"] + by_name["tool"]
    for call in calls:
        assert call.parent.span_id == run.context.span_id
        assert run.start_time <= call.start_time <= call.end_time <= run.end_time
    stage_total = sum(getattr(trajectory.timing, name) for name in STAGES) + trajectory.timing.queued
    assert seconds(root.end_time - root.start_time) >= stage_total - 1e-6

    models = sorted(by_name["model"], key=lambda s: s.start_time)
    turns = trajectory.assistant_turns()
    assert [m.attributes["turn"] for m in models] == [0, 1]
    assert [m.attributes["generated_tokens"] for m in models] == [len(t["generation_token_ids"]) for t in turns]
    assert [m.attributes["prompt_tokens"] for m in models] == [len(t["prompt_token_ids"]) for t in turns]
    assert all(m.attributes["backend"] == model_url and m.attributes["attempts"] == 1 for m in models)
    (tool,) = by_name["tool"]
    assert tool.attributes["tool"] == "bash" and tool.attributes["turn"] == 0 and tool.attributes["finished"] is False
    assert tool.attributes["sandbox_backend"] == "bwrap"
    assert tool.attributes["sandbox_id"] == run.attributes["sandbox_id"]
    assert models[0].end_time <= tool.start_time <= tool.end_time <= models[1].start_time

    # The trajectory carries the same spans, timed from submission (the rollout span's start).
    recorded = sorted(trajectory.timing.spans, key=lambda s: s.start_s)
    exported = sorted((s for s in spans if s is not root), key=lambda s: s.start_time)
    assert [s.name for s in recorded] == [s.name for s in exported]
    for mine, theirs in zip(recorded, exported, strict=True):
        assert mine.start_s == pytest.approx(seconds(theirs.start_time - root.start_time), abs=1e-6)
        assert mine.duration_s == pytest.approx(seconds(theirs.end_time - theirs.start_time), abs=1e-6)
        assert mine.attributes == dict(theirs.attributes)


async def test_a_rollout_traces_its_stages_and_each_model_request_and_tool_call(standin_model: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with in_process_service(standin_model) as client:
        (untraced,) = await rollouts(client, 1)
        with tracing.traced_by(provider):
            traced = await rollouts(client, 2)
    # Without a tracer nothing reaches OpenTelemetry, and the trajectory still has its timings.
    assert [s.name for s in untraced.timing.spans] == ["init", "model", "tool", "model", "run", "eval"]
    traces: dict[int, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        traces.setdefault(span.context.trace_id, []).append(span)
    assert len(traces) == 2  # one trace per rollout
    by_trajectory = {next(s for s in spans if s.name == "rollout").attributes["trajectory_id"]: spans
                     for spans in traces.values()}
    for trajectory in traced:
        check_trace(trajectory, by_trajectory[trajectory.trajectory_id], standin_model)
    sandboxes = {next(s for s in spans if s.name == "run").attributes["sandbox_id"] for spans in traces.values()}
    assert len(sandboxes) == 2  # each sample ran in a sandbox of its own
    # Loaded back from JSON (as a rollouts file holds it), the spans are the same; files without them still load.
    assert Trajectory.model_validate_json(traced[0].model_dump_json()).timing == traced[0].timing
    old = traced[0].model_dump(mode="json")
    del old["timing"]["spans"]
    assert Trajectory.model_validate(old).timing.spans == []


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP traces receiver: keeps each export request, decoded."""

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, ExportTraceServiceRequest]]]]:
    received: list[tuple[str, ExportTraceServiceRequest]] = []
    handler = type("Collector", (_Collector,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def exporting_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the export and OpenTelemetry's exporter logged."""
    return [r.getMessage() for r in caplog.records if r.name.startswith(("opentelemetry", otlp_export.__name__))]


async def test_a_configured_otlp_endpoint_receives_the_rollouts_traces(
    standin_model: str, collector, caplog: pytest.LogCaptureFixture
) -> None:
    url, received = collector
    tracing_config = TracingConfig(otlp_endpoint=url, service_name="prorl-test")
    caplog.set_level(logging.INFO)
    async with in_process_service(standin_model, tracing=tracing_config) as client:
        (trajectory,) = await rollouts(client, 1)
    assert exporting_lines(caplog) == []  # nothing dropped
    # The service's stop flushed the batch: every span arrived at OTLP's traces path, under the service's name.
    assert received and all(path == "/v1/traces" for path, _ in received)
    names, services = [], set()
    for _, request in received:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            services.add(attributes["service.name"])
            names += [span.name for scope in resource_spans.scope_spans for span in scope.spans]
    assert services == {"prorl-test"}
    assert sorted(names) == sorted(["rollout", *[s.name for s in trajectory.timing.spans]])
    assert tracing._tracer is None  # off again once the service stopped


@pytest.fixture(params=["silent", "refusing"])
def down_collector(request: pytest.FixtureRequest) -> Iterator[str]:
    """A collector that is down: a socket that accepts connections and never answers, or one bound without
    listening (connections are refused); the port stays ours either way."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    if request.param == "silent":
        sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.mark.timeout(120)
async def test_a_collector_that_is_down_holds_the_stop_only_for_its_bound_and_the_loss_is_said_once(
    standin_model: str, down_collector: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenTelemetry's exporter alone would wait on this collector for an hour per batch; the stop waits 1 s.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "3600")
    tracing_config = TracingConfig(otlp_endpoint=down_collector, shutdown_timeout_s=1)
    caplog.set_level(logging.INFO)
    async with in_process_service(standin_model, tracing=tracing_config) as client:
        (trajectory,) = await rollouts(client, 1)
        caplog.clear()
    (line,) = exporting_lines(caplog)  # the exporter's own retry lines are held back
    spans = 1 + len(trajectory.timing.spans)  # the rollout and its stages and calls
    assert line.startswith(f"tracing: {spans} of {spans} spans dropped: the OTLP collector at {down_collector}")
    assert "within tracing.shutdown_timeout_s=1s of the stop" in line
    assert tracing._tracer is None


def test_tracing_config_names_a_bad_endpoint_and_completes_a_bare_one() -> None:
    with pytest.raises(ValidationError, match="otlp_endpoint"):
        TracingConfig(otlp_endpoint="localhost:4318")
    assert TracingConfig(otlp_endpoint="http://collector:4318").traces_url() == "http://collector:4318/v1/traces"
    assert TracingConfig(otlp_endpoint="http://c:4318/custom").traces_url() == "http://c:4318/custom"
    assert TracingConfig().traces_url() is None
