"""A pd-router process for wire-level probes: bytes on a socket, the answer as the client reads it.

One process serves a whole test module (started once, killed at the end): the probes need only the router's
own HTTP handling, which runs before any worker is chosen, so it has no workers. What it logged is kept, so
a test can check that a probe left no traceback behind.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import orjson

from harness import processes

from ..helpers import free_port

START_TIMEOUT_S = 30.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return orjson.loads(self.body)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0]


class WireRouter:
    """`python -m router` on a free loopback port, started and waited for synchronously."""

    def __init__(self, log_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(self.port),
                     "--log-level", "info", *flags]
        self.proc: subprocess.Popen | None = None
        self.child: processes.Child | None = None

    def start(self) -> "WireRouter":
        self.child = processes.start("the router", self.argv, self.log_path)
        self.proc = self.child.popen

        def serves() -> bool:
            try:
                return bool(self.exchange(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", timeout=1).status)
            except OSError:
                return False

        try:
            self.child.wait_until(serves, timeout=START_TIMEOUT_S, what="the router to serve", interval=0.05)
        except processes.ChildExited:
            raise AssertionError(f"the router exited with {self.proc.returncode}:\n{self.log()}") from None
        except TimeoutError:
            self.stop()
            raise AssertionError(f"the router did not serve within {START_TIMEOUT_S} s:\n{self.log()}") from None
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.kill()

    def log(self) -> str:
        return self.child.log()

    def exchange(self, data: bytes, timeout: float = 5.0, chunks: list[bytes] | None = None) -> Answer:
        """Send `data` (then each of `chunks`) on a new connection and read one answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(data)
            for chunk in chunks or ():
                sock.sendall(chunk)
            return read_answer(sock.makefile("rb"))


def read_answer(stream) -> Answer:
    status_line = stream.readline()
    if not status_line:
        raise ConnectionError("the connection closed without an answer")
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(stream.readline().strip() or b"0", 16)):
            body += stream.read(size)
            stream.readline()
    else:
        body = stream.read(int(headers.get("content-length", 0)))
    return Answer(int(status_line.split()[1]), headers, body)


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"]
    if body and "Content-Length" not in headers:
        headers["Content-Length"] = str(len(body))
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
