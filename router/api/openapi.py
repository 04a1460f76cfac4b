"""`GET /openapi.json`: the router's own HTTP API as an OpenAPI 3.1 document, built from what the router runs.

Every route the app registers is in it (the route table is read when the document is first asked for, so
an endpoint added later is documented without anyone remembering to), with its access class (public,
generation, admin: the bearer key it needs under this configuration), its path parameters, the query
parameters it reads, and its request body: the admin bodies' own pydantic models (strict: what is refused
there is refused here), the worker API's and the generation routes' bodies as declared below (the fields
the router reads or judges, `router/core/request_fields.py`; other fields go to the servers as sent). Every
error is `{"error": {"message", "type", "code", ...}}`. Public: operators and client generators read it,
and the hostile-client suite fuzzes the router with it (schemathesis, tests/hostile/).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from router.api.access import classify, required_keys
from router.api.bodies import Body, Empty
from router.api.control_bodies import (BROADCAST_BODIES, UPDATE_BODIES, AbortRequest, ContinueGeneration,
                                       InitUpdateGroup, PauseGeneration, ReleaseMemory, ResumeMemory)
from router.api.conversion_bodies import ConvertPdRole, ConvertWorker, PdRoleSwitch
from router.core.errors import json_response
from router.core.keys import CONFIG

TITLE = "pd-router"
_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")


class _Forwarded(BaseModel):
    """A body forwarded to the servers: fields the router does not judge pass as they are."""

    model_config = ConfigDict(extra="allow")


Texts = list[str]
TokenIds = list[int]


_RANK = "a DP rank of the servers (docs/DP_RANKS.md): 400 when out of their range, before any server is called"


class _Ranked(_Forwarded):
    """The DP rank fields a client may send (0.5.23's), judged by the router."""

    routed_dp_rank: int | None = Field(None, ge=0, description=_RANK + "; both legs")
    data_parallel_rank: int | None = Field(None, ge=0, description="routed_dp_rank's older name")
    disagg_prefill_dp_rank: int | None = Field(None, ge=0, description=_RANK + "; the prefill's rank")


class GenerateRequest(_Ranked):
    """SGLang's native /generate: one of text, input_ids (or input_embeds)."""

    text: str | Texts | None = Field(None, description="a prompt, or a non-empty list of prompts")
    input_ids: TokenIds | list[TokenIds] | None = Field(None, description="token ids, or one non-empty list per "
                                                                          "prompt")
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None, description="SGLang's sampling parameters (n at most --max-n; max_new_tokens a non-negative "
                          "integer or null), or one object per prompt")
    rid: str | Texts | None = Field(None, description="a request id, or one per prompt")
    stream: bool | None = None
    return_logprob: bool | list[bool] | None = None


class CompletionRequest(_Ranked):
    """OpenAI's completions."""

    prompt: str | Texts | TokenIds | list[TokenIds] = Field(..., description="a prompt, prompts, or token ids")
    n: int | None = Field(None, ge=1, description="at most --max-n")
    max_tokens: int | None = Field(None, ge=0)
    stream: bool | None = None
    rid: str | Texts | None = None


class ChatMessage(_Forwarded):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Ranked):
    """OpenAI's chat completions."""

    messages: list[ChatMessage]
    n: int | None = Field(None, ge=1, description="at most --max-n")
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    stream: bool | None = None
    rid: str | Texts | None = None


class _WorkerEntry(BaseModel):
    """A worker-entry body (router/core/worker_entry.py: unknown fields are refused)."""

    model_config = ConfigDict(extra="forbid")


class WorkerRegistration(_WorkerEntry):
    """sgl-router's and SMG's `POST /workers`."""

    url: str = Field(..., description="http(s)://host:port of a SGLang server (never a pd-router)")
    worker_type: Literal["prefill", "decode"] | None = Field(None, description="absent: the server's live role")
    role: Literal["prefill", "decode"] | None = Field(None, description="worker_type's other name (both: agreeing)")
    bootstrap_port: int | None = Field(None, ge=1, le=65535, description="absent or null: the server's own")
    api_key: str | None = Field(None, description="sent to this worker alone (never shown: GET /workers says "
                                                  "api_key_set)")
    labels: dict[str, str] | None = Field(None, description="stored and shown in GET /workers")
    priority: int | None = Field(None, description="stored and shown (no policy weighs it)")
    cost: float | None = Field(None, description="stored and shown (no policy weighs it)")


