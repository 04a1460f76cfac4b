"""Answer formats: how the items of one call become an HTTP body or SSE chunks.

``NativeFormat`` is SGLang's ``/generate`` (cumulative stream chunks, ``index`` in batches);
the OpenAI formats live in openai.py. ``Worker.serve`` drives either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from . import outputs
from .requests import Req, RequestFailed
from .httputil import http_error, json_response, value_error

if TYPE_CHECKING:
    from .inputs import GenerateCall
    from .server import Server

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class StreamState:
    """Per-call bookkeeping for a stream: which item sent what."""

    def __init__(self) -> None:
        self.sent_len: dict[int, int] = {}
        self.finals: set[int] = set()
        self.extra: dict[str, Any] = {}

    def final_sent(self, req: Req) -> bool:
        return id(req) in self.finals


class Format:
    """How one call's items become an HTTP answer (native ``/generate`` here, OpenAI in openai.py)."""

    def stream_state(self, worker: "Server", reqs: list[Req], call: "GenerateCall") -> StreamState:
        return StreamState()

    def whole(self, worker: "Server", reqs: list[Req], call: "GenerateCall") -> web.Response:
        raise NotImplementedError

    def chunks(self, worker: "Server", req: Req, state: StreamState, *, batch: bool) -> list[bytes]:
        raise NotImplementedError

    def failed_chunks(self, worker: "Server", req: Req, state: StreamState, exc: RequestFailed,
                      *, batch: bool) -> list[bytes]:
        raise NotImplementedError

    def tail(self, worker: "Server", reqs: list[Req], state: StreamState) -> list[bytes]:
        return []

    async def rejected_stream(self, request: web.Request, message: str) -> web.StreamResponse:
        """A stream refused by validation: SGLang has already answered 200, so the error is an event."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write_eof(sse(self.stream_error(message)) + SSE_DONE)
        return resp

    def stream_error(self, message: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}

    def failure_response(self, exc: RequestFailed) -> web.Response:
        """A non-streamed call that ended in SGLang's ValueError (400) or HTTPException (5xx)."""
        if exc.status == 400:
            return value_error(exc.message)
        return http_error(exc.status, exc.message)


class NativeFormat(Format):
    def whole(self, worker: "Server", reqs: list[Req], call: "GenerateCall") -> web.Response:
        outs = [self._final(worker, req) for req in reqs]
        return json_response(outs[0] if call.is_single else outs)

    @staticmethod
    def _final(worker: "Server", req: Req) -> dict[str, Any]:
        if req.finish_reason and req.finish_reason.get("message") == "Abort in waiting queue":
            return outputs.waiting_abort_output(worker.engine, req)
        return outputs.generate_output(worker.engine, req, finished=True, first=True)

    def chunks(self, worker: "Server", req: Req, state: StreamState, *, batch: bool) -> list[bytes]:
        finished = req.done
        out = outputs.generate_output(worker.engine, req, finished=finished, first=not req.first_output_sent)
        req.first_output_sent = True
        if finished:
            state.finals.add(id(req))
        if batch:
            out["index"] = state.extra.setdefault("index", {}).get(req.rid, 0)
        return [sse(out)]

    def stream_state(self, worker: "Server", reqs: list[Req], call: "GenerateCall") -> StreamState:
        state = StreamState()
        state.extra["index"] = {req.rid: i for i, req in enumerate(reqs)}
        return state

    def failed_chunks(self, worker: "Server", req: Req, state: StreamState, exc: RequestFailed,
                      *, batch: bool) -> list[bytes]:
        out = outputs.failed_output(worker.engine, req, exc.status, exc.message)
        req.first_output_sent = True
        state.finals.add(id(req))
        if batch:
            out["index"] = state.extra["index"].get(req.rid, 0)
        return [sse(out)]


