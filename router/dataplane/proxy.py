"""The request path: admit → pick a pair → inject bootstrap fields → dispatch both legs → relay → finish.

Both legs run as tasks of the request; a leg that fails first cancels the other (closing its connection and
aborting its rids on the server), because the survivor would otherwise wait for a KV transfer that never
comes. Nothing reaches the client before decode's first event, so every failure up to then can still be
answered with a plain HTTP error, or retried on another pair with fresh rooms. After the first byte, a
failure ends the stream with an SSE error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import orjson
from aiohttp import web

from policies import Outcome, Policy, RequestInfo
from router.core.config import RouterConfig
from router.core.errors import GatewayTimeout, RouterError, ServiceUnavailable, parse_json_object
from router.core.records import RequestObserver, RequestRecord
from router.core.registry import Registry, Role, Worker
from router.core.request_shape import RequestShape, assign_rid, inject_bootstrap, prompt_text, shape_of
from router.dataplane import sse
from router.dataplane.aborts import abort_response
from router.dataplane.admission import Admission
from router.dataplane.live import RETRY, LiveRequests
from router.dataplane.logprobs import index_prefill_events, merge_answer, merge_meta
from router.dataplane.upstream_http import (
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    header_lines,
)

logger = logging.getLogger(__name__)

# Request headers passed to both legs.
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Before the first byte, a server error on either leg is retried on a fresh pair: in PD most 5xx are tied
# to the pair (SGLang answers 500 for a KV transfer that failed because the *other* server died), so a new
# pair usually succeeds. 4xx are the request's fault and go back as they are (except timeout / rate limit).
RETRYABLE_CLIENT_STATUSES = frozenset({408, 429})
# SGLang's message for a KV transfer that failed: it implicates the pair, not necessarily this server.
KV_TRANSFER_FAILURE = b"KVTransferError"
MAX_ABORT_RETRIES = 16
ABORT_TIMEOUT_S = 5.0


class LegFailed(Exception):
    """A leg failed before the client saw a byte; carries what to answer if it is not retried."""

    def __init__(self, worker: Worker, status: int, body: bytes, content_type: str, *, retryable: bool,
                 reason: str, router_abort: bool = False):
        super().__init__(reason)
        self.worker = worker
        self.status = status
        self.body = body
        self.content_type = content_type
        self.retryable = retryable
        self.reason = reason
        self.router_abort = router_abort

    @property
    def worker_fault(self) -> bool:
        """Unreachable or 5xx, not caused by the router's own abort nor by the partner leg (a failed KV
        transfer): counts against this worker's breaker."""
        return self.status >= 500 and not self.router_abort and KV_TRANSFER_FAILURE not in self.body

    def response(self) -> web.Response:
        if self.body:
            return web.Response(body=self.body, status=self.status, content_type=self.content_type or None)
        return web.json_response({"error": {"message": self.reason, "type": "upstream_error",
                                            "code": self.status}}, status=self.status,
                                 dumps=lambda o: orjson.dumps(o).decode())


@dataclass(slots=True, eq=False)
class Attempt:
    prefill: Worker
    decode: Worker
    payload: bytes
    rids: list[str]
    epochs: tuple[int, int]
    legs: list["Leg"] = field(default_factory=list)
    evicted: str | None = None  # why the router gave up on one of its workers (see Proxy.evict)
    streaming: bool = False  # the client has seen bytes of this attempt: it can no longer be re-sent
    # Set (through `Proxy.live`) when an operator or a flow aborts this attempt: live.RETRY or live.ANSWER.
    abort_action: str | None = None

    def router_aborted(self) -> bool:
        return self.abort_action is not None or (self.prefill.abort_epoch, self.decode.abort_epoch) != self.epochs


# (worker, verdict) for passive health: True served, False failed by the worker's fault (unreachable, 5xx,
# stream cut), None no verdict (cancelled, client error, router abort).
LegObserver = Callable[[Worker, "bool | None"], None]


