"""One worker as every way in names it: the one model of a worker-entry body.

`POST /workers` (sgl-router's and SMG's body), `POST /add_worker` (the same fields as query parameters), mini_lb's
`POST /register` (its own names: `mode`, `registry_url`), an entry of a `--discovery-file`, and the value of an
etcd discovery key are all read into a `WorkerEntry`, checked by the same rules: fields the model does not
know are refused, naming them (a misspelt `boostrap_port` is never silently dropped); the URL is a worker URL
(core/worker_url.py); a role is `prefill` or `decode` (`worker_type`, or `role`; both must agree); a bootstrap
port is an integer in 1..65535 (a string of digits too, as a query string writes it), or null. Each problem is
reported, all at once (`WorkerEntryError.problems`).

One difference between the ways in is named by each, not decided by it: what a `null` bootstrap port means
(`bootstrap_port_of(null_means=...)`). `POST /workers` reads it as sgl-router's body does, the field not given
(the server's own port is read); `/add_worker`'s `none`, `/register`'s null and a listing's null (the file,
etcd) mean what they mean to mini_lb, decode's default port.

A field a peer sends that pd-router takes is added here, once, for every way in. The fields of the peers'
worker bodies (sgl-router 0.3.2's `WorkerConfigRequest`, SMG 1.13's `WorkerSpec`: labels, api_key, priority,
cost, model_id, health overrides, ...; `PEER_FIELDS`) are accepted and type-checked where the peer types them
plainly; labels, priority, cost and api_key are kept (`settings`: the worker's own, see `Worker`), the others
named in `ignored` (the answer says which): only a field no peer knows is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from router.core.config import DISCOVER, validate_port
from router.core.states import Role
from router.core.worker_url import BadWorkerUrl, WorkerUrl, parse_worker_url

ROLES = (Role.PREFILL.value, Role.DECODE.value)
# The peers' worker-body fields pd-router does not act on (tests/fixtures/peers/worker_api.json): field -> the
# JSON type the peer requires (None: anything). SETTINGS are kept on the worker (api_key: sent to it alone;
# labels, priority, cost: stored and shown, as no policy of the peers' or pd-router's weighs them); per-worker
# health or connection settings have no meaning to pd-router's pools; DP fields are issue 24's; the rest
# (tokenizer, parsers, gRPC, KV connector of vLLM, multimodal) are parts pd-router does not have.
PEER_FIELDS: dict[str, type | tuple[type, ...] | None] = {
    "api_key": str, "model_id": str, "models": list, "priority": int, "cost": (int, float), "labels": dict,
    "runtime": str, "runtime_type": str, "provider": str, "connection_mode": str, "tokenizer_path": str,
    "reasoning_parser": str, "tool_parser": str, "chat_template": str, "health_check_timeout_secs": int,
    "health_check_interval_secs": int, "health_success_threshold": int, "health_failure_threshold": int,
    "disable_health_check": bool, "max_connection_attempts": int, "dp_aware": bool, "bootstrap_host": str,
    "dp_base_url": str, "dp_rank": int, "dp_size": int, "kv_connector": str, "kv_role": str, "kv_engine_id": str,
    "kv_block_size": int, "constrained_decoding": None, "health": dict, "overload": dict, "http_pool": dict,
    "resilience": dict, "load_monitor_interval_secs": int, "multimodal_tensor_transport": str,
    "multimodal_shm_min_bytes": int, "zmq_handshake_address": str,
}
SETTINGS = ("labels", "priority", "cost", "api_key")
# mini_lb's /register names: its field -> the model's
REGISTER_FIELDS = {"mode": "worker_type", "registry_url": "url", "bootstrap_port": "bootstrap_port"}


class WorkerEntryError(ValueError):
    """An entry the router cannot take; every problem found, and the first field at fault (`param`)."""

    def __init__(self, problems: list[str], param: str | None = None):
        super().__init__("; ".join(problems))
        self.problems = problems
        self.param = param


class WorkerEntry(BaseModel):
    """One worker: where it is, and what is known of its role and bootstrap port (absent: the server's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str  # as given, checked (its canonical form: `address`)
    worker_type: Role | None = None  # SMG's and sgl-router's name
    role: Role | None = None  # mini_lb's and pd-router's name; absent both: the server's live role
    bootstrap_port: int | None = None  # absent (not in model_fields_set): the server's own
    ignored: tuple[str, ...] = ()  # the peers' fields given, accepted with no effect (never a body field)
    settings: dict[str, Any] = {}  # the peers' SETTINGS given (never a body field): the worker keeps them

    @field_validator("url", mode="before")
    @classmethod
    def _url(cls, value: Any) -> str:
        try:
            parse_worker_url(value)
        except BadWorkerUrl as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("worker_type", "role", mode="before")
    @classmethod
    def _role(cls, value: Any) -> Role | None:
        if value is None or value in ROLES:
            return None if value is None else Role(value)
        raise ValueError(f"must be 'prefill' or 'decode' (pd-router routes prefill/decode pairs only), got "
                         f"{value!r}")

    @field_validator("bootstrap_port", mode="before")
    @classmethod
    def _port(cls, value: Any) -> int | None:
        if isinstance(value, str):  # a query string's, or a client's that writes numbers as strings
            value = int(value) if value.isdigit() else None if value.lower() in ("none", "null", "") else value
        if (problem := validate_port(value, "")) is not None:
            raise ValueError(problem.strip())
        return value

    @model_validator(mode="after")
    def _one_role(self) -> "WorkerEntry":
        if self.worker_type is not None and self.role is not None and self.worker_type is not self.role:
            raise ValueError(f"worker_type and role disagree ({self.worker_type}, {self.role})")
        return self

    # ---- what the router takes from it -------------------------------------------------------------------
    @property
    def parsed_url(self) -> WorkerUrl:
        return parse_worker_url(self.url)

    @property
    def address(self) -> str:
        """The URL to register: canonical, with its credentials (the registry sets them apart)."""
        return self.parsed_url.with_credentials

    @property
    def given_role(self) -> Role | None:
        """The role the entry names; None: the server's live role."""
        return self.worker_type or self.role

    def bootstrap_port_of(self, *, null_means: object) -> int | None | str:
        """The port to register: DISCOVER when absent (the server's own); `null_means` for an explicit null
        (DISCOVER for the worker API, None, decode's default, for a listing)."""
        if "bootstrap_port" not in self.model_fields_set:
            return DISCOVER
        return null_means if self.bootstrap_port is None else self.bootstrap_port


def parse_worker_entry(data: Mapping[str, Any], *, where: str = "", names: Mapping[str, str] | None = None,
                       ) -> WorkerEntry:
    """`data` as a WorkerEntry, or WorkerEntryError listing every problem (prefixed `where: ` when given).
    `names`: the way in's own field names (e.g. REGISTER_FIELDS), each mapped to the model's; a field outside
    them is unknown, and problems say the way in's names."""
    peer = PEER_FIELDS if names is None else {}
    names = names if names is not None else {field: field for field in WorkerEntry.model_fields
                                             if field not in ("ignored", "settings")}
    shown = {model: own for own, model in names.items()}
    problems: list[str] = [f"unknown field {key!r} (known: {', '.join(sorted(names))}, and the peers' worker "
                           f"fields)" if peer else f"unknown field {key!r} (known: {', '.join(sorted(names))})"
                           for key in data if key not in names and key not in peer]
    param = next((key for key in data if key not in names and key not in peer), None)
    given = tuple(key for key in data if key in peer)
    for key in given:
        wanted, value = peer[key], data[key]
        if value is not None and wanted is not None and (not isinstance(value, wanted) or (
                isinstance(value, bool) and wanted is not bool)):
            problems.append(f"{key} must be {_json_type(wanted)}, got {type(value).__name__}")
            param = param or key
        elif key == "labels" and value and not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in value.items()):
            problems.append("labels must map strings to strings")
            param = param or key
    entry = None
    try:
        entry = WorkerEntry.model_validate({names[key]: value for key, value in data.items() if key in names})
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            name = shown.get(field, field)
            if error["type"] == "missing":
                problems.append(f"{name} is required")
            elif error["type"] == "value_error":
                reason = str(error["ctx"]["error"])  # a url's names the URL: it reads as it is
                problems.append(f"{name} {reason}" if name and field != "url" else reason)
            else:
                problems.append(f"{name}: {error['msg']}" if name else error["msg"])
            param = param or name or None
    if problems or entry is None:
        raise WorkerEntryError([f"{where}: {p}" if where else p for p in problems], param)
    ignored = tuple(key for key in given if key not in SETTINGS)
    settings = {key: data[key] for key in given if key in SETTINGS and data[key] is not None}
    if "cost" in settings:
        settings["cost"] = float(settings["cost"])
    return entry.model_copy(update={"ignored": ignored, "settings": settings}) if given else entry


def _json_type(wanted: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "an array",
             dict: "an object"}
    return "a number" if wanted == (int, float) else names.get(wanted, str(wanted))
