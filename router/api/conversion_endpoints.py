"""Admin endpoints of live role conversion.

- `POST /convert_pd_role {"server_url", ...}`: the seed design's router endpoint (converts to the opposite
  role) and `POST /pd_role_switch {"worker_url", "new_role", "drain_timeout_secs", ...}` (upstream mini_lb's
  shape). Both answer, once the flow has ended, `{"success", "message", "old_role", "new_role",
  "bootstrap_port"}` (plus `conversion_id`, `outcome`, and `error` on failure).
- `POST /admin/workers/{id}/convert {"mode", "timeout_s", ...}` answers the whole conversion record (steps
  and their durations); `"wait": false` answers 202 at once. `GET /admin/conversions[?worker=&limit=]`,
  `GET /admin/conversions/{id}`: history. `POST /admin/workers/{id}/reinstate`: a `failed` worker back into
  routing in the role its server reports.

Bodies (`conversion_bodies.py`) are validated strictly: unknown fields and wrong types are 400, every problem
reported at once.
Status codes: 200 converted, 202 started (no wait), 400 bad input, 404 unknown worker, 409 refused
(busy, not active, last routable worker of its pool), 502 the server refused or failed, 504 a deadline
passed, 500 internal error; the body's `outcome` says where the worker is now (`restored`: back in its old
pool; `failed`: out of routing until an operator acts).
"""

from __future__ import annotations

from aiohttp import web

from router.api.bodies import Empty, read_body
from router.api.conversion_bodies import ConvertPdRole, ConvertWorker, PdRoleSwitch
from router.api.workers import find_worker
from router.core.errors import BadRequest, NotFound, RouterError, json_response
from router.core.keys import REGISTRY
from router.core.registry import Worker
from router.flows.conversion import CONVERSIONS
from router.flows.conversion_record import Conversion, Plan


def worker_by_url(app: web.Application, url: str) -> Worker:
    worker = app[REGISTRY].find(url)
    if worker is None:
        raise NotFound(f"no worker {url} is registered", param="url")
    return worker


# ---- rendering ----------------------------------------------------------------------------------------
def compat_body(conversion: Conversion) -> dict:
    body = {
        "success": conversion.success,
        "message": conversion.message,
        "old_role": conversion.old_role.value,
        "new_role": conversion.new_role.value,
        "bootstrap_port": conversion.bootstrap_port,
        "conversion_id": conversion.id,
        "worker_id": conversion.worker_id,
        "outcome": conversion.outcome.value if conversion.outcome else None,
    }
    if not conversion.success and not conversion.running:
        body["error"] = {"message": conversion.message, "type": f"conversion_{conversion.outcome}",
                         "code": conversion.status}
    return body


def record_body(conversion: Conversion) -> dict:
    body = conversion.to_dict()
    if not conversion.success and not conversion.running:
        body["error"] = {"message": conversion.message, "type": f"conversion_{conversion.outcome}",
                         "code": conversion.status}
    return body


def unchanged_body(worker: Worker) -> dict:
    return {"success": True, "message": f"{worker.url} is already a {worker.role} worker: nothing to do",
            "old_role": worker.role.value, "new_role": worker.role.value, "bootstrap_port": worker.bootstrap_port,
            "conversion_id": None, "worker_id": worker.id, "outcome": "unchanged"}


async def _run_compat(request: web.Request, model: type[ConvertPdRole | PdRoleSwitch],
                      name: str) -> web.Response:
    """The mini_lb-style endpoints: errors keep their `success`/`message` shape next to `error`."""
    worker: Worker | None = None
    plan: Plan | None = None
    try:
        body = await read_body(request, model, name)
        plan = body.plan()
        worker = worker_by_url(request.app, body.url)
        conversion = await request.app[CONVERSIONS].begin(worker, plan)
        if conversion is None:
            return json_response(unchanged_body(worker))
        await conversion.wait()
        return json_response(compat_body(conversion), status=conversion.status)
    except RouterError as error:
        old = worker.role.value if worker is not None else None
        new = (plan.new_role if plan is not None and plan.new_role is not None
               else worker.role.opposite if worker is not None else None)
        return json_response({"success": False, "message": error.message, "old_role": old,
                              "new_role": new.value if new is not None else None, "bootstrap_port": None,
                              **error.body()}, status=error.status, headers=error.headers)


# ---- handlers -----------------------------------------------------------------------------------------
async def convert_pd_role(request: web.Request) -> web.Response:
    # The seed design's endpoint drives the seed design's server API where the server has it (server_patches
    # adds it to 0.5.23): its options (bootstrap_port, disable_radix_cache, ...) then reach the server.
    return await _run_compat(request, ConvertPdRole, "convert_pd_role")


async def pd_role_switch(request: web.Request) -> web.Response:
    return await _run_compat(request, PdRoleSwitch, "pd_role_switch")


async def convert_worker(request: web.Request) -> web.Response:
    worker = find_worker(request.app, request.match_info["worker_id"])
    body = await read_body(request, ConvertWorker, "convert")
    conversion = await request.app[CONVERSIONS].begin(worker, body.plan())
    if conversion is None:
        return json_response(unchanged_body(worker))
    if not body.wait:
        return json_response(record_body(conversion), status=202,
                             headers={"Location": f"/admin/conversions/{conversion.id}"})
    await conversion.wait()
    return json_response(record_body(conversion), status=conversion.status)


async def list_conversions(request: web.Request) -> web.Response:
    conversions = request.app[CONVERSIONS]
    limit_text = request.query.get("limit", "100")
    if not limit_text.isdigit() or int(limit_text) < 1:
        raise BadRequest(f"limit must be a positive integer, got {limit_text!r}", param="limit")
    records = conversions.history()
    if "worker" in request.query:
        key = request.query["worker"]
        records = [c for c in records if key in (c.worker_id, c.worker_url, c.worker_url + "/")]
    return json_response({
        "running": [c.id for c in conversions.running()],
        "conversions": [record_body(c) for c in records[: int(limit_text)]],
    })


async def get_conversion(request: web.Request) -> web.Response:
    conversion_id = request.match_info["conversion_id"]
    conversion = request.app[CONVERSIONS].get(conversion_id)
    if conversion is None:
        raise NotFound(f"unknown conversion {conversion_id!r} (history keeps the last ones only)")
    return json_response(record_body(conversion))


async def reinstate_worker(request: web.Request) -> web.Response:
    worker = find_worker(request.app, request.match_info["worker_id"])
    await read_body(request, Empty, "reinstate")
    message = await request.app[CONVERSIONS].reinstate(worker)
    return json_response({"success": True, "message": message, "worker": worker.to_dict()})


def setup(app: web.Application) -> None:
    r = app.router
    r.add_post("/convert_pd_role", convert_pd_role)
    r.add_post("/pd_role_switch", pd_role_switch)
    r.add_post("/admin/workers/{worker_id:.+}/convert", convert_worker)
    r.add_post("/admin/workers/{worker_id:.+}/reinstate", reinstate_worker)
    r.add_get("/admin/conversions", list_conversions)
    r.add_get("/admin/conversions/{conversion_id}", get_conversion)
