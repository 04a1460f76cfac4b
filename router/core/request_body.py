"""A client's request body: bounded before it is read.

Size: a declared `Content-Length` over the bound is 413 before a byte is read (a client that declares 1 TB
and sends nothing gets its answer at once), and a body without one is cut off at the bound while it is read.
"""

from __future__ import annotations

from aiohttp import web

from router.core.errors import PayloadTooLarge

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