class MiniLbRegistration(_WorkerEntry):
    """mini_lb's `POST /register` (servers started with --pdlb-url)."""

    mode: Literal["prefill", "decode"]
    registry_url: str
    bootstrap_port: int | None = Field(None, ge=1, le=65535, description="required for prefill, null for decode")


class EngineCall(_Forwarded):
    """A SGLang engine call relayed as it is (SMG's RL control plane)."""


BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/generate"): GenerateRequest,
    ("POST", "/v1/completions"): CompletionRequest,
    ("POST", "/v1/chat/completions"): ChatCompletionRequest,
    ("POST", "/workers"): WorkerRegistration,
    ("POST", "/register"): MiniLbRegistration,
    ("POST", "/abort_request"): AbortRequest,
    ("POST", "/pause_generation"): PauseGeneration,
    ("POST", "/continue_generation"): ContinueGeneration,
    ("POST", "/init_weights_update_group"): InitUpdateGroup,
    ("POST", "/release_memory_occupation"): ReleaseMemory,
    ("POST", "/resume_memory_occupation"): ResumeMemory,
    ("POST", "/weight_updates/rejoin"): Empty,
    ("POST", "/convert_pd_role"): ConvertPdRole,
    ("POST", "/pd_role_switch"): PdRoleSwitch,
    ("POST", "/admin/workers/{worker_id}/convert"): ConvertWorker,
    ("POST", "/admin/workers/{worker_id}/reinstate"): Empty,
    ("POST", "/v1/rl/engine/{path}"): EngineCall,
    ("POST", "/v1/rl/workers/{worker_id}/engine/{path}"): EngineCall,
    **{("POST", "/" + kind): model for kind, model in UPDATE_BODIES.items()},
    **{("POST", "/" + name): model for name, model in BROADCAST_BODIES.items()},
}
QUERIES: dict[tuple[str, str], dict[str, dict]] = {
    ("POST", "/add_worker"): {"url": {"type": "string"}, "worker_type": {"enum": ["prefill", "decode"]},
                              "role": {"enum": ["prefill", "decode"]},
                              "bootstrap_port": {"type": "integer", "minimum": 1, "maximum": 65535}},
    ("POST", "/remove_worker"): {"url": {"type": "string"}},
    ("POST", "/flush_cache"): {"timeout": {"type": "number", "minimum": 0}},
    ("GET", "/flush_cache"): {"timeout": {"type": "number", "minimum": 0}},
}
REQUIRED_QUERIES = {("POST", "/add_worker"): ("url",), ("POST", "/remove_worker"): ("url",)}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {},
                   "param": {"type": ["string", "null"]}}}}}


def openapi_path(canonical: str) -> str:
    """aiohttp's `/workers/{worker_id:.+}` as OpenAPI writes it: `/workers/{worker_id}`."""
    return _PARAM.sub(lambda m: "{" + m.group(1) + "}", canonical)


