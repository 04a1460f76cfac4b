"""What the request path asks of a tracer (`--enable-trace`), and the W3C trace headers.

The request path holds a `RequestTracer` or None: with tracing off it is None, nothing of OpenTelemetry is
imported and a request pays one `is None` test per place a span would be touched. The implementation, over
the OpenTelemetry SDK and its OTLP exporters, is `router/obs/otel_tracing.py`, built by the composition root only
when tracing is on.

Shape of a traced request (SGLang 0.5.23 reads `traceparent`/`tracestate` on /generate and the OpenAI routes,
`observability/trace.py`, and starts its own request span under it):

    client span (its traceparent) -> the router's request span (events: admitted, pair chosen, retries)
                                       -> one span per leg -> that server's own spans
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING, Mapping, Protocol

if TYPE_CHECKING:
    from router.core.registry import Worker

# W3C Trace Context. With tracing off the router passes the client's headers through to both legs, so servers
# tracing on their own still join the client's trace; with it on, each leg gets its own span's traceparent.
TRACE_HEADERS = ("traceparent", "tracestate")
# The `trace` extra (pip install 'pd-router[trace]'): the SDK and the exporter of each protocol.
PACKAGES = {"sdk": "opentelemetry.sdk", "grpc": "opentelemetry.exporter.otlp.proto.grpc",
            "http/protobuf": "opentelemetry.exporter.otlp.proto.http"}


def missing_packages(protocol: str) -> str | None:
    """Why tracing cannot start here (a package of the `trace` extra is not installed), or None. Looked up
    without importing anything."""
    for name in (PACKAGES["sdk"], PACKAGES.get(protocol, PACKAGES["grpc"])):
        try:
            found = find_spec(name) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            return f"--enable-trace needs the OpenTelemetry packages ({name} is not installed): pip install " \
                   f"'pd-router[trace]'"
    return None


class LegTrace(Protocol):
    """One leg's span (a child of the request's)."""

    # `traceparent: 00-<trace>-<this leg's span>-<flags>\r\n` (and the tracestate line): sent on the leg
    header_line: bytes

    def end(self, outcome: str) -> None:
        """The leg is over (`policies.LegOutcome` value: success, error, cancelled); called exactly once."""


class RequestTrace(Protocol):
    """One client request's span, from the handler's entry to its record."""

    def event(self, name: str, attributes: dict) -> None: ...

    def legs(self, prefill: "Worker", decode: "Worker", attempt: int, rids: list[str]) -> tuple[LegTrace, LegTrace]:
        """The two leg spans of one attempt (started now)."""

    def end(self, record) -> None:
        """The request is over: `record` is its `core.records.RequestRecord` (which names this protocol)."""


class RequestTracer(Protocol):
    def start(self, headers: Mapping[str, str], route: str) -> RequestTrace:
        """A request's span: under the client's `traceparent` when it sent a valid one, else a new trace (a
        malformed header starts a new trace, never an error)."""
