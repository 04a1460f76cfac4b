"""Typed client for one SGLang server's control surface (not the request path).

Knows the endpoint names of each server version (0.5.23 renamed `/get_server_info` to `/server_info` and
`/get_model_info` to `/model_info`, keeping the old names with a deprecation warning; `/get_load` became
`/v1/loads`) and where each fact lives (the live role is in `/model_info`, the weight version in the
answers' meta_info and `/server_info`'s internal states).
"""

from __future__ import annotations

import asyncio
import base64
import enum
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, TypeVar
from urllib.parse import unquote

import aiohttp
import orjson
from aiohttp import web

from policies.load_report import LoadReport, parse_loads
from router.core.local_resources import LocalResourceErrors, local_resource_kind
from router.core.redact import redact_text
from router.core.registry import Registry, Worker
from router.core.router_identity import HOP_HEADER, INSTANCE
from router.core.worker_url import BadWorkerUrl, parse_worker_url

logger = logging.getLogger(__name__)

JSON_HEADERS = {"Content-Type": "application/json"}
# How long the control plane waits for one server, by kind of call: every caller names one of these.
INFO_TIMEOUT = 5.0  # reading what a server says (/server_info, /model_info, /v1/loads, /ready), an abort
HEALTH_TIMEOUT = 25.0  # 0.5.23's /health runs a 1-token generation and waits up to 20 s for progress
ADMIN_TIMEOUT = 30.0  # a fan-out an operator asked for (/health_generate, /flush_cache, the info routes)

W = TypeVar("W")
T = TypeVar("T")


async def fan_out(workers: Iterable[W], call: Callable[[W], Awaitable[T]]) -> list[T]:
    """Make one call per worker, all at once; the answers come back in the workers' order."""
    return list(await asyncio.gather(*(call(w) for w in workers)))


class NoAnswer(str, enum.Enum):
    """Why a call got no answer (`Reply.no_answer`, with status 0)."""

    NOT_SENT = "not_sent"  # no connection was made (refused, no route, no such name): nothing reached the server
    TIMEOUT = "timeout"  # no answer within the call's deadline: the server may have acted on it
    CUT = "cut"  # the connection broke before a whole answer came: the server may have acted on it
    REFUSED_HERE = "refused_here"  # the URL itself is unusable: nothing was sent
    LOCAL = "local_resource"  # the router ran out of its own descriptors or ports: nothing sent, no verdict

    def __str__(self) -> str:
        return self.value


def no_answer_of(exc: BaseException) -> NoAnswer:
    if isinstance(exc, aiohttp.ClientConnectorError):  # DNS, refused, TLS: before a byte of the request
        return NoAnswer.NOT_SENT
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return NoAnswer.TIMEOUT
    return NoAnswer.CUT


@dataclass(slots=True)
class Reply:
    """One answer of a server: status (0 when unreachable), parsed JSON (or None) and raw text; with status 0,
    `no_answer` says why (the text names the error)."""

    status: int
    data: Any
    text: str
    no_answer: NoAnswer | None = None

    @property
    def reached(self) -> bool:
        """The call may have reached the server (it answered, or was cut or timed out after being sent)."""
        return self.no_answer not in (NoAnswer.NOT_SENT, NoAnswer.REFUSED_HERE, NoAnswer.LOCAL)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def message(self) -> str:
        """The server's message, fit to relay (in answers, records, logs): secrets redacted."""
        if isinstance(self.data, dict):
            msg = self.data.get("message")
            if msg is None and isinstance(self.data.get("error"), dict):
                msg = self.data["error"].get("message")
            if msg is not None:
                return redact_text(str(msg))
        return redact_text(self.text[:500])

    def success(self) -> bool:
        """SGLang control answers: 200 and `success` not false."""
        if not self.ok:
            return False
        if isinstance(self.data, dict) and self.data.get("success") is False:
            return False
        return True


