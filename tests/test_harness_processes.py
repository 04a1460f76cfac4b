"""harness/processes.py, the one process helper of the tests, benchmarks, load tests and the real-server pair:
a child that exits while waited for fails the wait with its log; stopping reaches the whole group, a child that
ignores SIGTERM included; SIGKILL ends it at once."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from harness import processes

from .helpers import wait_for

# A child that starts a grandchild in its group, says both pids, then ignores SIGTERM (as a stuck server would).
STUBBORN = ("import os, signal, subprocess, sys, time; "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('pids', os.getpid(), g.pid, flush=True); time.sleep(60)")


def _pids(child: processes.Child) -> tuple[int, int]:
    line = child.wait_until(lambda: next((l for l in child.log().splitlines() if l.startswith("pids")), None),
                            timeout=20, what="the child's pids", interval=0.02)
    _, leader, grandchild = line.split()
    return int(leader), int(grandchild)


def test_a_child_that_exits_while_waited_for_fails_the_wait_with_its_log(tmp_path):
    child = processes.start("crasher", [sys.executable, "-c", "import sys; print('bad flag: --nope'); sys.exit(3)"],
                            tmp_path / "crasher.log")
    with pytest.raises(processes.ChildExited) as caught:
        child.wait_until(lambda: False, timeout=20, what="it to serve", interval=0.02)
    assert child.returncode == 3
    assert "crasher exited with 3 while waiting for it to serve" in str(caught.value)
    assert "bad flag: --nope" in str(caught.value)


def test_a_deadline_names_what_was_waited_for(tmp_path):
    child = processes.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log")
    try:
        with pytest.raises(TimeoutError, match="the port to open: not reached within 0.2 s"):
            child.wait_until(lambda: False, timeout=0.2, what="the port to open", interval=0.02)
        assert child.alive()
    finally:
        child.kill()
    assert not child.alive() and child.returncode == -signal.SIGKILL


def test_stop_sigkills_a_group_that_ignores_sigterm_after_the_grace(tmp_path):
    child = processes.start("stubborn", [sys.executable, "-c", STUBBORN], tmp_path / "stubborn.log")
    leader, grandchild = _pids(child)
    assert leader == child.pid and processes.pid_alive(grandchild)
    child.stop(grace=0.5)
    assert child.returncode == -signal.SIGKILL  # SIGTERM was ignored: killed once its grace was over
    processes.wait_until(lambda: not processes.pid_alive(grandchild), timeout=10, what="the grandchild gone",
                         interval=0.02)


def test_kill_ends_the_whole_group_at_once(tmp_path):
    child = processes.start("stubborn", [sys.executable, "-c", STUBBORN], tmp_path / "stubborn.log")
    _, grandchild = _pids(child)
    assert processes.cpu_seconds(child.pid) is not None and processes.rss_kib(child.pid) > 0
    child.kill()
    assert child.returncode == -signal.SIGKILL
    processes.wait_until(lambda: not processes.pid_alive(grandchild), timeout=10, what="the grandchild gone",
                         interval=0.02)
    assert processes.rss_kib(child.pid) is None and processes.cpu_seconds(child.pid) is None


async def test_an_event_loop_waits_the_same_way(tmp_path):
    child = processes.start("announcer", [sys.executable, "-c", "print('ready', flush=True)"], tmp_path / "a.log")

    async def announced() -> bool:
        return "ready" in child.log()

    assert await child.await_until(announced, timeout=20, what="its line", interval=0.02)
    with pytest.raises(processes.ChildExited, match="exited with 0"):
        await child.await_until(lambda: False, timeout=20, what="more", interval=0.02)


def test_free_ports_are_distinct_and_closed():
    ports = processes.free_ports(4)
    assert len(set(ports)) == 4 and not any(processes.port_open(p) for p in ports)
    assert processes.http_status(f"http://127.0.0.1:{ports[0]}/health", timeout=1) is None


async def test_the_tests_wait_for_is_the_harness_wait_failing_the_test_at_its_deadline():
    """tests/helpers' `wait_for` is `await_until` with the tests' defaults: any awaitable condition (here a
    future) is awaited, and a condition that never holds fails the test (AssertionError naming it)."""
    looks: list[bool] = []

    def third_look_holds() -> asyncio.Future:
        looks.append(len(looks) == 2)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(looks[-1])
        return answer

    await wait_for(third_look_holds, timeout=5, interval=0.001)
    assert looks == [False, False, True]  # a future's result is what counts, not the future
    with pytest.raises(AssertionError, match="the never-true condition"):
        await wait_for(lambda: False, timeout=0.05, message="the never-true condition")


def test_a_wait_may_name_what_it_saw_at_the_deadline():
    """`what` may be a callable (the real tier's late detail), asked when the wait fails."""
    looks: list[int] = []
    with pytest.raises(TimeoutError) as failed:
        processes.wait_until(lambda: looks.append(1), timeout=0.05, interval=0.01, what=lambda: f"{len(looks)} looks")
    assert str(failed.value).startswith(f"{len(looks)} looks: not reached within")
