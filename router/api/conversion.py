"""Admin endpoints of live role conversion.

- `POST /convert_pd_role {"server_url", ...}`: the seed design's router endpoint (converts to the opposite
  role) and `POST /pd_role_switch {"worker_url", "new_role", "drain_timeout_secs", ...}` (upstream mini_lb's
  shape). Both answer, once the flow has ended, `{"success", "message", "old_role", "new_role",
  "bootstrap_port"}` (plus `conversion_id`, `outcome`, and `error` on failure).
- `POST /admin/workers/{id}/convert {"mode", "timeout_s", ...}` answers the whole conversion record (steps
  and their durations); `"wait": false` answers 202 at once. `GET /admin/conversions[?worker=&limit=]`,
  `GET /admin/conversions/{id}`: history. `POST /admin/workers/{id}/reinstate`: a `failed` worker back into
  routing in the role its server reports.

Bodies are validated strictly: unknown fields and wrong types are 400, every problem reported at once.
Status codes: 200 converted, 202 started (no wait), 400 bad input, 404 unknown worker, 409 refused
(busy, not active, last routable worker of its pool), 502 the server refused or failed, 504 a deadline
passed, 500 internal error; the body's `outcome` says where the worker is now (`restored`: back in its old
pool; `failed`: out of routing until an operator acts).
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web

from router.api.workers import find_worker, read_json_object
from router.core.config import validate_port, validate_worker_url
from router.core.errors import BadRequest, NotFound, RouterError, json_response
from router.core.keys import ADMISSION, CONFIG, METRICS, REGISTRY, TASKS, UPSTREAM
from router.core.registry import Role, Worker
from router.flows.conversion import CONVERT_PD_ROLE, SERVER_OPTIONS, Conversion, Conversions, Mode, Plan

CONVERSIONS = web.AppKey("conversions", Conversions)

Check = Callable[[Any], "str | None"]  # a problem with the value, or None


# ---- value checks ---------------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_number(value: Any) -> str | None:
    return None if _is_number(value) and value > 0 else f"must be a positive number, got {value!r}"


def non_negative_number(value: Any) -> str | None:
    return None if _is_number(value) and value >= 0 else f"must be a non-negative number, got {value!r}"


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def positive_int_list(value: Any) -> str | None:
    ok = isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                   for v in value)
    return None if ok else f"must be a non-empty list of positive integers, got {value!r}"


def json_object(value: Any) -> str | None:
    return None if isinstance(value, dict) else f"must be a JSON object, got {value!r}"


def port(value: Any) -> str | None:
    return validate_port(value, "it")


def worker_url(value: Any) -> str | None:
    return validate_worker_url(value)


def one_of(*allowed: str) -> Check:
    def check(value: Any) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}, got {value!r}"
    return check


SERVER_OPTION_CHECKS: dict[str, Check] = {
    "decode_cuda_graph_bs": positive_int_list,
    "decode_cuda_graph_memory_gb": non_negative_number,
    "bootstrap_port": port,
    "disable_radix_cache": boolean,
    "disable_cuda_graph": boolean,
}
assert SERVER_OPTION_CHECKS.keys() == SERVER_OPTIONS.keys()

ROLE = one_of("prefill", "decode")
MODE = one_of(*(m.value for m in Mode))

CONVERT_PD_ROLE_FIELDS: dict[str, Check] = {
    "server_url": worker_url, "mode": MODE, "drain_timeout_secs": positive_number,
    "switch_timeout_secs": positive_number, "server_options": json_object, **SERVER_OPTION_CHECKS,
}
PD_ROLE_SWITCH_FIELDS: dict[str, Check] = {
    "worker_url": worker_url, "new_role": ROLE, "mode": MODE, "drain_timeout_secs": positive_number,
    "switch_timeout_secs": positive_number, "server_options": json_object, **SERVER_OPTION_CHECKS,
}
CONVERT_FIELDS: dict[str, Check] = {
    "mode": MODE, "new_role": ROLE, "timeout_s": positive_number, "switch_timeout_s": positive_number,
    "verify_timeout_s": positive_number, "wait": boolean, "server_options": json_object, **SERVER_OPTION_CHECKS,
}


def validated(body: dict, schema: dict[str, Check], required: tuple[str, ...] = ()) -> dict:
    """The body's fields (null meaning absent), or 400 listing every problem."""
    problems = []
    unknown = sorted(set(body) - set(schema))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)} (accepted: {', '.join(sorted(schema))})")
    for name in required:
        if body.get(name) is None:
            problems.append(f"{name} is required")
    fields = {}
    for name, check in schema.items():
        value = body.get(name)
        if value is None:
            continue
        problem = check(value)
        if problem is not None:
            problems.append(f"{name} {problem}")
        fields[name] = value
    if problems:
        raise BadRequest("; ".join(problems), problems=problems)
    return fields


