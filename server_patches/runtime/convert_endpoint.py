"""`POST /convert_pd_role` on SGLang's own HTTP app: the seed design's conversion API over the in-place switch.

Validation and planning are pure (server_patches.convert_contract); this module only reads the server's live
state, calls the tokenizer manager's pd_role_switch (the same call /pd_role_switch makes), and checks with the
schedulers that the role really changed: a switch to the role a server already has answers "ok" too.
`GET /convert_pd_role` shows the conversion in progress, if any (a second POST meanwhile is refused with 409).
"""

# No `from __future__ import annotations` here: FastAPI must see the real Request class on the handler.
import asyncio
import time
import types
from http import HTTPStatus

from .. import convert_contract as contract
from .base import Patch, PatchRefused, Settings, require_attrs, require_fields, require_params
from .hooks import PostImportHooks
from .prefix_cache import NAME as PREFIX_CACHE_PATCH, radix_cache_disabled_in

NAME = "convert_pd_role"
SGLANG_VERSIONS = frozenset({"0.5.23"})
HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"
ROUTE = "/convert_pd_role"
# Upstream's refusal while requests are running or queued (role_switch.handle_pd_role_switch).
NOT_IDLE_MARKER = "not idle"
IDLE_POLL_S = 0.1


def _install(settings: Settings, hooks: PostImportHooks) -> None:
    prefix_cache_patched = PREFIX_CACHE_PATCH not in settings.disabled

    def patch(http_server: types.ModuleType) -> None:
        _add_route(http_server, prefix_cache_patched)

    hooks.after(HTTP_SERVER_MODULE, patch)


def _check_shapes(http_server: types.ModuleType) -> None:
    from sglang.srt.managers.io_struct import PdRoleSwitchReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    require_attrs(NAME, http_server, ["app", "get_global_state", "ORJSONResponse"])
    require_fields(NAME, PdRoleSwitchReqInput, ["new_role", "decode_cuda_graph_memory_gb", "decode_cuda_graph_bs"])
    require_attrs(NAME, TokenizerManager, ["pd_role_switch", "get_internal_state"])
    require_params(NAME, TokenizerManager.pd_role_switch, ["self", "obj", "request"])
    require_params(NAME, TokenizerManager.get_internal_state, ["self"])
    if any(getattr(r, "path", None) == ROUTE for r in http_server.app.router.routes):
        raise PatchRefused(NAME, f"SGLang already serves {ROUTE}; this patch would shadow it")


