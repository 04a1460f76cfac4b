"""OpenTelemetry traces over OTLP (`--enable-trace`, `--otlp-traces-endpoint`): SGLang's flags and conventions.

Imported only when tracing is on (the composition root imports it then); the packages are the `trace` extra
(`pip install pd-router[trace]`). The exporter is chosen as SGLang 0.5.23 chooses it
(`observability/trace.py`): `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, `grpc` by default (the endpoint is
`host:port`, plaintext), or `http/protobuf` (the endpoint is the collector's URL; `host:port` alone is taken as
`http://host:port/v1/traces`, which SGLang's own exporter would not reach). Service name: `--otlp-service-name`,
else `OTEL_SERVICE_NAME`, else `pd-router`.

Spans are batched and exported from the SDK's own thread, never from the event loop: a collector that is
down or slow costs the router nothing but the spans it drops (the batch queue is bounded), and says so once
(`ExportWatch`: one warning when exporting starts failing, one line when it works again; the exporters' own
per-batch errors are kept out of the log). Shutdown flushes what is queued within a bounded time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from aiohttp import web

from router.core.config import TraceConfig
from router.obs.flow_spans import FlowSpans
from router.obs.request_spans import OtelRequestTracer

logger = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
EXPORT_TIMEOUT_S = 3.0  # one export call's bound, its retries included (the SDK's default is 10 s)
SHUTDOWN_FLUSH_S = 3.0  # what shutdown waits for queued spans to go out
SCHEDULE_DELAY_MS = 500  # how often a batch goes out (SGLang's default delay; the SDK's is 5 s)


def http_traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint as the exporter posts to it: scheme and `/v1/traces` added when absent."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    scheme, _, rest = url.partition("://")
    if "/" not in rest:
        url = f"{scheme}://{rest}/v1/traces"
    return url


def service_name(config: TraceConfig) -> str:
    return config.service_name or os.environ.get("OTEL_SERVICE_NAME") or "pd-router"


class Tracing:
    """The router's tracer provider, its exporter and the span makers the request path and the flows use."""

    def __init__(self, config: TraceConfig) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.protocol = config.protocol or "grpc"
        self.endpoint = config.otlp_traces_endpoint
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name(config)}))
        self.watch = ExportWatch(_exporter(self.protocol, self.endpoint), f"{self.protocol} {self.endpoint}")
        self._processor = BatchSpanProcessor(self.watch, schedule_delay_millis=SCHEDULE_DELAY_MS)
        self.provider.add_span_processor(self._processor)
        tracer = self.provider.get_tracer("pd-router")
        self.requests = OtelRequestTracer(tracer)
        self.flows = FlowSpans(tracer)
        # The exporters log every failed batch at ERROR, with a traceback for some: ExportWatch says it once.
        for name in ("opentelemetry.exporter", "opentelemetry.sdk._shared_internal",
                     "opentelemetry.sdk.trace.export"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # A client's malformed tracestate is a warning per request there (it is dropped, as W3C says): a client
        # must not be able to fill the router's log.
        logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)
        logger.info("tracing on: spans exported over OTLP %s to %s as %s", self.protocol, self.endpoint,
                    service_name(config))

    async def close(self) -> None:
        """Flush queued spans (bounded: a collector that is down is not waited on) and stop the exporter."""
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def shut() -> None:
            try:
                self.watch.closing = True  # from now on a collector that failed is not tried again
                if not self.watch.failing:
                    self._processor.force_flush(int(SHUTDOWN_FLUSH_S * 1000))
                self.provider.shutdown()
            finally:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=shut, name="trace-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, SHUTDOWN_FLUSH_S + EXPORT_TIMEOUT_S + 1)
        except TimeoutError:
            logger.warning("tracing: spans still queued at shutdown were dropped (the collector at %s did not "
                           "take them in time)", self.endpoint)


TRACING = web.AppKey("tracing", Tracing)  # only with --enable-trace


def _exporter(protocol: str, endpoint: str):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=http_traces_url(endpoint), timeout=EXPORT_TIMEOUT_S)


class ExportWatch:
    """A span exporter around the OTLP one: one warning when exports start failing, one info line when they
    work again, and nothing more while the collector stays down (every batch failing is the same news)."""

    def __init__(self, inner, where: str) -> None:
        self.inner = inner
        self.where = where
        self.failing = False
        self.closing = False
        self.dropped = 0  # spans of failed exports since exporting last worked

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self.closing and self.failing:
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter bug must not kill the SDK's thread
            result, why = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        else:
            why = "the collector did not take them"
        if result is SpanExportResult.SUCCESS:
            if self.failing:
                logger.info("tracing: exporting to %s works again (%d spans were dropped meanwhile)", self.where,
                            self.dropped)
                self.failing, self.dropped = False, 0
            return result
        self.dropped += len(spans)
        if not self.failing:
            self.failing = True
            logger.warning("tracing: cannot export spans over OTLP %s (%s); requests are served as before, spans "
                           "are dropped until it answers (said once)", self.where, why)
        return result

    def shutdown(self, *args, **kwargs) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
