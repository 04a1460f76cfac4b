"""`PUT /workers/{id}` and `PATCH /workers/{id}` (SMG 1.13's replacement and update of a worker; sgl-router
0.3.2's `WorkerUpdateRequest` fields too): one handler, a body of the fields to change.

The body is a worker entry (core/worker_entry.py: the fields of `POST /workers`, the peers' included), its `url`
optional (given, it must name the same worker). What pd-router acts on:
- `worker_type` other than the worker's role: a live role conversion (the conversion flow, as
  `POST /admin/workers/{id}/convert` with its defaults; the answer waits for it and carries its record);
- `bootstrap_port` on a prefill: the port the router sends to decode from now on (SGLang cannot change the
  port a running server listens on: this corrects what the router was told or read);
- `labels`, `priority`, `cost`, `api_key` (SMG's PATCH fields): kept on the worker, as `POST /workers` keeps
  them (its api_key sent to it from the next call on).
Every other field is accepted with no effect and named in `ignored_fields`, as for `POST /workers`.
"""

from __future__ import annotations

from aiohttp import web

from router.api.bodies import read_json_object
from router.api.conversion_endpoints import record_body
from router.api.conversion_bodies import ConvertWorker
from router.api.workers import entry_of, find_worker
from router.core.config import DISCOVER
from router.core.errors import BadRequest, json_response
from router.core.keys import REGISTRY
from router.core.registry import Role
from router.core.worker_url import identity
from router.flows.conversion import CONVERSIONS
from router.flows.worker_lifecycle import WORKER_LIFECYCLE


async def update_worker(request: web.Request) -> web.Response:
    app = request.app
    worker = find_worker(app, request.match_info["worker_id"])
    data = dict(await read_json_object(request))
    given_url = data.setdefault("url", worker.url)
    entry = entry_of(data)
    if identity(entry.address) != identity(worker.url):
        raise BadRequest(f"url {identity(given_url)} is not worker {worker.id} ({worker.url}): a worker's URL is "
                         f"its identity (remove it and add the other)", param="url")
    body: dict = {"success": True}
    port = entry.bootstrap_port_of(null_means=None)
    if port is not DISCOVER and port != worker.bootstrap_port:
        if worker.role is not Role.PREFILL or entry.given_role is Role.DECODE:
            raise BadRequest("bootstrap_port: only a prefill has one", param="bootstrap_port")
        app[REGISTRY].update_info(worker, bootstrap_port=port)
    if entry.settings:
        app[WORKER_LIFECYCLE].apply_settings(worker, entry.settings)
    role = entry.given_role
    if role is not None and role is not worker.role:
        conversion = await app[CONVERSIONS].begin(worker, ConvertWorker(new_role=role.value).plan())
        if conversion is not None:
            await conversion.wait()
            body.update(success=conversion.status == 200, conversion=record_body(conversion))
            status = conversion.status
        else:
            status = 200
    else:
        status = 200
    body.update(message=f"worker {worker.id} updated", worker_id=worker.id, worker=worker.to_dict())
    if entry.ignored:
        body["ignored_fields"] = list(entry.ignored)
    return json_response(body, status=status)


def setup(app: web.Application) -> None:
    app.router.add_put("/workers/{worker_id:.+}", update_worker)
    app.router.add_patch("/workers/{worker_id:.+}", update_worker)
