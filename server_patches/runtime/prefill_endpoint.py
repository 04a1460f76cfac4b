"""Fix: requests hang between a decode server and a server that switched prefill -> decode -> prefill.

A decode server caches, per prefill bootstrap address, where that prefill's KV manager listens (its rank
endpoint) and registers its own KV buffers there once. Upstream (0.5.23) tears the KV manager down on every
role switch and binds the next one to a new random port, but the bootstrap server (same address) stays up, so
the decode's heartbeat never notices: once a server is a prefill again, every PD request between it and a
decode that had talked to its previous prefill incarnation waits on the old endpoint until a client deadline
(SGLang's own: 300 s). Routers that convert servers back and forth (pd-router's conversions, its rebalancer)
create exactly this.

The patch makes the role cycle invisible to decode servers: a prefill KV manager created in a process that had
prefill KV managers before also listens on their endpoints (one ZMQ socket bound to several ports), and starts
with the decode registrations they had received. Decode servers' cached endpoints and registrations stay valid;
new decode servers use the new endpoint as usual. A former port taken meanwhile is logged and skipped (then the
upstream behaviour remains for decodes that cached it).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

from .base import Patch, PatchRefused, Settings, require_attrs, require_params
from .hooks import PostImportHooks

NAME = "prefill_endpoint_on_role_switch"
SGLANG_VERSIONS = frozenset({"0.5.23"})
COMMON_CONN_MODULE = "sglang.srt.disaggregation.common.conn"
MOONCAKE_CONN_MODULE = "sglang.srt.disaggregation.mooncake.conn"

logger = logging.getLogger(__name__)


@dataclass
class PrefillHistory:
    """What this process's earlier prefill KV managers left: their ports and the decode registrations."""

    ports: list[int] = field(default_factory=list)
    registrations: dict = field(default_factory=dict)  # mooncake session id -> KVArgsRegisterInfo
    # Set while a prefill KV manager is being built: ports its server socket must also listen on.
    binding_extra_ports: list[int] | None = None

    def remember(self, port: int, registrations: dict) -> None:
        if port not in self.ports:
            self.ports.append(port)
        self.registrations.update(registrations)


def apply(common_conn: types.ModuleType, manager_cls: type, prefill_mode: object,
          history: PrefillHistory | None = None) -> PrefillHistory:
    """Wrap `manager_cls` (teardown, __init__) and common_conn's socket factory. Returns the shared history."""
    history = history or PrefillHistory()
    original_socket = common_conn.get_zmq_socket_on_host
    original_init = manager_cls.__init__
    original_teardown = manager_cls.teardown

    def get_zmq_socket_on_host(context, socket_type, host=None, *args, **kwargs):
        port, socket = original_socket(context, socket_type, host, *args, **kwargs)
        extra = history.binding_extra_ports
        if extra:
            history.binding_extra_ports = None  # the manager's server socket only: the first one it makes
            bind_host = f"[{host}]" if host and ":" in host else (host or "127.0.0.1")
            for old_port in extra:
                try:
                    socket.bind(f"tcp://{bind_host}:{old_port}")
                except Exception as e:  # zmq.ZMQError: taken meanwhile
                    logger.warning("server_patches: prefill KV endpoint port %s is taken (%s): decode servers that "
                                   "cached it will not reach this server", old_port, e)
        return port, socket

    def __init__(self, args, disaggregation_mode, *rest, **kwargs):
        carried = disaggregation_mode == prefill_mode and bool(history.ports)
        history.binding_extra_ports = list(history.ports) if carried else None
        try:
            original_init(self, args, disaggregation_mode, *rest, **kwargs)
        finally:
            history.binding_extra_ports = None
        if carried:
            table = getattr(self, "decode_kv_args_table", {})
            for session_id, info in list(history.registrations.items()):
                if session_id in table:  # the decode registered again meanwhile: that one wins
                    continue
                if getattr(info, "requires_dcp_relayout", False) and hasattr(self, "_init_dcp_pack_buffers_once"):
                    self._init_dcp_pack_buffers_once(info.dst_dcp_size, include_draft=True)
                self._publish_peer_registration(session_id, info)
            logger.info("server_patches: prefill KV manager on port %s also listens on %s, with %d decode "
                        "registration(s) carried over", self.rank_port, history.ports, len(history.registrations))

    def teardown(self):
        if getattr(self, "disaggregation_mode", None) == prefill_mode:
            history.remember(self.rank_port, dict(getattr(self, "decode_kv_args_table", {})))
        return original_teardown(self)

    common_conn.get_zmq_socket_on_host = get_zmq_socket_on_host
    manager_cls.__init__ = __init__
    manager_cls.teardown = teardown
    return history


def _install(settings: Settings, hooks: PostImportHooks) -> None:
    hooks.after(MOONCAKE_CONN_MODULE, _patch)


def _patch(mooncake_conn: types.ModuleType) -> None:
    import sys

    common_conn = sys.modules.get(COMMON_CONN_MODULE)
    if common_conn is None:
        raise PatchRefused(NAME, f"{MOONCAKE_CONN_MODULE} loaded without {COMMON_CONN_MODULE}")
    require_attrs(NAME, common_conn, ["get_zmq_socket_on_host", "CommonKVManager"])
    require_params(NAME, common_conn.get_zmq_socket_on_host, ["context", "socket_type", "host"])
    # The KV manager's server socket must come from the module-level factory, looked up at call time.
    if "get_zmq_socket_on_host" not in common_conn.CommonKVManager.__init__.__code__.co_names:
        raise PatchRefused(NAME, "CommonKVManager.__init__ no longer binds through get_zmq_socket_on_host")
    require_attrs(NAME, mooncake_conn, ["MooncakeKVManager"])
    manager = mooncake_conn.MooncakeKVManager
    require_attrs(NAME, manager, ["teardown", "_publish_peer_registration", "start_prefill_thread"])
    require_params(NAME, manager.__init__, ["self", "args", "disaggregation_mode"])
    require_params(NAME, manager._publish_peer_registration, ["self", "mooncake_session_id", "decode_kv_args"])
    from sglang.srt.disaggregation.utils import DisaggregationMode

    apply(common_conn, manager, DisaggregationMode.PREFILL)


PATCH = Patch(NAME, "a server back in prefill keeps its former KV endpoints and decode registrations",
              SGLANG_VERSIONS, _install)
