"""A real OTLP trace receiver for the tests: gRPC (OTLP's default) and HTTP/protobuf on loopback.

What an exporter sends is decoded with opentelemetry-proto's own messages and kept as `ReceivedSpan`s, so a
test checks the spans a collector would have received: ids, parents, names, attributes, events, and the
service that sent them. Both servers run in threads of their own (any event loop, any process may export to
them); `wait_for_spans` waits on a condition with a deadline.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    name: str
    service: str
    attributes: dict
    events: list[tuple[str, dict]]
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str = ""
    links: list[tuple[str, str]] = field(default_factory=list)

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_export(raw: bytes) -> list[ReceivedSpan]:
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(raw)
    return spans_of(request)


def spans_of(request) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        service = str(_attrs(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(ReceivedSpan(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                    name=s.name, service=service, attributes=_attrs(s.attributes),
                    events=[(e.name, _attrs(e.attributes)) for e in s.events],
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    status_code=s.status.code, status_message=s.status.message,
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links]))
    return out


class OtlpReceiver:
    """Both OTLP transports on loopback ports of their own; every span either receives lands in `spans`.

    `grpc_endpoint` is what `--otlp-traces-endpoint` takes for gRPC (`127.0.0.1:PORT`); `http_endpoint` the
    HTTP exporter's URL (`http://127.0.0.1:PORT/v1/traces`)."""

    def __init__(self, *, keep: bool = True) -> None:
        """`keep=False`: count the spans, keep none (a sink for benchmarks: `python -m tests.otlp_receiver`)."""
        self.keep = keep
        self.received = 0
        self.spans: list[ReceivedSpan] = []
        self.exports = {"grpc": 0, "http": 0}
        self._cond = threading.Condition()
        self._grpc = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port = 0
        self.http_port = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self, *, grpc: bool = True, http: bool = True, http_port: int = 0) -> "OtlpReceiver":
        """`http_port`: a given port (a collector restarted where it was), else a free one."""
        if http:
            self._start_http(http_port)
        if grpc:
            self._start_grpc()
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def _received(self, request, transport: str) -> None:
        spans = spans_of(request) if self.keep else []
        with self._cond:
            self.received += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            self.spans.extend(spans)
            self.exports[transport] += 1
            self._cond.notify_all()

    def _start_http(self, port: int) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                coding = (self.headers.get("Content-Encoding") or "").lower()
                if coding == "gzip":
                    raw = gzip.decompress(raw)
                elif coding == "deflate":
                    raw = zlib.decompress(raw)
                if self.path != "/v1/traces" or "protobuf" not in (self.headers.get("Content-Type") or ""):
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(raw)
                receiver._received(request, "http")
                body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._http.daemon_threads = True
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()

    def _start_grpc(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the service's name)
                receiver._received(request, "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
        self.grpc_port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._grpc = server

    # ---- reading -----------------------------------------------------------------------------------
    def wait_for_spans(self, condition: Callable[[list[ReceivedSpan]], bool], timeout: float = 15.0,
                       message: str = "") -> list[ReceivedSpan]:
        """Wait until `condition(spans)` holds (checked on every export), with a deadline."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not condition(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise AssertionError(f"spans not received within {timeout} s: {message}; got {names}")
                self._cond.wait(left)
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._cond:
            return [s for s in self.spans if s.trace_id == trace_id]


def main() -> None:
    """An OTLP sink on loopback until SIGTERM/SIGINT: prints its endpoints, then the spans it took at exit."""
    import argparse
    import signal

    argparse.ArgumentParser(description=main.__doc__).parse_args()
    receiver = OtlpReceiver(keep=False).start()
    print(f"grpc {receiver.grpc_endpoint} http {receiver.http_endpoint}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    receiver.stop()
    print(f"received {receiver.received} spans in {sum(receiver.exports.values())} exports", flush=True)


if __name__ == "__main__":
    main()
