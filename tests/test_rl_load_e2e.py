"""What an RL trainer gets from SMG's client (`smg.rl`, smg 1.13.0) pointed at pd-router, under load: a refit
inside `paused(...)`, and an update with `abort_all_requests`, both through the selector fan-out. Every server
takes the version, no client request fails, and every answer after the update is on the new version.

Real HTTP on loopback: the router app, a simulated 2P+2D fleet, 12 clients sending requests back to back
(half of them streaming, or none where the router re-sends aborted requests), and the blocking `smg.rl`
client in a thread.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from .helpers import wait_for
from .test_weights_e2e import Load, quiet, sim_router  # noqa: F401 (the fixture)

rl_client = pytest.importorskip("smg.rl", reason="smg 1.13.0 (installed --no-deps by scripts/setup.sh)")

SELECTOR = "engine=sglang"
NEW_WEIGHTS = {"model_path": "sim/tiny-llama-v2", "weight_version": "v2"}


class UnaryLoad(Load):
    """Clients that never stream: a request the router aborts has sent the client nothing, so with
    `retry_aborted` the router can always re-send it (a stream whose tokens reached its client cannot be)."""

    async def _user(self, index: int) -> None:
        while not self._stop.is_set():
            self.answers.append(await self.router.generate())


def paused_refit(rl) -> tuple:
    with rl_client.paused(rl, SELECTOR) as pause:
        update = rl.fanout("update_weights_from_disk", NEW_WEIGHTS, selector=SELECTOR)
    return pause, update


def update_with_abort(rl) -> tuple:
    return None, rl.fanout("update_weights_from_disk", {**NEW_WEIGHTS, "abort_all_requests": True},
                           selector=SELECTOR)


@pytest.mark.parametrize("refit,retry", [
    pytest.param(paused_refit, True, id="paused-retry_aborted"),
    pytest.param(paused_refit, False, id="paused"),
    pytest.param(update_with_abort, True, id="abort_all_requests-retry_aborted"),
    pytest.param(update_with_abort, False, id="abort_all_requests"),
])
async def test_refit_through_smg_client_under_load(sim_router, refit, retry):
    router = await sim_router(2, 2, router={"weight_update_retry_aborted": retry})
    rl = rl_client.RL(str(router.http.make_url("")), timeout=60)
    load = (UnaryLoad if retry else Load)(router).start()
    await wait_for(lambda: router.inflight() >= 8 and len(load.answers) >= 12, timeout=20, message="load running")
    pause, update = await asyncio.to_thread(refit, rl)
    returned = time.monotonic()

    # every server took the version, and the fan-out says so, server by server
    assert await router.versions() == ["v2"] * 4
    assert (update.total, update.succeeded, update.failed) == (4, 4, [])
    assert sorted(update.results) == sorted(w.id for w in router.registry.workers())
    assert {(r.status, r.body["weight_version"], r.body["routable"]) for r in update.results.values()} == \
        {(200, "v2", True)}
    if pause is not None:
        assert (pause.total, pause.succeeded) == (4, 4)

    await wait_for(lambda: sum(a.sent > returned for a in load.answers) >= 12, timeout=20,
                   message="requests after the update")
    answers = await load.finish()
    assert [a for a in answers if a.outcome == "error"] == [], "no request failed, hung or lost its connection"
    after = [a for a in answers if a.ended > returned and a.outcome == "complete"]
    assert after and {a.weight_version for a in after} == {"v2"}, "every later answer on the new version"
    aborted = [a for a in answers if a.outcome == "abort"]
    if retry:
        assert aborted == [], "the router re-sent every request it aborted"
    else:  # SGLang's own answer to an aborted request: a clean abort, not a failure
        assert all(a.weight_version in (None, "default") for a in aborted)
    ops = (await router.call("/weight_updates", method="GET"))[1]["history"]
    assert all(op["state"] == "succeeded" for op in ops)
    if retry:
        assert sum(op["aborted_requests"] for op in ops) > 0, "requests were in flight and got aborted"
    await quiet(router)
    assert router.admission.is_open and router.admission.active == 0
