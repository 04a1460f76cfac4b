"""Admin view of the policies and the rebalancer.

GET /admin/policies            each pool's policy and its state, every worker's load as policies see it
GET /admin/rebalancer?limit=N  mode, config, state, counters, the last N decisions (refusals included)
GET /admin/rebalancer/recording  the observations the last decisions were made on, to replay them offline
                                (python -m bench.replay FILE)
PUT /admin/rebalancer          change the mode or any knob: {"mode": "enabled", "horizon_secs": 300, ...};
                               unknown fields -> 400, invalid values -> 422
"""

from __future__ import annotations

from aiohttp import web

from policies import effective_load
from policies.rebalance import UnknownFields
from router.api.bodies import read_json_object
from router.core.errors import BadRequest, RouterError, json_response
from router.control.load_monitor import LOAD_MONITOR
from router.core.keys import CONFIG, POLICIES, REGISTRY
from router.core.registry import Role, Worker
from router.flows.rebalancer import REBALANCER


class Unprocessable(RouterError):
    status = 422
    type = "invalid_value"


def setup(app: web.Application) -> None:
    app.router.add_get("/admin/policies", get_policies)
    app.router.add_get("/admin/rebalancer", get_rebalancer)
    app.router.add_get("/admin/rebalancer/recording", get_rebalancer_recording)
    app.router.add_put("/admin/rebalancer", put_rebalancer)


def worker_load(worker: Worker, now: float) -> dict:
    load = worker.server_load
    return {
        "id": worker.id,
        "url": worker.url,
        "routable": worker.routable,
        "inflight": worker.inflight,
        "effective_load": effective_load(worker),
        "server_load": None if load is None else {
            "running": load.running, "waiting": load.waiting, "token_usage": load.token_usage,
            "age_secs": round(now - load.taken_at, 3),
        },
    }


async def get_policies(request: web.Request) -> web.Response:
    app = request.app
    policies, registry, monitor = app[POLICIES], app[REGISTRY], app[LOAD_MONITOR]
    now = monitor.clock()
    pools = {}
    for role in Role:
        pools[role.value] = {
            "policy": policies[role].state(),
            "workers": [worker_load(w, now) for w in registry.workers(role)],
        }
    return json_response({"pools": pools, "params": _params(app[CONFIG].policy_params),
                          "load_monitor": monitor.state()})


def _params(params) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


async def get_rebalancer(request: web.Request) -> web.Response:
    raw = request.query.get("limit", "50")
    if not raw.isdigit():
        raise BadRequest(f"limit must be a non-negative integer, got {raw!r}", param="limit")
    return json_response(request.app[REBALANCER].snapshot(limit=int(raw)))


async def get_rebalancer_recording(request: web.Request) -> web.Response:
    return json_response(request.app[REBALANCER].recording())


async def put_rebalancer(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    if not body:
        raise BadRequest("give at least one field to change, e.g. {\"mode\": \"enabled\"}")
    rebalancer = request.app[REBALANCER]
    try:
        rebalancer.reconfigure(body)
    except UnknownFields as exc:
        raise BadRequest(str(exc), param=exc.names[0]) from None
    except (ValueError, TypeError) as exc:
        raise Unprocessable(str(exc)) from None
    return json_response(rebalancer.snapshot(limit=0))
