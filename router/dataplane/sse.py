"""Server-sent events as SGLang writes them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import orjson

# The head of every event stream the router answers with (relayed or its own).
RESPONSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
_DONE_PAYLOAD = b"[DONE]"
_SEP = b"\n\n"


def event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + _SEP


def error_event(message: str, code: int = 502, type_: str = "upstream_error") -> bytes:
    return event({"error": {"message": message, "type": type_, "code": code, "retryable": False}})


class EventSplitter:
    """Splits a byte stream into complete events, whatever the chunking (no line-length limit)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Return the complete events (each ending with a blank line) found so far."""
        buffer = self._buffer + chunk if self._buffer else chunk
        if _SEP not in buffer:
            # tolerate \r\n\r\n framing
            if b"\r\n\r\n" in buffer:
                buffer = buffer.replace(b"\r\n", b"\n")
            else:
                self._buffer = buffer
                return []
        parts = buffer.split(_SEP)
        self._buffer = parts.pop()
        return [part + _SEP for part in parts if part.strip()]

    def rest(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


def event_data(raw_event: bytes) -> bytes | None:
    """The payload of a `data:` event (None for comments and other fields)."""
    for line in raw_event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


def is_done(raw_event: bytes) -> bool:
    return event_data(raw_event) == _DONE_PAYLOAD


def parse_event(raw_event: bytes) -> object | None:
    data = event_data(raw_event)
    if data is None or data == _DONE_PAYLOAD:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
