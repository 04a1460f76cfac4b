"""A client request's span and its legs' spans, over the OpenTelemetry SDK (imported only with tracing on).

The request span (kind SERVER, `POST <route>`) continues the client's W3C trace context (a missing or malformed
`traceparent` starts a new trace) and holds the request's story as events: `admitted` (the admission wait),
`admission_held` (waiting out a fleet-wide hold), `pair_chosen` (one per attempt), `retry` / `retry_aborted`
(why the next attempt). Each attempt's two legs are child spans (kind CLIENT), and each leg's own span is the
parent named in the `traceparent` sent to its server, so SGLang's request spans hang under the leg that
reached them.
"""

from __future__ import annotations

from typing import Mapping

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.core.records import RequestRecord
from router.core.registry import Worker

_extract = TraceContextTextMapPropagator().extract
_ERROR = StatusCode.ERROR
_MAX_MESSAGE = 500


def header_line(span) -> bytes:
    """`traceparent` (and `tracestate`) naming `span` as the parent, as wire bytes."""
    ctx = span.get_span_context()
    line = b"traceparent: 00-%032x-%016x-%02x\r\n" % (ctx.trace_id, ctx.span_id, ctx.trace_flags)
    if ctx.trace_state:
        line += b"tracestate: %s\r\n" % ctx.trace_state.to_header().encode()
    return line


class OtelLegTrace:
    __slots__ = ("span", "header_line")

    def __init__(self, span) -> None:
        self.span = span
        self.header_line = header_line(span)

    def end(self, outcome: str) -> None:
        span = self.span
        span.set_attribute("pd.leg.outcome", outcome)
        if outcome == "error":
            span.set_status(Status(_ERROR))
        span.end()


class OtelRequestTrace:
    __slots__ = ("_tracer", "span", "_context")

    def __init__(self, tracer, span) -> None:
        self._tracer = tracer
        self.span = span
        self._context = trace.set_span_in_context(span)

    def event(self, name: str, attributes: dict) -> None:
        self.span.add_event(name, attributes)

    def legs(self, prefill: Worker, decode: Worker, attempt: int, rids: list[str]) -> tuple[OtelLegTrace, OtelLegTrace]:
        start = self._tracer.start_span
        rid = rids[0] if len(rids) == 1 else ",".join(rids[:16])
        out = []
        for role, worker in (("prefill", prefill), ("decode", decode)):
            out.append(OtelLegTrace(start(f"{role} leg", context=self._context, kind=SpanKind.CLIENT, attributes={
                "pd.role": role, "server.url": worker.url, "pd.attempt": attempt, "rid": rid})))
        return out[0], out[1]

    def end(self, record: RequestRecord) -> None:
        span = self.span
        span.set_attributes({"http.response.status_code": record.status, "pd.outcome": str(record.outcome),
                             "pd.attempts": record.attempts})
        if record.request_id:
            span.set_attribute("pd.request_id", record.request_id)
        if record.ttft_s is not None:
            span.set_attribute("pd.ttft_s", record.ttft_s)
        if record.outcome != "success":
            span.set_status(Status(_ERROR, record.error[:_MAX_MESSAGE] or record.outcome))
        span.end()


class OtelRequestTracer:
    """`router.core.tracing.RequestTracer` over an SDK tracer."""

    def __init__(self, tracer) -> None:
        self._tracer = tracer

    def start(self, headers: Mapping[str, str], route: str) -> OtelRequestTrace:
        parent = _extract(headers) if "traceparent" in headers else None
        span = self._tracer.start_span(f"POST {route}", context=parent, kind=SpanKind.SERVER,
                                       attributes={"http.route": route})
        return OtelRequestTrace(self._tracer, span)