def make_plan(fields: dict, *, timeout_field: str, switch_field: str, api: str | None = None) -> Plan:
    return Plan(
        mode=Mode(fields.get("mode", Mode.DRAIN.value)),
        new_role=Role(fields["new_role"]) if "new_role" in fields else None,
        empty_timeout_s=fields.get(timeout_field),
        switch_timeout_s=fields.get(switch_field),
        verify_timeout_s=fields.get("verify_timeout_s"),
        server_options={k: v for k, v in fields.items() if k in SERVER_OPTIONS},
        raw_server_options=dict(fields.get("server_options") or {}),
        api=api,
    )


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


async def _run_compat(request: web.Request, schema: dict[str, Check], url_field: str,
                      required: tuple[str, ...], api: str | None = None) -> web.Response:
    """The mini_lb-style endpoints: errors keep their `success`/`message` shape next to `error`."""
    worker: Worker | None = None
    fields: dict = {}
    try:
        body = await read_json_object(request)
        fields = validated(body, schema, required)
        worker = worker_by_url(request.app, fields[url_field])
        plan = make_plan(fields, timeout_field="drain_timeout_secs", switch_field="switch_timeout_secs", api=api)
        conversion = request.app[CONVERSIONS].start(worker, plan)
        if conversion is None:
            return json_response(unchanged_body(worker))
        await conversion.wait()
        return json_response(compat_body(conversion), status=conversion.status)
    except RouterError as error:
        old = worker.role.value if worker is not None else None
        new = fields.get("new_role") or (worker.role.opposite.value if worker is not None else None)
        return json_response({"success": False, "message": error.message, "old_role": old, "new_role": new,
                              "bootstrap_port": None, **error.body()}, status=error.status, headers=error.headers)


# ---- handlers -----------------------------------------------------------------------------------------
async def convert_pd_role(request: web.Request) -> web.Response:
    # The seed design's endpoint drives the seed design's server API where the server has it (server_patches
    # adds it to 0.5.23): its options (bootstrap_port, disable_radix_cache, ...) then reach the server.
    return await _run_compat(request, CONVERT_PD_ROLE_FIELDS, "server_url", ("server_url",), api=CONVERT_PD_ROLE)


async def pd_role_switch(request: web.Request) -> web.Response:
    return await _run_compat(request, PD_ROLE_SWITCH_FIELDS, "worker_url", ("worker_url", "new_role"))


async def convert_worker(request: web.Request) -> web.Response:
    worker = find_worker(request.app, request.match_info["worker_id"])
    fields = validated(await read_json_object(request), CONVERT_FIELDS)
    plan = make_plan(fields, timeout_field="timeout_s", switch_field="switch_timeout_s")
    conversion = request.app[CONVERSIONS].start(worker, plan)
    if conversion is None:
        return json_response(unchanged_body(worker))
    if not fields.get("wait", True):
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
    validated(await read_json_object(request), {})
    message = await request.app[CONVERSIONS].reinstate(worker)
    return json_response({"success": True, "message": message, "worker": worker.to_dict()})


def _metrics_observer(metrics):
    def observe(event: str, conversion: Conversion, details: dict) -> None:
        if event == "finished":
            metrics.observe_conversion(conversion.outcome.value, conversion.duration_s or 0.0)
        elif event == "abort_all":
            metrics.observe_abort("conversion", details.get("inflight", 0))
    return observe


async def _conversions_ctx(app: web.Application):
    config, admission = app[CONFIG], app[ADMISSION]

    def fleet_busy() -> str | None:
        if admission.is_open:
            return None
        return (f"the fleet is held ({', '.join(admission.state()['holds'])}): convert once that operation "
                f"has ended")

    conversions = Conversions(app[REGISTRY], app[UPSTREAM], app[TASKS].spawn,
                              drain_timeout_s=config.drain_timeout_secs,
                              switch_timeout_s=config.switch_timeout_secs, fleet_busy=fleet_busy)
    app[CONVERSIONS] = conversions
    if METRICS in app:
        conversions.observers.append(_metrics_observer(app[METRICS]))
    yield
    await conversions.close()


def setup(app: web.Application) -> None:
    """Call after the session context is registered (the flows use its upstream client)."""
    app.cleanup_ctx.append(_conversions_ctx)
    r = app.router
    r.add_post("/convert_pd_role", convert_pd_role)
    r.add_post("/pd_role_switch", pd_role_switch)
    r.add_post("/admin/workers/{worker_id:.+}/convert", convert_worker)
    r.add_post("/admin/workers/{worker_id:.+}/reinstate", reinstate_worker)
    r.add_get("/admin/conversions", list_conversions)
    r.add_get("/admin/conversions/{conversion_id}", get_conversion)
