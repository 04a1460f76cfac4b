"""The legs' HTTP/1.1 response parsing, this checkout against a revision: `python -m bench.parser_cost`.

`UpstreamResponse.feed` (router/dataplane/upstream_http/response.py) of this checkout and of `--baseline-rev`
(default: the last revision with the hand-written parser, before httptools took the parsing) parse the same
bytes, fed as the socket would feed them, on a fake connection and pool: status, content type, keep-alive,
the body handed to the reader, the connection handed back at the end.

Three wire shapes: nginx's Content-Length answer from the ceiling setup (head and body in one read), the
same in two reads (head, then body), and the simulator's SSE stream (a chunked head, 16 events one read
each, the last chunk). Rounds alternate the order; each round prints microseconds per response and the
ratio httptools / ours, measured in this process a moment apart (so the machine's other load falls on both).
Needs `pip install httptools` (not a dependency of pd-router; aiohttp vendors its own llhttp build).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import types

import orjson

from bench.ceiling import GENERATE_BODY
from bench.contenders import REPO_ROOT
from router.dataplane.upstream_http.response import UpstreamResponse

RESPONSE_PATH = "router/dataplane/upstream_http/response.py"
HAND_WRITTEN_REV = "b4af135"  # the last revision whose legs parsed HTTP/1.1 by hand


def baseline_class(rev: str) -> type:
    """UpstreamResponse as it was at `rev`, loaded from git as a module of its own."""
    source = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{rev}:{RESPONSE_PATH}"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"response_at_{rev}")
    module.__dict__["__name__"] = module.__name__
    sys.modules[module.__name__] = module  # (dataclasses and annotations look their module up)
    exec(compile(source, f"{rev}:{RESPONSE_PATH}", "exec"), module.__dict__)
    return module.UpstreamResponse


def _content_length_wire() -> list[bytes]:
    body = orjson.dumps(GENERATE_BODY)
    head = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Thu, 03 Dec 2026 03:15:00 GMT\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
            b"\r\nConnection: keep-alive\r\n\r\n")
    return [head + body]


def _split_wire() -> list[bytes]:
    whole = _content_length_wire()[0]
    end = whole.find(b"\r\n\r\n") + 4
    return [whole[:end], whole[end:]]


def _sse_wire(tokens: int = 16) -> list[bytes]:
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\nDate: Thu, 03 Dec 2026 03:15:00 GMT\r\n"
            b"Server: Python/3.11 aiohttp/3.14.5\r\n\r\n")
    reads = [head]
    for i in range(tokens):
        event = b"data: " + orjson.dumps({"text": " tok" * (i + 1), "output_ids": list(range(i + 1)),
                                          "meta_info": {"id": "6f1d2c3b4a5e", "completion_tokens": i + 1,
                                                        "finish_reason": None}}) + b"\n\n"
        reads.append(f"{len(event):x}\r\n".encode() + event + b"\r\n")
    done = b"data: [DONE]\n\n"
    reads.append(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
    return reads


WIRES = {"content-length, 1 read": _content_length_wire, "content-length, 2 reads": _split_wire,
         "sse chunked, 18 reads": _sse_wire}


class _Transport:
    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class _Conn:
    __slots__ = ("transport", "response", "served")

    def __init__(self) -> None:
        self.transport, self.response, self.served = _Transport(), None, 0

    def close(self) -> None: ...


class _Pool:
    max_body_size = 1 << 30

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.idle = 0

    def release_slot(self) -> None: ...

    def put_idle(self, conn) -> None:
        self.idle += 1


def _run(cls, reads: list[bytes], pool: _Pool, n: int) -> float:
    """Seconds per response: n responses, each fed `reads` one by one, its body taken as a reader would."""
    t0 = time.process_time()  # CPU time: the machine's other load takes no share of it
    for _ in range(n):
        response = cls(_Conn(), pool)
        for data in reads:
            response.feed(data)
            response._chunks.clear()
        if not response._done:
            raise RuntimeError(f"{cls.__name__}: response not complete")
    return (time.process_time() - t0) / n


def check(reads: list[bytes], pool: _Pool, classes: tuple[type, type]) -> None:
    """Both read the same status, content type and body."""
    results = []
    for cls in classes:
        response = cls(_Conn(), pool)
        body = []
        for data in reads:
            response.feed(data)
            body += response._chunks
            response._chunks.clear()
        results.append((response.status, response.content_type, b"".join(body), response._done))
    if results[0] != results[1]:
        raise SystemExit(f"the two parsers disagree: {results}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--responses", type=int, default=20000, help="responses per measurement")
    parser.add_argument("--baseline-rev", default=HAND_WRITTEN_REV, help="git revision to compare against")
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    pool = _Pool(loop)
    base = baseline_class(args.baseline_rev)
    print(f"# {RESPONSE_PATH}: this checkout against {args.baseline_rev}, {args.responses} responses per "
          f"measurement, {args.rounds} rounds")
    for shape, make in WIRES.items():
        reads = make()
        check(reads, pool, (base, UpstreamResponse))
        _run(base, reads, pool, 2000)
        _run(UpstreamResponse, reads, pool, 2000)
        ratios = []
        for round_no in range(args.rounds):
            order = (base, UpstreamResponse) if round_no % 2 == 0 else (UpstreamResponse, base)
            took = {cls: _run(cls, reads, pool, args.responses) for cls in order}
            before, now = took[base], took[UpstreamResponse]
            ratios.append(now / before)
            print(f"  {shape:26s} round {round_no + 1}: {args.baseline_rev} {before * 1e6:6.2f} us  this checkout "
                  f"{now * 1e6:6.2f} us  ratio {now / before:.2f}x", flush=True)
        print(f"{shape:28s} this checkout / {args.baseline_rev}: median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}x)", flush=True)
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