# What each route does, for the routes whose handler is shared or says nothing of itself (its docstring wins
# where it has one): the document's `summary`, and so the docs' HTTP reference.
SUMMARIES: dict[tuple[str, str], str] = {
    ("GET", "/health"): "200 when each pool has a routable worker, else 503, with the pools' counts",
    ("GET", "/health_generate"): "a generation on every worker, one fan-out at a time; non-2xx if any failed",
    ("GET", "/flush_cache"): "flush every worker's cache; per-worker outcomes, non-2xx if any failed",
    ("POST", "/flush_cache"): "flush every worker's cache; per-worker outcomes, non-2xx if any failed",
    ("GET", "/get_server_info"): "every worker's /server_info, fetched concurrently (mini_lb's shape), secrets redacted",
    ("GET", "/server_info"): "every worker's /server_info, fetched concurrently (mini_lb's shape), secrets redacted",
    ("GET", "/model_info"): "a worker's model info, with the fleet's live weight version",
    ("GET", "/get_model_info"): "a worker's model info, with the fleet's live weight version",
    ("GET", "/v1/models"): "the models, from a worker",
    ("GET", "/liveness"): "200 OK while the process serves, fleet up or not",
    ("GET", "/readiness"): "200 while each pool has a routable worker, else 503 (insufficient healthy workers, draining)",
    ("GET", "/get_loads"): "every worker's load report, read now",
    ("GET", "/engine_metrics"): "every worker's /metrics in one exposition, labelled worker_addr",
    ("GET", "/workers"): "the workers: role, state, health, breaker, in-flight, bootstrap port, weight version",
    ("POST", "/workers"): "register a worker (sgl-router's and SMG's body); its live role and port are read",
    ("GET", "/workers/{worker_id}"): "one worker",
    ("DELETE", "/workers/{worker_id}"): "remove a worker: no new request goes to it, those it has finish",
    ("PUT", "/workers/{worker_id}"): "change a worker's settings (api_key, labels, priority, cost); a role change is a conversion",
    ("PATCH", "/workers/{worker_id}"): "change a worker's settings (api_key, labels, priority, cost); a role change is a conversion",
    ("POST", "/add_worker"): "register a worker (query parameters url, role or worker_type, bootstrap_port)",
    ("POST", "/remove_worker"): "remove a worker by URL",
    ("GET", "/list_workers"): "the workers' URLs",
    ("POST", "/convert_pd_role"): "convert a server to the opposite role (or new_role); answers when done",
    ("POST", "/pd_role_switch"): "convert a server to new_role (mini_lb's shape); answers when done",
    ("POST", "/admin/workers/{worker_id}/convert"): "convert a worker: mode, deadlines; the whole record with its steps",
    ("POST", "/admin/workers/{worker_id}/reinstate"): "put a failed worker back in the role its server reports, once healthy and on the fleet's version",
    ("GET", "/admin/conversions"): "the conversions, newest first, each step with its duration",
    ("GET", "/admin/conversions/{conversion_id}"): "one conversion's record",
    ("GET", "/admin/health"): "each worker's probe state, breaker phase and counts; the router's warnings",
    ("GET", "/admin/policies"): "each pool's policy state, every worker's load as the policies see it",
    ("GET", "/admin/rebalancer"): "the rebalancer: mode, config, counters, the last decisions with the model's reading",
    ("GET", "/admin/rebalancer/recording"): "the observations the last decisions were made on, with the decisions "
                                            "and the conversions' ends: `python -m bench.replay FILE` replays them",
    ("PUT", "/admin/rebalancer"): "change the rebalancer's mode or any knob, live (unknown: 400, invalid: 422)",
    ("GET", "/metrics"): "Prometheus metrics",
    ("POST", "/abort_request"): "abort one request (by rid) or all, on both their servers; answers once they ended",
    ("POST", "/pause_generation"): "pause the whole fleet (abort, retract or in_place), holding new requests",
    ("POST", "/continue_generation"): "continue the whole fleet and release held requests",
    ("POST", "/update_weights_from_disk"): "update every server from disk: hold, quiesce or abort, update, verify, release",
    ("POST", "/update_weights_from_distributed"): "update every server over NCCL: hold, quiesce or abort, update, verify, release",
    ("POST", "/update_weights_from_tensor"): "update every server from tensors: hold, quiesce or abort, update, verify, release",
    ("POST", "/update_weight_version"): "relabel every server's weight version",
    ("POST", "/init_weights_update_group"): "open the NCCL group on every server, each with ranks of its own",
    ("POST", "/destroy_weights_update_group"): "close the NCCL group on every server",
    ("POST", "/begin_weight_update"): "open a weight-update session on every server (many bucket calls, one session)",
    ("POST", "/end_weight_update"): "close the weight-update session on every server",
    ("GET", "/release_memory_occupation"): "release every server's GPU memory (colocated training)",
    ("POST", "/release_memory_occupation"): "release every server's GPU memory (colocated training)",
    ("GET", "/resume_memory_occupation"): "take every server's GPU memory back",
    ("POST", "/resume_memory_occupation"): "take every server's GPU memory back",
    ("GET", "/get_weight_version"): "the weight version the routable servers agree on, and each server's",
    ("GET", "/weight_version"): "the weight version the routable servers agree on, and each server's",
    ("GET", "/weight_updates"): "the fleet operations: version, pause, left-out servers, current, last, history",
    ("GET", "/weight_updates/{op_id}"): "one fleet operation with its steps",
    ("GET", "/v1/rl/workers"): "SMG's RL discovery rows, one per server",
    ("GET", "/v1/rl/workers/{worker_id}"): "one server's SMG RL row",
    ("GET", "/v1/rl/engine/{path}"): "SMG's RL fan-out to the selected servers; fleet operations run as the router's",
    ("POST", "/v1/rl/engine/{path}"): "SMG's RL fan-out to the selected servers; fleet operations run as the router's",
    ("POST", "/v1/rl/engine/update_weights_from_tensor"): "SMG's RL fan-out of a tensor update (bound by --max-payload-size)",
    ("GET", "/admin/replica"): "the router replica that answered: id, pid, index, connections accepted",
    ("GET", "/admin/cluster"): "the cluster's replicas, their leases, running operations and etcd's health",
}


