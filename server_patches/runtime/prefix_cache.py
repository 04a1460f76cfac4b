"""Fix: a server launched as prefill and switched to decode dies at its next idle memory check.

Upstream (0.5.23) resets the prefix tree on a switch, but keeps it *enabled*: a server launched as decode gets a
disabled tree (decode forces --disable-radix-cache unless --disaggregation-decode-enable-radix-cache), and the
decode path frees a finished request's KV on that assumption. With the tree still enabled, a decode request
whose prompt shares a prefix with one cached before leaves pool slots counted neither free nor cached, and the
scheduler raises "pool memory leak detected" at the next idle check (seen on the second request).

The patch makes the prefix cache follow the role, as if the server had been launched in it: released and
disabled on a switch to decode (unless decode radix cache was asked for), restored to the launch setting on a
switch back to prefill; the pools are cleared in the same teardown step upstream clears them in.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Mapping

from .base import Patch, PatchRefused, Settings, require_attrs, require_params
from .hooks import PostImportHooks

NAME = "prefix_cache_on_role_switch"
SGLANG_VERSIONS = frozenset({"0.5.23"})
ROLE_SWITCH_MODULE = "sglang.srt.disaggregation.role_switch"


def radix_cache_disabled_in(
    launch_role: str, launch_disabled: bool, decode_radix_cache: bool, patched: bool
) -> Mapping[str, bool]:
    """Whether the prefix cache is disabled once the server runs as each role (pure; shared with the endpoint).

    launch_disabled is the launch-resolved value: a decode launch has it True unless decode radix cache is on.
    """
    if not patched:  # upstream: the tree keeps its launch state whatever the role
        return {"prefill": launch_disabled, "decode": launch_disabled}
    if launch_role == "decode":
        return {"prefill": launch_disabled, "decode": launch_disabled}
    return {"prefill": launch_disabled, "decode": launch_disabled or not decode_radix_cache}


@dataclass
class _LaunchState:
    role: str
    tree_disabled: bool


def _install(settings: Settings, hooks: PostImportHooks) -> None:
    hooks.after(ROLE_SWITCH_MODULE, _patch_role_switch)
    hooks.after("sglang.srt.managers.scheduler", _check_scheduler_dispatch)


def _check_scheduler_dispatch(scheduler_module: types.ModuleType) -> None:
    # The patch replaces role_switch.handle_pd_role_switch; the scheduler must look it up there at call time.
    require_attrs(NAME, scheduler_module, ["Scheduler"])
    method = getattr(scheduler_module.Scheduler, "handle_pd_role_switch", None)
    names = getattr(getattr(method, "__code__", None), "co_names", ())
    if not {"role_switch", "handle_pd_role_switch"} <= set(names):
        raise PatchRefused(NAME, "Scheduler.handle_pd_role_switch no longer calls role_switch.handle_pd_role_switch")


def _patch_role_switch(role_switch: types.ModuleType) -> None:
    require_attrs(NAME, role_switch, ["handle_pd_role_switch", "_release_prefix_cache_for_role_switch",
                                      "teardown_disaggregation", "PdRoleSwitchReqOutput"])
    require_params(NAME, role_switch.handle_pd_role_switch, ["scheduler", "recv_req"])
    require_params(NAME, role_switch._release_prefix_cache_for_role_switch, ["scheduler"])
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context, get_disagg

    original_handle = role_switch.handle_pd_role_switch
    original_release = role_switch._release_prefix_cache_for_role_switch
    Output = role_switch.PdRoleSwitchReqOutput

    def target_disabled(scheduler, new_role: str) -> bool:
        launch = scheduler._pdr_launch_state
        return radix_cache_disabled_in(
            launch.role, launch.tree_disabled, bool(get_disagg().disaggregation_decode_enable_radix_cache), True
        )[new_role]

    def handle_pd_role_switch(scheduler, recv_req):
        if getattr(scheduler, "_pdr_launch_state", None) is None:
            # First switch request of this scheduler: what it has now is what it was launched with.
            scheduler._pdr_launch_state = _LaunchState(
                scheduler.disaggregation_mode.value, bool(scheduler.tree_cache.disable)
            )
        new_role = (recv_req.new_role or "").lower()
        old_role = scheduler.disaggregation_mode.value
        tree = scheduler.tree_cache
        if new_role in ("prefill", "decode") and new_role != old_role:
            if target_disabled(scheduler, new_role) != bool(tree.disable) and type(tree) is not UnifiedRadixCache:
                return Output(
                    success=False, old_role=old_role, new_role=new_role, safe_to_restore=True,
                    message=f"server_patches: cannot switch the prefix cache of a {type(tree).__name__} with the "
                    "role; relaunch with --disable-radix-cache to switch roles",
                )
        scheduler._pdr_switching_to = new_role
        try:
            return original_handle(scheduler, recv_req)
        finally:
            scheduler._pdr_switching_to = None

    def release_prefix_cache_for_role_switch(scheduler):
        original_release(scheduler)  # upstream: reset the tree (if enabled) and clear the pools
        new_role = getattr(scheduler, "_pdr_switching_to", None)
        if new_role not in ("prefill", "decode"):
            return
        tree = scheduler.tree_cache
        want_disabled = target_disabled(scheduler, new_role)
        if bool(tree.disable) == want_disabled:
            return
        tree.disable = want_disabled
        scheduler.disable_radix_cache = want_disabled
        get_context().override("server_patches.prefix_cache_on_role_switch", disable_radix_cache=want_disabled)
        # Start the new role from an empty tree and whole pools, exactly as upstream's own release does.
        tree.reset()
        scheduler.req_to_token_pool.clear()
        scheduler.token_to_kv_pool_allocator.clear()

    role_switch.handle_pd_role_switch = handle_pd_role_switch
    role_switch._release_prefix_cache_for_role_switch = release_prefix_cache_for_role_switch
    # teardown_disaggregation looks the release function up in the module's globals at call time.
    if "_release_prefix_cache_for_role_switch" not in role_switch.teardown_disaggregation.__code__.co_names:
        raise PatchRefused(NAME, "teardown_disaggregation no longer calls _release_prefix_cache_for_role_switch")


PATCH = Patch(NAME, "prefix cache released and disabled on prefill->decode, restored on decode->prefill",
              SGLANG_VERSIONS, _install)
