"""The seed design's `POST /convert_pd_role` contract, as pure rules (no SGLang import; unit-tested fast).

Request (JSON object; unknown keys are refused):
    server_url                   str, optional   the design sends it through a load balancer; a server ignores it
    check_idle                   bool = true     true: refuse at once when busy; false: wait up to idle_timeout_s
    idle_timeout_s               float = 30      how long check_idle=false waits for the server to drain (<= 600)
    bootstrap_port               int, optional   the port the caller expects; must be the server's own
    disable_radix_cache          bool, optional  must match what the server will have in the new role
    disable_cuda_graph           bool, optional  must match the server's launch setting
    decode_cuda_graph_memory_gb  float, optional passed to the in-place switch (0 by default on a CPU server)
    decode_cuda_graph_bs         [int], optional passed to the in-place switch
Answer: {"success", "message", "bootstrap_port", "old_role", "new_role", "safe_to_restore"}; refusals of bad input
also carry {"error": {"message"}}.

SGLang 0.5.23 switches roles in place and never moves a server's bootstrap server (with role switching enabled
every server runs one on its launch --disaggregation-bootstrap-port), so the design's fields that would reconfigure
the server are accepted only when they describe what the server will have anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

ROLES = ("prefill", "decode")
MAX_IDLE_TIMEOUT_S = 600.0
DEFAULT_IDLE_TIMEOUT_S = 30.0


class BadConvertRequest(ValueError):
    """The body is not a valid conversion request (HTTP 400)."""


class ConversionRefused(ValueError):
    """Valid request, but the server cannot do what it asks in place (HTTP 400, server unchanged)."""


@dataclass(frozen=True)
class ConvertRequest:
    server_url: Optional[str] = None
    check_idle: bool = True
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    bootstrap_port: Optional[int] = None
    disable_radix_cache: Optional[bool] = None
    disable_cuda_graph: Optional[bool] = None
    decode_cuda_graph_memory_gb: Optional[float] = None
    decode_cuda_graph_bs: Optional[tuple[int, ...]] = None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# field -> (check, what it must be); None is allowed for every optional field.
_CHECKS: dict[str, tuple[Any, str]] = {
    "server_url": (lambda v: isinstance(v, str), "a string"),
    "check_idle": (lambda v: isinstance(v, bool), "a boolean"),
    "idle_timeout_s": (lambda v: _is_number(v) and 0 < v <= MAX_IDLE_TIMEOUT_S, f"a number in (0, {MAX_IDLE_TIMEOUT_S:g}]"),
    "bootstrap_port": (lambda v: _is_int(v) and 0 < v < 65536, "an integer port in 1..65535"),
    "disable_radix_cache": (lambda v: isinstance(v, bool), "a boolean"),
    "disable_cuda_graph": (lambda v: isinstance(v, bool), "a boolean"),
    "decode_cuda_graph_memory_gb": (lambda v: _is_number(v) and v >= 0, "a non-negative number"),
    "decode_cuda_graph_bs": (
        lambda v: isinstance(v, list) and v and all(_is_int(b) and b > 0 for b in v),
        "a non-empty list of positive integers",
    ),
}
_NOT_NULLABLE = {"check_idle", "idle_timeout_s"}


def parse_convert_request(body: Any) -> ConvertRequest:
    """Validate a decoded JSON body; every problem is reported at once."""
    if body is None:
        body = {}
    if not isinstance(body, Mapping):
        raise BadConvertRequest("body must be a JSON object")
    problems = [f"unknown field {k!r}" for k in body if k not in _CHECKS]
    values: dict[str, Any] = {}
    for name, (check, expected) in _CHECKS.items():
        if name not in body:
            continue
        value = body[name]
        if value is None and name not in _NOT_NULLABLE:
            continue
        if not check(value):
            problems.append(f"{name} must be {expected}, got {value!r}")
            continue
        values[name] = tuple(value) if name == "decode_cuda_graph_bs" else value
    if problems:
        raise BadConvertRequest("; ".join(problems))
    if "idle_timeout_s" in values:
        values["idle_timeout_s"] = float(values["idle_timeout_s"])
    return ConvertRequest(**values)


@dataclass(frozen=True)
class ServerView:
    """What the server is now, and what an in-place switch would leave it with."""

    role: str  # live role of the scheduler(s)
    bootstrap_port: int  # where this server's bootstrap server listens (never moves)
    radix_cache_disabled_in: Mapping[str, bool]  # role -> prefix cache disabled after switching into it
    cuda_graph_disabled: bool  # launch setting
    device: str


@dataclass(frozen=True)
class SwitchPlan:
    old_role: str
    new_role: str
    decode_cuda_graph_memory_gb: Optional[float]
    decode_cuda_graph_bs: Optional[list[int]]
    idle_wait_s: float  # 0: refuse when busy


def opposite(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


def bootstrap_port_problem(req: ConvertRequest, bootstrap_port: int) -> Optional[str]:
    """Decidable from the request alone: the bootstrap server never moves."""
    if req.bootstrap_port is None or req.bootstrap_port == bootstrap_port:
        return None
    return (f"bootstrap_port {req.bootstrap_port} requested, but this server's bootstrap server listens on "
            f"{bootstrap_port} and an in-place switch cannot move it")


def plan_conversion(req: ConvertRequest, view: ServerView) -> SwitchPlan:
    if view.role not in ROLES:
        raise ConversionRefused(f"server is not a PD server (role {view.role!r}); nothing to convert")
    new_role = opposite(view.role)
    problems = [p for p in [bootstrap_port_problem(req, view.bootstrap_port)] if p]
    will_disable_radix = view.radix_cache_disabled_in[new_role]
    if req.disable_radix_cache is not None and req.disable_radix_cache != will_disable_radix:
        problems.append(
            f"disable_radix_cache={str(req.disable_radix_cache).lower()} requested, but as {new_role} this server "
            f"will have its prefix cache {'disabled' if will_disable_radix else 'enabled'}"
        )
    if req.disable_cuda_graph is not None and req.disable_cuda_graph != view.cuda_graph_disabled:
        problems.append(
            f"disable_cuda_graph={str(req.disable_cuda_graph).lower()} requested, but this server was launched "
            f"with disable_cuda_graph={str(view.cuda_graph_disabled).lower()} and keeps it across a switch"
        )
    if problems:
        raise ConversionRefused("; ".join(problems))
    memory_gb = req.decode_cuda_graph_memory_gb
    if memory_gb is None and new_role == "decode" and view.device == "cpu":
        memory_gb = 0.0  # no graph memory to reserve on a CPU
    return SwitchPlan(
        old_role=view.role,
        new_role=new_role,
        decode_cuda_graph_memory_gb=memory_gb,
        decode_cuda_graph_bs=list(req.decode_cuda_graph_bs) if req.decode_cuda_graph_bs else None,
        idle_wait_s=0.0 if req.check_idle else req.idle_timeout_s,
    )


def answer(
    success: bool, message: str, bootstrap_port: Optional[int], *, old_role: str = "", new_role: str = "",
    safe_to_restore: bool = True, error: bool = False,
) -> dict:
    body = {
        "success": success,
        "message": message,
        "bootstrap_port": bootstrap_port,
        "old_role": old_role,
        "new_role": new_role,
        "safe_to_restore": safe_to_restore,
    }
    if error:
        body["error"] = {"message": message}
    return body