@dataclass(slots=True)
class Load:
    running: int
    waiting: int
    used_tokens: int | None = None
    token_usage: float | None = None
    # 0.5.23's PD queues (prefill bootstrap/inflight, decode prealloc/transfer/retracted): requests there are
    # in neither running nor waiting, yet the server is not idle (a role switch refuses).
    queued: int = 0
    report: LoadReport | None = None  # the whole 0.5.23 report (policies/load_report.py), when it has one

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.queued == 0


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, timeout: float = 10.0, api_key: str | None = None,
                 local_errors: LocalResourceErrors | None = None) -> None:
        self.session = session
        self.local_errors = local_errors if local_errors is not None else LocalResourceErrors()
        self.timeout = timeout
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Every call says it comes from a pd-router: a pd-router receiving it acts on none (core/router_identity).
        self._base = {HOP_HEADER: INSTANCE, **self._auth}
        # Workers registered with `user:pass@` in their URL (their `url` shows none): HTTP Basic on every control
        # call, as aiohttp sent it from the URL before (a --worker-api-key takes precedence).
        self._basic: dict[str, dict] = {}
        # Workers registered with their own api_key (the peers' worker field): that key, over every other.
        self._keyed: dict[str, dict] = {}

    def set_worker_key(self, url: str, key: str | None) -> None:
        """Send `key` (None: no key of its own) to the worker at `url` (canonical) from now on; set before the
        worker is first read, so that its first reading carries it."""
        if key:
            self._keyed[url] = {**self._base, "Authorization": f"Bearer {key}"}
        else:
            self._keyed.pop(url, None)

    def follow_credentials(self, registry: Registry) -> None:
        def listener(event: str, worker: Worker | None, details: dict) -> None:
            if worker is None:
                return
            if event == "added" and worker.userinfo is not None:
                self._basic[worker.url] = {**self._base, "Authorization": basic_header(worker.userinfo)}
            elif event == "removed":
                self._basic.pop(worker.url, None)
                self._keyed.pop(worker.url, None)

        registry.subscribe(listener)

    async def call(self, method: str, url: str, path: str, body: Any = None, *, timeout: float | None = None,
                   headers: dict | None = None) -> Reply:
        kwargs: dict = {"timeout": aiohttp.ClientTimeout(total=timeout or self.timeout)}
        base = self._base
        if "@" in url:  # a URL as registered, credentials in it (read before the worker exists)
            try:
                parsed = parse_worker_url(url)
            except BadWorkerUrl as exc:
                return Reply(0, None, str(exc), NoAnswer.REFUSED_HERE)
            url = parsed.url
            if parsed.userinfo is not None and not self._auth:
                base = {**base, "Authorization": basic_header(parsed.userinfo)}
        elif self._basic and not self._auth:
            base = self._basic.get(url, base)
        if self._keyed:
            base = self._keyed.get(url, base)
        if body is not None:
            kwargs["data"] = orjson.dumps(body)
            kwargs["headers"] = {**JSON_HEADERS, **base, **(headers or {})}
        else:
            kwargs["headers"] = {**base, **headers} if headers else base
        try:
            async with self.session.request(method, url + path, **kwargs) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if (kind := local_resource_kind(exc)) is not None:  # the router's limit: says nothing of the server
                self.local_errors.note(kind, f"calling {url}{path}", exc)
                return Reply(0, None, text, NoAnswer.LOCAL)
            return Reply(0, None, text, no_answer_of(exc))
        text = raw.decode(errors="replace")
        try:
            data = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = None
        return Reply(status, data, text)

    async def get(self, url: str, path: str, **kw) -> Reply:
        return await self.call("GET", url, path, **kw)

    async def post(self, url: str, path: str, body: Any = None, **kw) -> Reply:
        return await self.call("POST", url, path, {} if body is None else body, **kw)

    async def _get_renamed(self, url: str, new: str, old: str, **kw) -> Reply:
        reply = await self.get(url, new, **kw)
        if reply.status in (404, 405):
            reply = await self.get(url, old, **kw)
        return reply

    # ---- info ------------------------------------------------------------------------------------
    async def server_info(self, url: str, **kw) -> Reply:
        return await self._get_renamed(url, "/server_info", "/get_server_info", **kw)

    async def model_info(self, url: str, **kw) -> Reply:
        return await self._get_renamed(url, "/model_info", "/get_model_info", **kw)

    async def health(self, url: str, path: str = "/health", **kw) -> Reply:
        return await self.get(url, path, **kw)

    async def ready(self, url: str, **kw) -> bool | None:
        """0.5.23's `/ready`: True (200), False (503: paused, starting, unhealthy or shutting down), None when
        the server has no such endpoint or did not answer (older versions: readiness unknown)."""
        reply = await self.get(url, "/ready", **kw)
        return True if reply.ok else False if reply.status == 503 else None

    async def load(self, url: str, **kw) -> Load | None:
        """Running and waiting requests summed over DP ranks; None if the server tells nothing."""
        reply = await self.get(url, "/v1/loads", **kw)
        if reply.ok and (report := parse_loads(reply.data)) is not None:
            return Load(running=report.running, waiting=report.waiting, used_tokens=report.used_tokens,
                        token_usage=report.token_usage, queued=report.pd_queued, report=report)
        reply = await self.get(url, "/get_load", **kw)
        if reply.ok and reply.data is not None:
            items = reply.data if isinstance(reply.data, list) else [reply.data]
            tokens = sum(int(i.get("load") or 0) for i in items if isinstance(i, dict))
            running = sum(int(i.get("num_reqs") or 0) for i in items if isinstance(i, dict))
            waiting = sum(int(i.get("num_waiting_reqs") or 0) for i in items if isinstance(i, dict))
            return Load(running=running or (1 if tokens else 0), waiting=waiting, used_tokens=tokens)
        return None

    # ---- control ---------------------------------------------------------------------------------
    async def abort(self, url: str, *, rid: str | None = None, abort_all: bool = False, **kw) -> Reply:
        body: dict = {"abort_all": True} if abort_all else {"rid": rid}
        return await self.post(url, "/abort_request", body, **kw)


