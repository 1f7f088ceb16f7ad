"""Rollout traces exported over OTLP/HTTP, and a stop that never waits on the collector for long.

OpenTelemetry's batch exporter retries a collector that refuses connections, or waits on one that accepts and never
answers, for its whole export timeout (10 s by default, per batch), and ``TracerProvider.shutdown`` waits for that:
called on the service's event loop, a collector that is down froze the loop on every stop. Here the provider is
shut down in a thread of its own, awaited for at most ``shutdown_timeout_s``; past that the service goes on with its
stop and what the collector has not taken is given up. Which spans were lost is counted (spans ended against spans
the collector acknowledged) and said in one log line, with the exporter's last complaint as the reason. The
exporter's own lines (one per retry) are held back while it runs: a collector that is down while the service serves
is reported once, and the total at the stop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

_EXPORTER_LOGGER = logging.getLogger(OTLPSpanExporter.__module__)  # its retries, failures and HTTP client


class OtlpExport:
    """A ``TracerProvider`` whose spans go to the collector at `url` in batches; `stop()` ends it, bounded."""

    def __init__(self, url: str, service_name: str, headers: dict[str, str], shutdown_timeout_s: float) -> None:
        self.url = url
        self.shutdown_timeout_s = shutdown_timeout_s
        self.ended = 0  # spans handed to the export
        self.delivered = 0  # spans the collector acknowledged
        self.reason: str | None = None  # the exporter's last complaint
        self._stopping = False
        self._warned = False
        self._quiet = _HoldBack(self)
        _EXPORTER_LOGGER.addFilter(self._quiet)
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}), shutdown_on_exit=False)
        self.provider.add_span_processor(_CountEnded(self))
        exporter = _CountDelivered(OTLPSpanExporter(endpoint=url, headers=headers or None), self)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))

    def failed(self, spans: int) -> None:
        """A batch the collector did not take: said once while the service runs (the total comes at the stop)."""
        if not self._stopping and not self._warned:
            self._warned = True
            log.warning(
                "tracing: the OTLP collector at %s did not take %d spans (%s); spans are dropped while it does not, "
                "the total is logged at the stop", self.url, spans, self.reason or "no reason given",
            )  # fmt: skip

    async def stop(self) -> None:
        """Send what is buffered, for at most `shutdown_timeout_s`, off the event loop; log what was dropped."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def shut_down() -> None:
            try:
                self.provider.shutdown()
            finally:
                _EXPORTER_LOGGER.removeFilter(self._quiet)
                try:
                    loop.call_soon_threadsafe(done.set)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

        # A daemon thread, not the loop's executor: asyncio.run joins the executor's threads at its end, which would
        # wait on the collector after all.
        threading.Thread(target=shut_down, name="otlp-export-stop", daemon=True).start()
        try:
            await asyncio.wait_for(done.wait(), self.shutdown_timeout_s)
            waited = "before the stop"
        except TimeoutError:
            waited = f"within tracing.shutdown_timeout_s={self.shutdown_timeout_s:g}s of the stop"
        dropped = self.ended - self.delivered
        if dropped > 0:
            log.warning(
                "tracing: %d of %d spans dropped: the OTLP collector at %s did not take them %s (%s)",
                dropped, self.ended, self.url, waited, self.reason or "no answer",
            )  # fmt: skip


class _HoldBack(logging.Filter):
    """Keeps the exporter's log lines out of the service's log, remembering the last one as the reason."""

    def __init__(self, export: OtlpExport) -> None:
        super().__init__()
        self._export = export

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            self._export.reason = record.getMessage()
        return False


class _CountEnded(SpanProcessor):
    def __init__(self, export: OtlpExport) -> None:
        self._export = export

    def on_end(self, span: ReadableSpan) -> None:
        self._export.ended += 1


class _CountDelivered(SpanExporter):
    def __init__(self, exporter: SpanExporter, export: OtlpExport) -> None:
        self._exporter = exporter
        self._export = export

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._exporter.export(spans)
        if result is SpanExportResult.SUCCESS:
            self._export.delivered += len(spans)
        else:
            self._export.failed(len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)
