"""A lean HTTP/1.1 client for the request path's two legs: keep-alive pools on plain asyncio protocols.

Why not aiohttp's ClientSession here: it costs ~130 µs of CPU per POST where a protocol that parses only what
the proxy needs costs ~10 µs (`python -m bench.client_cost`), and every request makes two. The control plane
(`control/upstream.py`) keeps aiohttp.

What it does, and no more: POST a body; the status and content type; the whole body, or its pieces as they
arrive (SSE); Content-Length, chunked and read-until-close framing; keep-alive reuse with a bound on the
connections in use; a connect timeout; a silence watch that cuts an answer whose server stopped sending
mid-way (`silence_timeout`, suspended while the fleet is paused on purpose). Rules that keep a pool sound:
- a connection goes back to its pool only once its response has been read to its end with keep-alive; an
  error, a cancellation, garbage after the message or a response closed early closes it instead;
- a request on a reused connection that the server closed before answering (it timed out the idle
  connection while we wrote) is sent once more on a fresh connection; never when any byte of an answer came.

`response.py` is one exchange (the answer's framing and the reader's API; the bytes are parsed by httptools,
llhttp's C parser, which measured 0.7x the hand-written parser's time for a Content-Length answer and 0.3x
for an SSE stream: `python -m bench.parser_cost`); `pool.py` the connections it runs on.
"""

from router.dataplane.upstream_http.pool import UpstreamPool, header_lines
from router.dataplane.upstream_http.response import (
    LocalResourceError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamSilent,
)

__all__ = ["LocalResourceError", "UpstreamConnectError", "UpstreamError", "UpstreamPool", "UpstreamProtocolError", "UpstreamResponse",
           "UpstreamSilent", "header_lines"]