class Proxy:
    def __init__(self, *, config: RouterConfig, registry: Registry, upstream: UpstreamPool,
                 prefill_policy: Policy, decode_policy: Policy, admission: Admission,
                 spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream  # the legs and their aborts
        # With a worker key, every call to a worker carries it (the client's own Authorization is for us).
        self._worker_auth = f"Bearer {config.worker_api_key}" if config.worker_api_key else None
        self._abort_headers = header_lines({"Authorization": self._worker_auth}) if self._worker_auth else b""
        self.policies = {Role.PREFILL: prefill_policy, Role.DECODE: decode_policy}
        self.admission = admission
        self.spawn = spawn  # owned background tasks (aborts, lingering prefill legs)
        self.leg_observers: list[LegObserver] = []
        self.request_observers: list[RequestObserver] = []
        self.live = LiveRequests()  # attempts in flight, by rid (abort endpoint, flows)
        self._needs_text = prefill_policy.needs_text or decode_policy.needs_text
        self._timeout = config.request_timeout_secs
        self._retry = config.retry

    # ---- entry point -----------------------------------------------------------------------------
    async def handle(self, request: web.Request, route: str, upstream_path: str) -> web.StreamResponse:
        record = RequestRecord(route=route, stream=False, started=time.monotonic())
        try:
            body = parse_json_object(await request.read())
            shape = shape_of(route, body)
            record.stream = shape.stream
            forwarded = {h: v for h in FORWARDED_HEADERS if (v := request.headers.get(h)) is not None}
            if self._worker_auth is not None:
                forwarded["Authorization"] = self._worker_auth
            record.request_id = forwarded.get("X-Request-Id", "")
            headers = header_lines(forwarded) if forwarded else b""  # wire bytes, for both legs
            info = RequestInfo(route=route, batch_size=shape.batch_size,
                               text=prompt_text(route, body) if self._needs_text else None)
            deadline = record.started + self._timeout
            async with self.admission.slot():
                try:
                    async with asyncio.timeout_at(asyncio.get_running_loop().time()
                                                  + (deadline - time.monotonic())):
                        response = await self._attempts(request, route, upstream_path, body, shape, headers,
                                                        info, record, deadline)
                except TimeoutError:
                    message = f"request did not finish within {self._timeout:g} s"
                    if record.response is None:
                        raise GatewayTimeout(message, **_pair_of(record)) from None
                    record.outcome, record.error = "error", message
                    await _end_stream_with_error(record.response, message, 504)
                    response = record.response
            record.status = response.status
            return response
        except RouterError as error:
            record.status = error.status
            record.outcome = "error"
            record.error = error.message
            raise
        except web.HTTPException as exc:  # aiohttp's own, e.g. 413 while reading the body
            record.status = exc.status
            record.outcome = "error"
            raise
        except asyncio.CancelledError:
            record.outcome = "client_disconnect"
            record.status = 499
            raise
        finally:
            record.e2e_s = time.monotonic() - record.started
            for observe in self.request_observers:
                observe(record)

    # ---- pair selection ----------------------------------------------------------------------------
    def select_pair(self, info: RequestInfo, avoid: set[Worker] | None = None) -> tuple[Worker, Worker]:
        """Pick one routable prefill and decode; `avoid` holds workers that already failed this request
        (used only while the pool has others)."""
        prefills = self.registry.routable(Role.PREFILL)
        decodes = self.registry.routable(Role.DECODE)
        if avoid:
            prefills = tuple(w for w in prefills if w not in avoid) or prefills
            decodes = tuple(w for w in decodes if w not in avoid) or decodes
        if not prefills or not decodes:
            missing = " and ".join(r for r, pool in (("prefill", prefills), ("decode", decodes)) if not pool)
            raise ServiceUnavailable(f"no routable {missing} worker", headers={"Retry-After": "1"})
        prefill = self.policies[Role.PREFILL].select(prefills, info) if len(prefills) > 1 else prefills[0]
        decode = self.policies[Role.DECODE].select(decodes, info) if len(decodes) > 1 else decodes[0]
        return prefill, decode

    def _backoff(self, attempt: int) -> float:
        r = self._retry
        delay = min(r.initial_backoff_ms * (r.backoff_multiplier ** attempt), r.max_backoff_ms) / 1000
        return delay * (1 + r.jitter_factor * (2 * random.random() - 1))

    # ---- attempts ----------------------------------------------------------------------------------
    async def _attempts(self, request, route, upstream_path, body, shape, headers, info, record, deadline):
        retry = self._retry
        max_attempts = 1 + (retry.max_retries if retry.enabled else 0)
        aborted_retries = 0
        attempt_no = 0
        failed: set[Worker] = set()
        while True:
            # Also on the first attempt: a request admitted just before a hold must not reach a server that
            # is being quiesced.
            await self.admission.wait_open(deadline)
            prefill, decode = self.select_pair(info, failed)
            payload_body = dict(body)
            inject_bootstrap(payload_body, shape, prefill)
            rids = assign_rid(payload_body, shape, self.config.inject_rid)
            attempt = Attempt(prefill, decode, orjson.dumps(payload_body), rids,
                              (prefill.abort_epoch, decode.abort_epoch))
            record.prefill, record.decode = prefill, decode
            record.attempts += 1
            self.live.add(attempt)
            try:
                if shape.stream:
                    return await self._stream(request, upstream_path, attempt, shape, headers, record)
                return await self._unary(upstream_path, attempt, shape, headers, record)
            except LegFailed as failure:
                if failure.router_abort:
                    if self._retry_abort(attempt) and aborted_retries < MAX_ABORT_RETRIES:
                        # Aborted by the router (conversion, weight update) before any token: re-send.
                        aborted_retries += 1
                        record.retries_aborted += 1
                        logger.info("re-sending request aborted by the router on %s (%s)", failure.worker.url,
                                    failure.reason)
                        continue
                    # The servers' answer to the abort was an error or nothing: give SGLang's abort answer.
                    record.outcome = "aborted"
                    record.error = failure.reason
                    return abort_response(route, body, shape, attempt.rids,
                                          weight_version=attempt.decode.weight_version)
                attempt_no += 1
                failed.add(failure.worker)
                if failure.retryable and attempt_no < max_attempts:
                    logger.warning("attempt %d failed on %s: %s; retrying on another pair", attempt_no,
                                   failure.worker.url, failure.reason)
                    await asyncio.sleep(self._backoff(attempt_no - 1))
                    continue
                record.outcome = "error"
                record.error = failure.reason
                return failure.response()
            finally:
                self.live.discard(attempt)

    # ---- eviction: giving up on a worker for requests that can still go elsewhere -------------------
    def evict(self, worker: Worker, reason: str) -> int:
        """Stop waiting on `worker` (declared down by its health probes) for every request that has not sent
        a byte to its client: its leg is cancelled and aborted on the server, and the request is retried on
        another pair like any failure before the first byte. Requests already streaming are left alone.
        Returns how many requests were re-routed. Nothing happens while the worker is the last of its pool:
        with nowhere else to go, waiting on a slow server beats failing its requests."""
        if not self.registry.routable(worker.role):
            logger.warning("%s is down but the last of its pool: its requests keep waiting", worker.url)
            return 0
        count = 0
        for attempt in self.live.on((worker,)):
            if attempt.streaming:
                continue
            for leg in attempt.legs:
                if leg.worker is worker and leg.is_open and not leg.detached and not leg.task.done():
                    attempt.evicted = reason
                    leg.task.cancel()
                    self._abort_on(worker, attempt.rids)
                    count += 1
        if count:
            logger.warning("re-routing %d request(s) waiting on %s: %s", count, worker.url, reason)
        return count

    def _retry_abort(self, attempt: Attempt) -> bool:
        """Whether a router-aborted attempt is re-sent (else the client gets the abort answer)."""
        if attempt.abort_action is not None:
            return attempt.abort_action == RETRY
        return self._retry.retry_aborted

    # ---- legs --------------------------------------------------------------------------------------
    def _open_leg(self, worker: Worker, role: Role, coro) -> "Leg":
        self.registry.acquire(worker)
        return Leg(self, worker, role, asyncio.get_running_loop().create_task(coro))

    def _leg_done(self, worker: Worker, role: Role, outcome: Outcome, fault: bool = True) -> None:
        self.registry.release(worker)
        if outcome is Outcome.SUCCESS:
            verdict: bool | None = True
        else:
            verdict = False if outcome is Outcome.ERROR and fault else None
            if outcome is Outcome.ERROR:
                worker.failures_total += 1
        for observe in self.leg_observers:
            observe(worker, verdict)
        self.policies[role].on_complete(worker, outcome)

    def _abort_on(self, worker: Worker, rids: list[str]) -> None:
        if rids:
            self.spawn(self._send_aborts(worker, rids))

    async def _send_aborts(self, worker: Worker, rids: list[str]) -> None:
        # Over the legs' pool: a burst of disconnects (a load test stopping, a client timing out many
        # requests) sends two aborts per request while the router is busiest.
        for rid in rids:
            try:
                async with asyncio.timeout(ABORT_TIMEOUT_S):
                    resp = await self.upstream.post(worker.url, "/abort_request", orjson.dumps({"rid": rid}),
                                                    self._abort_headers)
                    try:
                        await resp.read()
                    finally:
                        resp.close()
            except (UpstreamError, TimeoutError, OSError) as exc:
                logger.debug("abort of %s on %s failed: %s", rid, worker.url, exc)

    def _failure(self, leg: "Leg", attempt: Attempt) -> LegFailed | None:
        """Classify a finished leg task: None if it answered 200."""
        task, worker, role = leg.task, leg.worker, leg.role
        router_abort = attempt.router_aborted()
        if task.cancelled():
            if attempt.evicted is not None:
                return LegFailed(worker, 502, b"", "", retryable=True,
                                 reason=f"{role} {worker.url} given up: {attempt.evicted}")
            exc: BaseException | None = asyncio.CancelledError("leg cancelled")
        else:
            exc = task.exception()
        if exc is not None:
            if not isinstance(exc, (UpstreamError, asyncio.TimeoutError, OSError, asyncio.CancelledError)):
                raise exc
            return LegFailed(worker, 502, b"", "", retryable=True, router_abort=router_abort,
                             reason=f"{role} {worker.url} failed: {type(exc).__name__}: {exc}")
        status, body, content_type = task.result()[:3]
        if status == 200:
            return None
        retryable = status >= 500 or status in RETRYABLE_CLIENT_STATUSES
        text = body[:300].decode(errors="replace")
        return LegFailed(worker, status, body, content_type, retryable=retryable, router_abort=router_abort,
                         reason=f"{role} {worker.url} answered {status}: {text}")

    def _conclude(self, leg: "Leg", attempt: Attempt) -> LegFailed | None:
        """Close a finished leg, counting its outcome; return its failure if any."""
        failure = self._failure(leg, attempt)
        if failure is None:
            leg.finish(Outcome.SUCCESS)
        else:
            leg.finish(Outcome.ERROR, fault=failure.worker_fault)
        return failure

    async def _finish_later(self, leg: "Leg", attempt: Attempt) -> None:
        """A prefill leg still running after decode answered: keep it counted until it ends."""
        try:
            await _first_done((leg.task,))
            self._conclude(leg, attempt)
        except asyncio.CancelledError:  # router shutting down
            leg.cancel(attempt.rids)
            raise
        except Exception:
            leg.finish(Outcome.ERROR, fault=False)

    def _post(self, worker: Worker, path: str, attempt: Attempt, headers: bytes) -> Awaitable[UpstreamResponse]:
        return self.upstream.post(worker.url, path, attempt.payload, headers)

    # ---- non-streaming -----------------------------------------------------------------------------
    async def _unary_leg(self, worker: Worker, path: str, attempt: Attempt, headers) -> tuple[int, bytes, str]:
        resp = await self._post(worker, path, attempt, headers)
        try:
            return resp.status, await resp.read(), resp.content_type
        finally:
            resp.close()

    async def _unary(self, path, attempt: Attempt, shape: RequestShape, headers, record) -> web.Response:
        p = self._open_leg(attempt.prefill, Role.PREFILL, self._unary_leg(attempt.prefill, path, attempt, headers))
        d = self._open_leg(attempt.decode, Role.DECODE, self._unary_leg(attempt.decode, path, attempt, headers))
        attempt.legs = [p, d]
        try:
            while d.is_open:
                await _first_done([leg.task for leg in (p, d) if leg.is_open])
                for leg, other in ((p, d), (d, p)):
                    if leg.is_open and leg.task.done():
                        failure = self._conclude(leg, attempt)
                        if failure is not None:
                            other.cancel(attempt.rids)
                            raise failure
            status, body, content_type = d.task.result()
            if attempt.router_aborted() and self._retry_abort(attempt) and _router_aborted_answer(body):
                # Nothing has reached the client yet, so even a partial answer can be re-sent whole.
                p.cancel(attempt.rids)
                raise LegFailed(d.worker, status, body, content_type, retryable=False, router_abort=True,
                                reason="aborted by the router before the client saw a token")
            if shape.return_logprob:
                if p.is_open:
                    await _first_done((p.task,))
                    self._conclude(p, attempt)
                if not p.task.cancelled() and p.task.exception() is None and p.task.result()[0] == 200:
                    answer = orjson.loads(body)
                    merge_answer(orjson.loads(p.task.result()[1]), answer)
                    body = orjson.dumps(answer)
            if p.is_open:
                p.detach()
                self.spawn(self._finish_later(p, attempt))
            return web.Response(body=body, status=status, content_type=content_type or "application/json")
        except asyncio.CancelledError:
            # The client went away (or the deadline passed): stop both legs on the servers too.
            p.cancel(attempt.rids)
            d.cancel(attempt.rids)
            raise
        finally:
            p.ensure_closed()
            d.ensure_closed()

    # ---- streaming ---------------------------------------------------------------------------------
    async def _prefill_stream_leg(self, worker: Worker, path: str, attempt: Attempt, headers,
                                  keep_events: bool) -> tuple[int, bytes, str, list]:
        """Read prefill's whole answer (it streams one token); keep its events when logprobs are merged."""
        resp = await self._post(worker, path, attempt, headers)
        try:
            body = await resp.read()
        finally:
            resp.close()
        events = []
        if resp.status == 200 and keep_events:
            splitter = sse.EventSplitter()
            events = [e for raw in splitter.feed(body + b"\n\n") if (e := sse.parse_event(raw)) is not None]
        return resp.status, body, resp.content_type, events

    async def _decode_first_event(self, worker: Worker, path: str, attempt: Attempt, headers):
        """Open decode's stream and read up to its first complete event.

        Returns (status, error body, content type, (response, events, splitter) or None)."""
        resp = await self._post(worker, path, attempt, headers)
        try:
            if resp.status != 200:
                return resp.status, await resp.read(), resp.content_type, None
            splitter = sse.EventSplitter()
            async for chunk in resp:
                events = splitter.feed(chunk)
                if events:
                    opened, resp = resp, None  # ownership passes to the caller
                    return 200, b"", opened.content_type, (opened, events, splitter)
            raise UpstreamProtocolError("decode stream ended before its first event")
        finally:
            if resp is not None:
                resp.close()

    async def _stream(self, request: web.Request, path, attempt: Attempt, shape: RequestShape, headers,
                      record: RequestRecord) -> web.StreamResponse:
        p = self._open_leg(attempt.prefill, Role.PREFILL,
                           self._prefill_stream_leg(attempt.prefill, path, attempt, headers, shape.return_logprob))
        d = self._open_leg(attempt.decode, Role.DECODE, self._decode_first_event(attempt.decode, path, attempt, headers))
        attempt.legs = [p, d]
        d_resp: UpstreamResponse | None = None
        try:
            # Phase 1: until decode's first event, any failure is answered (or retried) as plain HTTP.
            while not d.task.done():
                await _first_done([leg.task for leg in (p, d) if leg.is_open and not leg.task.done()])
                if p.is_open and p.task.done():
                    failure = self._conclude(p, attempt)
                    if failure is not None:
                        d.cancel(attempt.rids)
                        raise failure
            failure = self._failure(d, attempt)
            if failure is not None:
                d.finish(Outcome.ERROR, fault=failure.worker_fault)
                p.cancel(attempt.rids)
                raise failure
            d_resp, events, splitter = d.task.result()[3]
            if attempt.router_aborted() and self._retry_abort(attempt) \
                    and _aborted_before_first_token(sse.parse_event(events[0])):
                d.finish(Outcome.CANCELLED)
                p.cancel(attempt.rids)
                raise LegFailed(d.worker, 200, b"", "", retryable=False, router_abort=True,
                                reason="aborted by the router before the first token")

            # Phase 2: the client sees a stream from here on.
            attempt.streaming = True
            prefill_first: dict[int, dict] = {}
            if shape.return_logprob:
                if p.is_open:
                    await _first_done((p.task,))
                    self._conclude(p, attempt)
                if not p.task.cancelled() and p.task.exception() is None:
                    prefill_first = index_prefill_events(p.task.result()[3])
            if p.is_open:
                # Decode has its KV: the prefill leg holds its worker until its own answer ends, not until
                # decode's stream does (that would count it as prefill load, and stretch prefill drains).
                p.detach()
                self.spawn(self._finish_later(p, attempt))
            response = web.StreamResponse(status=200, headers=SSE_HEADERS)
            record.response = response
            await response.prepare(request)
            first_at = time.monotonic()
            record.ttft_s = first_at - record.started
            ok = await self._relay(response, d_resp, events, splitter, prefill_first, record, first_at)
            d.finish(Outcome.SUCCESS if ok else Outcome.ERROR)
            return response
        except (asyncio.CancelledError, ClientGone):
            record.outcome = "client_disconnect"
            p.cancel(attempt.rids)
            d.cancel(attempt.rids)
            raise
        finally:
            if d_resp is not None:
                d_resp.close()
            elif d.task.done() and not d.task.cancelled() and d.task.exception() is None:
                opened = d.task.result()[3]
                if opened is not None:
                    opened[0].close()
            p.ensure_closed()
            d.ensure_closed()

    async def _relay(self, response: web.StreamResponse, d_resp: UpstreamResponse, events: list[bytes],
                     splitter: sse.EventSplitter, prefill_first: dict[int, dict], record: RequestRecord,
                     first_at: float) -> bool:
        """Relay decode's stream; True if it ended with [DONE]. Mid-stream failure → error event + [DONE]."""
        merge = bool(prefill_first)
        last_at = first_at
        saw_done = False

        async def write(data: bytes) -> None:
            try:
                await response.write(data)
            except (ConnectionResetError, ConnectionError) as exc:
                raise ClientGone(str(exc)) from None

        def rewrite(raw_events: list[bytes]) -> bytes:
            nonlocal saw_done
            out = []
            for raw in raw_events:
                if sse.is_done(raw):
                    saw_done = True
                elif merge:
                    payload = sse.parse_event(raw)
                    if isinstance(payload, dict):
                        merge_meta(prefill_first.get(payload.get("index", 0)), payload)
                        raw = sse.event(payload)
                out.append(raw)
            return b"".join(out)

        try:
            await write(rewrite(events))
            record.events = len(events)
            if merge:
                async for chunk in d_resp:
                    new = splitter.feed(chunk)
                    if new:
                        last_at = time.monotonic()
                        record.events += len(new)
                        await write(rewrite(new))
            else:
                # Relay bytes as they come; only the tail is inspected for the final [DONE].
                tail = splitter.rest()
                if tail:
                    await write(tail)
                async for chunk in d_resp:
                    last_at = time.monotonic()
                    record.events += chunk.count(b"data:")
                    await write(chunk)
                    tail = (tail + chunk)[-64:]
                saw_done = saw_done or tail.rstrip(b"\r\n").endswith(sse.DONE.rstrip(b"\n"))
        except (UpstreamError, asyncio.TimeoutError) as exc:
            record.outcome = "error"
            record.error = f"decode stream failed: {exc}"
            logger.warning("decode %s failed mid-stream: %s", record.decode.url if record.decode else "?", exc)
            await write(sse.error_event(f"decode worker failed mid-stream: {type(exc).__name__}: {exc}") + sse.DONE)
            return False
        if record.events > 1:
            record.itl_s = (last_at - first_at) / (record.events - 1)
        if not saw_done:
            record.outcome = "error"
            record.error = "decode stream ended without [DONE]"
            await write(sse.error_event("decode worker closed the stream before [DONE]") + sse.DONE)
            return False
        try:
            await response.write_eof()
        except (ConnectionResetError, ConnectionError) as exc:
            raise ClientGone(str(exc)) from None
        return True


async def _first_done(tasks) -> None:
    """Wait until one of `tasks` is done; like asyncio.wait(FIRST_COMPLETED), without its per-call sets and
    checks (twice per request). Never cancels the tasks, never raises their exceptions."""
    waiter = asyncio.get_running_loop().create_future()

    def wake(_task) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for task in tasks:
        task.add_done_callback(wake)
    try:
        await waiter
    finally:
        for task in tasks:
            task.remove_done_callback(wake)


def _pair_of(record: RequestRecord) -> dict:
    """The pair an error happened on, for the error body (operators and the soak run attribute failures)."""
    return {"prefill": record.prefill.url if record.prefill else None,
            "decode": record.decode.url if record.decode else None}


async def _end_stream_with_error(response: web.StreamResponse, message: str, code: int) -> None:
    try:
        await response.write(sse.error_event(message, code=code, type_="timeout") + sse.DONE)
        await response.write_eof()
    except (ConnectionResetError, ConnectionError, RuntimeError):
        pass


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class Leg:
    """One leg of a request: its task and its hold on the worker, released exactly once."""

    __slots__ = ("proxy", "worker", "role", "task", "is_open", "detached")

    def __init__(self, proxy: Proxy, worker: Worker, role: Role, task: asyncio.Task) -> None:
        self.proxy, self.worker, self.role, self.task = proxy, worker, role, task
        self.is_open = True
        self.detached = False

    def finish(self, outcome: Outcome, fault: bool = True) -> None:
        """`fault`: whether an ERROR outcome counts against the worker (passive health)."""
        if self.is_open:
            self.is_open = False
            self.proxy._leg_done(self.worker, self.role, outcome, fault)

    def cancel(self, rids: list[str]) -> None:
        """Stop the leg here and on its server (the other leg failed, or the client left)."""
        if self.is_open:
            if not self.task.done():
                self.task.cancel()
            self.proxy._abort_on(self.worker, rids)
            self.finish(Outcome.CANCELLED)

    def detach(self) -> None:
        """Ownership moved to a background task that will finish the leg."""
        self.detached = True

    def ensure_closed(self) -> None:
        """Last resort on unexpected errors: never leak a count or a task."""
        if self.is_open and not self.detached:
            if not self.task.done():
                self.task.cancel()
            self.finish(Outcome.ERROR, fault=False)


def _router_aborted_answer(body: bytes) -> bool:
    """A whole (non-streaming) answer in which some sequence ended with finish_reason abort."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    for item in answer if isinstance(answer, list) else [answer]:
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info")
        if isinstance(meta, dict):
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and reason.get("type") == "abort":
                return True
        choices = item.get("choices")
        if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort"
                                             for c in choices):
            return True
    return False


def _aborted_before_first_token(answer: object) -> bool:
    """True when every sequence of an answer (or a stream's first event) was aborted with no output."""
    items = answer if isinstance(answer, list) else [answer]
    if not items:
        return False
    for item in items:
        if not isinstance(item, dict):
            return False
        meta = item.get("meta_info")
        if isinstance(meta, dict):
            reason = meta.get("finish_reason")
            if not (isinstance(reason, dict) and reason.get("type") == "abort"):
                return False
            if meta.get("completion_tokens") or item.get("output_ids") or item.get("text"):
                return False
            continue
        choices = item.get("choices")
        if isinstance(choices, list) and choices:
            for choice in choices:
                if choice.get("finish_reason") != "abort":
                    return False
                content = (choice.get("message") or choice.get("delta") or {}).get("content") or choice.get("text")
                if content:
                    return False
            continue
        return False
    return True