def basic_header(userinfo: str) -> str:
    """HTTP Basic for a URL's `user:password` (percent-decoded, as aiohttp reads them from a URL)."""
    user, _, password = userinfo.partition(":")
    return "Basic " + base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()


def bootstrap_port_of(server_info: Any) -> int | None:
    """The live bootstrap port: `internal_states[0]` (the scheduler's), else the launch value."""
    if isinstance(server_info, dict):
        states = server_info.get("internal_states")
        for source in ((states[0] if isinstance(states, list) and states else None), server_info):
            port = source.get("disaggregation_bootstrap_port") if isinstance(source, dict) else None
            if isinstance(port, int) and not isinstance(port, bool):
                return port
    return None


def live_role_of(model_info: Any, server_info: Any = None) -> str | None:
    """The role the server has now: `/model_info` (0.5.23), else `/server_info` internal state, else launch."""
    if isinstance(model_info, dict) and isinstance(model_info.get("disaggregation_mode"), str):
        return model_info["disaggregation_mode"]
    if isinstance(server_info, dict):
        states = server_info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            mode = states[0].get("disaggregation_mode")
            if isinstance(mode, str):
                return mode
        mode = server_info.get("disaggregation_mode")
        if isinstance(mode, str):
            return mode
    return None


def weight_version_of(server_info: Any) -> str | None:
    """The scheduler's weight version, `/server_info` internal_states[0] (0.5.23: the live one, as in every
    answer's meta_info; `/model_info` and `/server_info`'s top level keep the launch value after an update)."""
    if isinstance(server_info, dict):
        states = server_info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            version = states[0].get("weight_version")
            if version is not None:
                return str(version)
    return None


def switch_api_of(server_info: Any) -> str | None:
    if not isinstance(server_info, dict):
        return None
    if server_info.get("enable_pd_role_switch"):
        return "pd_role_switch"
    if server_info.get("enable_pd_convert"):
        return "convert_pd_role"
    return None


UPSTREAM = web.AppKey("upstream", Upstream)  # the control plane's client of the servers
