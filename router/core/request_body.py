"""A client's request body: bounded before it is read, decoded from its content coding, parsed as JSON.

Size: a declared `Content-Length` over the bound is 413 before a byte is read (a client that declares 1 TB
and sends nothing gets its answer at once), and a body without one is cut off at the bound while it is read;
a compressed body is bounded both as sent and decoded (no decompression bomb).

Content codings are decoded here, not by aiohttp's parser (the runner is built with `auto_decompress=False`,
`router/server/serving.py`): what the router accepts does not depend on optional packages (aiohttp decodes
`br` only with Brotli installed, `zstd` only with backports.zstd, and answers their absence in text/plain),
and a body that is not what its coding says is a 400 JSON error, not a 500 or a reset connection.
Accepted: `identity`, `gzip` (`x-gzip`), `deflate` (zlib-wrapped or raw). Others (`br`, `zstd`, `compress`,
several codings stacked) are 400 naming the accepted ones.

JSON: orjson reads up to 1024 levels of nesting but writes at most 254, and the router writes every body it
forwards; `check_reserializable` turns a body it could read but not write back into a 400 (the request
path does not pay for it: it catches the same error where it writes the body anyway).
"""

from __future__ import annotations

import asyncio
import zlib

import orjson
from aiohttp import web

from router.core.errors import BadRequest, PayloadTooLarge, RequestTimeout

ACCEPTED_ENCODINGS = ("identity", "gzip", "deflate")
_GZIP = frozenset({"gzip", "x-gzip"})
NESTING_LIMIT = "nested deeper than the router can forward (254 levels of arrays and objects)"


def too_large(request: web.BaseRequest, limit: int, flag: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"{request.method} {request.path}: the body is over {limit} bytes ({flag})",
                           limit=limit)


def check_declared_size(request: web.BaseRequest, limit: int, flag: str) -> None:
    """413 at once when the client declares a body over `limit` (nothing of it is read)."""
    length = request.content_length
    if length is not None and length > limit:
        raise too_large(request, limit, flag)


async def read_bounded(request: web.BaseRequest, limit: int, flag: str) -> bytes:
    """The body as sent, or 413 as soon as it is known to be over `limit` bytes (from Content-Length before
    reading anything, else while reading), so an oversized body is never buffered whole."""
    check_declared_size(request, limit, flag)
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(request, limit, flag)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_unstalled(request: web.BaseRequest, limit: int, stall_s: float) -> bytes:
    """The body of a request that is still arriving, bounded by `limit` (413) and by `stall_s` seconds without a
    byte of it (408, --stream-body-stall-timeout-secs). The caller reads a body already in whole as it is."""
    content, chunks, size = request.content, [], 0
    while True:
        try:
            async with asyncio.timeout(stall_s):
                chunk = await content.readany()
        except TimeoutError:
            raise RequestTimeout(f"{request.method} {request.path}: the request body stopped arriving: nothing of "
                                 f"it for {stall_s:g} s (--stream-body-stall-timeout-secs)") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise too_large(request, limit, "--max-payload-size")
        chunks.append(chunk)


def decode_content(request: web.BaseRequest, raw: bytes, limit: int, flag: str) -> bytes:
    """The body decoded from its `Content-Encoding` (none, or identity: as it is)."""
    coding = request.headers.get("Content-Encoding")
    if coding is None:
        return raw
    codings = [c for c in (part.strip().lower() for part in coding.split(",")) if c and c != "identity"]
    if not codings:
        return raw
    if len(codings) > 1 or (codings[0] not in _GZIP and codings[0] != "deflate"):
        raise BadRequest(f"Content-Encoding {coding.strip()!r} is not accepted: send the body as "
                         f"{', '.join(ACCEPTED_ENCODINGS)}", param="Content-Encoding")
    name = codings[0]
    if name in _GZIP:
        wbits = 16 + zlib.MAX_WBITS
    else:  # RFC 9110's deflate is zlib-wrapped; some clients send raw deflate (as aiohttp, accept both)
        wbits = zlib.MAX_WBITS if raw[:1] and raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
    decoder = zlib.decompressobj(wbits)
    try:
        body = decoder.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise BadRequest(f"the body is not valid {name} data (Content-Encoding: {coding.strip()}): {exc}",
                         param="Content-Encoding") from None
    if len(body) > limit or decoder.unconsumed_tail:
        raise too_large(request, limit, f"{flag}, decoded")
    if raw and not decoder.eof:
        raise BadRequest(f"the body is truncated {name} data (Content-Encoding: {coding.strip()})",
                         param="Content-Encoding")
    return body


def check_reserializable(body: object) -> None:
    """400 for a parsed body the router could not write back (JSON nested too deep for orjson's writer)."""
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise BadRequest(f"request body is {NESTING_LIMIT}") from None
