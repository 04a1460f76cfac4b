"""`abort_until_ended`, the one re-abort loop of every flow (issue 32): what it aborts, when it stops, and what
it hands back when the deadline comes first."""

from __future__ import annotations

import asyncio
import math
import time

from router.core.reabort import abort_until_ended


class Server:
    """SGLang's abort as the router meets it: a request is aborted only if it is there when the abort is; a leg
    still on the wire (`late`) reaches the server after the first abort and needs another one."""

    def __init__(self, running: set[str], late: set[str] = frozenset(), ignores_aborts: bool = False) -> None:
        self.running = set(running)
        self.late = set(late)
        self.ignores_aborts = ignores_aborts
        self.rounds: list[list[str]] = []

    def alive(self) -> list[str]:
        return sorted(self.running | self.late)

    async def abort(self, rids) -> None:
        self.rounds.append(list(rids))
        if not self.ignores_aborts:
            self.running -= set(rids)
        self.running |= self.late  # the late legs arrive just after this abort
        self.late = set()


async def test_a_request_that_reached_its_server_after_the_abort_is_aborted_again_until_it_ends():
    server = Server({"a", "b"}, late={"c"})
    async with asyncio.timeout(10):
        left = await abort_until_ended(server.alive, server.abort, math.inf)
    assert left == []
    assert server.running == set()
    assert server.rounds == [["a", "b", "c"], ["c"]]  # the second round: only what was still alive


async def test_at_the_deadline_it_returns_what_is_still_alive_each_aborted_at_least_once():
    server = Server({"a", "b"}, ignores_aborts=True)
    left = await abort_until_ended(server.alive, server.abort, time.monotonic() + 0.3)
    assert left == ["a", "b"]
    assert server.rounds and server.rounds[0] == ["a", "b"]


async def test_a_caller_that_sent_the_first_abort_is_not_aborted_for_again_when_everything_ends():
    server = Server({"a"})
    await server.abort(["a"])  # the caller's own first abort (it needs the answers)
    left = await abort_until_ended(server.alive, server.abort, math.inf, aborted_at=time.monotonic())
    assert left == []
    assert server.rounds == [["a"]]


async def test_without_an_abort_it_only_waits_for_the_end():
    ended = asyncio.Event()
    asyncio.get_running_loop().call_soon(ended.set)
    async with asyncio.timeout(10):
        left = await abort_until_ended(lambda: [] if ended.is_set() else ["a"], None, math.inf)
    assert left == []


async def test_nothing_alive_means_nothing_aborted():
    server = Server(set())
    assert await abort_until_ended(server.alive, server.abort, math.inf) == []
    assert server.rounds == []