def _add_route(http_server: types.ModuleType, prefix_cache_patched: bool) -> None:
    _check_shapes(http_server)
    import orjson
    from fastapi import Request

    from sglang.srt.managers.io_struct import PdRoleSwitchReqInput
    from sglang.srt.runtime_context import get_disagg, get_memory
    from sglang.srt.utils.auth import AuthLevel, auth_level

    respond = http_server.ORJSONResponse
    # The conversion in progress, if any; set and cleared without an await in between checks (one event loop),
    # so a second request sees it at once: refused with 409 rather than queued (it would flip the role back).
    in_progress: dict = {}

    async def live_roles(tm) -> list[str]:
        return [str(s.get("disaggregation_mode")) for s in await tm.get_internal_state()]

    def server_view(tm, role: str) -> contract.ServerView:
        launch_role = str(tm.server_args.disaggregation_mode)
        return contract.ServerView(
            role=role,
            bootstrap_port=int(get_disagg().disaggregation_bootstrap_port),
            radix_cache_disabled_in=radix_cache_disabled_in(
                launch_role,
                bool(get_memory().disable_radix_cache),
                bool(get_disagg().disaggregation_decode_enable_radix_cache),
                prefix_cache_patched,
            ),
            cuda_graph_disabled=bool(tm.server_args.disable_cuda_graph),
            device=str(tm.server_args.device),
        )

    async def switch(tm, plan: contract.SwitchPlan, request):
        """The upstream switch; with idle_wait_s > 0, retried while the only objection is 'not idle'."""
        deadline = time.monotonic() + plan.idle_wait_s
        obj = PdRoleSwitchReqInput(
            new_role=plan.new_role,
            decode_cuda_graph_memory_gb=plan.decode_cuda_graph_memory_gb,
            decode_cuda_graph_bs=plan.decode_cuda_graph_bs,
        )
        while True:
            result = await tm.pd_role_switch(obj, request)
            busy = not result.success and NOT_IDLE_MARKER in result.message and result.safe_to_restore
            if not busy or time.monotonic() >= deadline:
                return result
            in_progress["waiting_for_idle"] = True
            await asyncio.sleep(IDLE_POLL_S)

    async def convert(tm, req: contract.ConvertRequest, request, port: int):
        roles = await live_roles(tm)
        if len(set(roles)) != 1:
            return respond(contract.answer(False, f"ranks disagree on the role: {roles}", port,
                                           safe_to_restore=False, error=True),
                           status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
        old_role = roles[0]
        try:
            plan = contract.plan_conversion(req, server_view(tm, old_role))
        except contract.ConversionRefused as e:
            return respond(contract.answer(False, str(e), port, old_role=old_role, error=True),
                           status_code=HTTPStatus.BAD_REQUEST)
        in_progress.update(old_role=old_role, new_role=plan.new_role)
        result = await switch(tm, plan, request)
        if not result.success:
            return respond(
                contract.answer(False, result.message, port, old_role=old_role, new_role=plan.new_role,
                                safe_to_restore=bool(result.safe_to_restore), error=True),
                status_code=HTTPStatus.BAD_REQUEST,
            )
        roles = await live_roles(tm)
        if any(r != plan.new_role for r in roles):
            return respond(
                contract.answer(False, f"switch answered {result.message!r} but the live role is {roles}", port,
                                old_role=old_role, new_role=plan.new_role, safe_to_restore=False, error=True),
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            )
        return respond(contract.answer(True, f"converted {old_role} -> {plan.new_role}", port,
                                       old_role=old_role, new_role=plan.new_role, safe_to_restore=False))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def convert_pd_role(request: Request):
        """Convert this server to the other PD role (seed design API; see server_patches.convert_contract)."""
        tm = http_server.get_global_state().tokenizer_manager
        port = int(get_disagg().disaggregation_bootstrap_port)
        try:
            raw = await request.body()
            req = contract.parse_convert_request(orjson.loads(raw) if raw.strip() else {})
        except (contract.BadConvertRequest, ValueError) as e:
            message = str(e) if isinstance(e, contract.BadConvertRequest) else f"body is not valid JSON: {e}"
            return respond(contract.answer(False, message, port, error=True), status_code=HTTPStatus.BAD_REQUEST)
        port_problem = contract.bootstrap_port_problem(req, port)
        if port_problem:
            return respond(contract.answer(False, port_problem, port, error=True), status_code=HTTPStatus.BAD_REQUEST)
        if in_progress:
            return respond(
                contract.answer(False, "another conversion of this server is in progress", port, error=True),
                status_code=HTTPStatus.CONFLICT,
            )
        in_progress.update(started=time.monotonic(), old_role=None, new_role=None, waiting_for_idle=False)
        try:
            return await convert(tm, req, request, port)
        finally:
            in_progress.clear()

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def conversion_state(request: Request):
        """GET: whether a conversion is running now (and for how long), and the live role."""
        tm = http_server.get_global_state().tokenizer_manager
        current = dict(in_progress)
        return respond({
            "in_progress": bool(current),
            "old_role": current.get("old_role"),
            "new_role": current.get("new_role"),
            "waiting_for_idle": bool(current.get("waiting_for_idle")),
            "elapsed_s": round(time.monotonic() - current["started"], 3) if current else None,
            "role": (await live_roles(tm))[0],
            "bootstrap_port": int(get_disagg().disaggregation_bootstrap_port),
        })

    http_server.app.add_api_route(ROUTE, convert_pd_role, methods=["POST"])
    http_server.app.add_api_route(ROUTE, conversion_state, methods=["GET"])
    for route in http_server.app.router.routes:
        if getattr(route, "path", None) != ROUTE:
            continue
        dependant = getattr(route, "dependant", None)
        if dependant is None or dependant.query_params or dependant.body_params or \
                dependant.request_param_name != "request":
            raise PatchRefused(NAME, "FastAPI did not take the handler's only parameter as the raw Request")


PATCH = Patch(NAME, f"POST {ROUTE} (seed design) over the in-place role switch", SGLANG_VERSIONS, _install)