def _summary(handler: Any, model: type[BaseModel] | None, method: str, path: str) -> str:
    """The handler's docstring, else the line above, else the body model's docstring, else the handler's name."""
    for doc in ((getattr(handler, "__doc__", None) or "").strip(), SUMMARIES.get((method, path), ""),
                (model.__doc__ or "").strip() if model else ""):
        if doc:
            return " ".join(doc.split("\n\n")[0].split())[:200]
    return getattr(handler, "__name__", "").replace("_", " ")


def build_document(app: web.Application) -> dict:
    config = app[CONFIG]
    schemas: dict[str, dict] = {"Error": ERROR}

    def schema_of(model: type[BaseModel]) -> dict:
        found = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(found.pop("$defs", {}))
        schemas[model.__name__] = found
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    paths: dict[str, dict] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        canonical = route.resource.canonical
        path = openapi_path(canonical)
        method = route.method
        access = classify(canonical)
        model = BODIES.get((method, path))
        operation: dict[str, Any] = {
            "operationId": method.lower() + "_" + re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_"),
            "summary": _summary(route.handler, model, method, path),
            "tags": [access.value],
            "responses": {"200": {"description": "done (the route's own answer)"},
                          "4XX": {"description": "the request's fault",
                                  "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
                          "5XX": {"description": "the servers' or the fleet's state",
                                  "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
        }
        parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
                      for name in _PARAM.findall(canonical)]
        for name, schema in QUERIES.get((method, path), {}).items():
            parameters.append({"name": name, "in": "query", "schema": schema,
                               "required": name in REQUIRED_QUERIES.get((method, path), ())})
        if parameters:
            operation["parameters"] = parameters
        if model is not None:
            required = not issubclass(model, Body) or bool(model.model_json_schema().get("required"))
            operation["requestBody"] = {"required": required,
                                        "content": {"application/json": {"schema": schema_of(model)}}}
        if required_keys(access, config):
            operation["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": TITLE, "version": _version(),
                 "description": "A router for SGLang prefill/decode disaggregation (README.md)."},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pd-router")
    except Exception:  # run from a checkout that is not installed
        return "0"


def setup(app: web.Application) -> None:
    document: dict = {}

    async def openapi_document(request: web.Request) -> web.Response:
        """This API, as an OpenAPI 3.1 document."""
        if not document:  # built once, from the route table as it serves (frozen by then)
            document.update(build_document(request.app))
        return json_response(document)

    app.router.add_get("/openapi.json", openapi_document)
