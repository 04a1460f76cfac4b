"""The composition root's two steps: `build` makes every object and starts nothing (the unit tier's guard
refuses a socket; no task may appear), and the objects come wired by their constructors."""

from __future__ import annotations

import asyncio
import contextlib

from policies.rebalance_config import RebalanceMode
from router.control.health import HEALTH
from router.core.config import RebalanceConfig, RouterConfig, WorkerSpec
from router.core.keys import LIFECYCLE, REGISTRY
from router.dataplane.proxy import PROXY
from router.flows.rebalancer import REBALANCER
from router.obs import logs
from router.obs.metrics import METRICS
from router.server.app import create_app
from router.server.composition import build


async def test_build_starts_nothing_and_passes_every_observer_in():
    config = RouterConfig(prefill=(WorkerSpec("http://127.0.0.1:9", 8998),),
                          decode=(WorkerSpec("http://127.0.0.1:10"),),
                          rebalance=RebalanceConfig(mode=RebalanceMode.ENABLED)).validated()
    app = create_app(config)
    before = asyncio.all_tasks()
    async with contextlib.AsyncExitStack() as stack:
        built = build(app, stack)
        assert asyncio.all_tasks() == before
        assert not app[REGISTRY].workers()  # the command line's workers are registered by `start`
        assert not app[LIFECYCLE].fleet_read and not app[REBALANCER].leading()  # no decision on an unread fleet

        proxy, rebalancer = app[PROXY], app[REBALANCER]
        assert proxy.dispatcher.leg_observers == (app[HEALTH].on_leg,)
        assert proxy.request_observers == (rebalancer.window.observe, app[METRICS].observe_request, logs.log_request)
        assert proxy.arrival_observers == (rebalancer.window.arrived,)
        # one of each collaborator, shared by the proxy, its dispatcher and what the flows see of it
        assert proxy.dispatcher.room is proxy.leg_room and proxy.dispatcher.pd_admission is proxy.pd_admission is None
        assert built.health is app[HEALTH] and built.legs is proxy.dispatcher.upstream
