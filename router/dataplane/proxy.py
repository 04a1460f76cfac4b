"""The request path: admit → pick a pair → inject bootstrap fields → dispatch both legs → relay → finish.

A client request runs as a loop of attempts, each on a freshly chosen pair with fresh rooms (`Dispatcher`
runs one attempt's legs). Nothing reaches the client before decode's first event, so every failure up to
then can still be answered with a plain HTTP error, or retried on another pair. After the first byte, a
failure ends the stream with an SSE error event and `[DONE]`. One `RequestRecord` per request goes to the
request observers (metrics, access log, rebalancer) at the end, whatever ended it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import orjson
from aiohttp import web

from policies import Policy, RequestInfo
from router.core.config import RouterConfig
from router.core.errors import BadRequest, GatewayTimeout, RouterError, ServiceUnavailable, parse_json_object
from router.core.records import RequestObserver, RequestRecord
from router.core.request_body import NESTING_LIMIT, check_declared_size, decode_content, read_unstalled
from router.core.registry import Registry, Role, Worker
from router.core.router_identity import HOP_LINE
from router.core.tracing import TRACE_HEADERS, RequestTracer
from router.core.traffic import AbortAction
from router.core.request_shape import assign_rid, inject_bootstrap, prompt_text, request_sizes, shape_of
from router.dataplane.aborts import abort_response
from router.dataplane.admission import Admission
from router.dataplane.attempt import Attempt, LegFailed
from router.dataplane.dispatch import Dispatcher
from router.dataplane.rank_placement import RankPlacer, complete_client_ranks, has_client_ranks
from router.dataplane.leg_room import LegRoom
from router.dataplane.live import LiveRequests
from router.dataplane.pd_admission import PdAdmission
from router.dataplane.stream_relay import ClientGone, end_stream_with_error
from router.dataplane.upstream_http import header_lines

logger = logging.getLogger(__name__)

# Request headers passed to both legs; the client's trace context too unless the router traces (then each leg
# gets its own span's traceparent).
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
UNTRACED_FORWARDED_HEADERS = FORWARDED_HEADERS + TRACE_HEADERS
MAX_ABORT_RETRIES = 16
# A leg that could not be sent for want of the router's own descriptors waits for one of the legs' connections
# to close, at most this long (the shortage may be another part's), then goes again on the same pair.
LOCAL_RETRY_WAIT_S = 0.5


class Proxy:
    """One client request from admission to its record: attempts on fresh pairs until one answers."""

    def __init__(self, *, config: RouterConfig, registry: Registry, policies: dict[Role, Policy],
                 admission: Admission, dispatcher: Dispatcher, live: LiveRequests, leg_room: LegRoom,
                 pd_admission: PdAdmission | None, tracer: RequestTracer | None = None,
                 ranks: RankPlacer | None = None, request_observers: tuple[RequestObserver, ...] = (),
                 arrival_observers: tuple[RequestObserver, ...] = ()) -> None:
        """`policies`: each pool's policy (the dict is kept: admin views and upkeep read the same objects).
        `dispatcher`: runs one attempt's legs; `live`: the attempts in flight, by rid (the abort endpoint, the
        flows); `leg_room`: the router's bounds on the legs' connections; `pd_admission`: SMG's PD admission
        gates (None when both are off). The composition root builds them and gives the dispatcher the same
        `live`, `leg_room` and `pd_admission`.
        `tracer`: with --enable-trace, makes each request's span (None: no tracing, no cost).
        `ranks`: `--dp-aware`'s rank choice (router/dataplane/rank_placement.py); None: bodies go out as the client sent
        them (a client's own rank fields checked and completed).
        `request_observers`: told one `RequestRecord` per request at its end (metrics, access log, rebalancer);
        `arrival_observers`: told of every request whose shape was read, as it arrives (the rebalancer's mix:
        sizes at arrival)."""
        self.config = config
        self._tracer = tracer
        self._forwarded_headers = FORWARDED_HEADERS if tracer is not None else UNTRACED_FORWARDED_HEADERS
        self.registry = registry
        # With a worker key, every call to a worker carries it (the client's own Authorization is for us).
        self._worker_auth = f"Bearer {config.worker_api_key}" if config.worker_api_key else None
        self.admission = admission
        self.dispatcher = dispatcher
        self.live = live
        self.leg_room = leg_room
        self.pd_admission = pd_admission
        self.policies = policies
        self.request_observers = request_observers
        self.arrival_observers = arrival_observers
        self._needs_text = any(policy.needs_text for policy in policies.values())
        self._timeout = config.request_timeout_secs
        self._retry = config.retry
        self._max_payload = config.admission.max_payload_size
        self._body_stall = config.connections.stream_body_stall_timeout_secs  # 0: a body may stall for ever
        self._limits = config.admission  # --max-n, --max-batch-size
        self._ranks = ranks

    # ---- entry point -----------------------------------------------------------------------------
    async def handle(self, request: web.Request, route: str, upstream_path: str) -> web.StreamResponse:
        record = RequestRecord(route=route, stream=False, started=time.monotonic())
        if self._tracer is not None:
            record.trace = self._tracer.start(request.headers, route)
        try:
            body = await self._read_body(request)
            shape = shape_of(route, body, self._limits)
            record.stream = shape.stream
            record.prompt_size, record.answer_size = request_sizes(route, body)
            for arrived in self.arrival_observers:
                arrived(record)
            forwarded = {h: v for h in self._forwarded_headers if (v := request.headers.get(h)) is not None}
            if self._worker_auth is not None:
                forwarded["Authorization"] = self._worker_auth
            record.request_id = forwarded.get("X-Request-Id", "")
            headers = HOP_LINE + header_lines(forwarded) if forwarded else HOP_LINE  # wire bytes, both legs
            info = RequestInfo(route=route, batch_size=shape.batch_size, headers=request.headers,
                               text=prompt_text(route, body) if self._needs_text else None)
            deadline = record.started + self._timeout
            queued_at = time.monotonic()
            async with self.admission.slot():
                if record.trace is not None:
                    record.trace.event("admitted", {"pd.admission_wait_s": time.monotonic() - queued_at})
                try:
                    async with asyncio.timeout_at(asyncio.get_running_loop().time()
                                                  + (deadline - time.monotonic())):
                        response = await self._attempts(request, route, upstream_path, body, shape, headers,
                                                        info, record, deadline)
                except TimeoutError:
                    message = f"request did not finish within {self._timeout:g} s"
                    if record.response is None and record.waiting_for_room:  # no server has seen it
                        raise ServiceUnavailable(f"no room for the request's legs within its deadline "
                                                 f"({self._timeout:g} s): the router is at its connection limits",
                                                 headers={"Retry-After": "1"}) from None
                    if record.response is None:
                        raise GatewayTimeout(message, **_pair_of(record)) from None
                    record.error = message
                    await end_stream_with_error(record.response, message, 504)
                    response = record.response
                if record.response is not None and response is not record.response:
                    response = await self._end_kept_alive_stream(record, response)
            record.status = response.status
            return response
        except RouterError as error:
            record.status = error.status
            record.error = error.message
            if record.response is not None and record.response.prepared:  # a kept-alive stream: end it so
                await end_stream_with_error(record.response, error.message, error.status, type_=error.type)
                return record.response
            raise
        except web.HTTPException as exc:  # aiohttp's own, e.g. 413 while reading the body
            record.status = exc.status
            raise
        except ClientGone:  # writing the stream failed: the client left (its legs are stopped already)
            record.client_gone = True
            record.status = 499
            return record.response  # aiohttp's end of it finds the connection gone, and says nothing
        except asyncio.CancelledError:  # the client left (the handler is cancelled), or the router stops
            record.client_gone = True
            record.status = 499
            raise
        finally:
            record.e2e_s = time.monotonic() - record.started
            record.conclude()
            for observe in self.request_observers:
                observe(record)
            if record.trace is not None:
                record.trace.end(record)

    @staticmethod
    async def _end_kept_alive_stream(record: RequestRecord, answer: web.StreamResponse) -> web.StreamResponse:
        """--sse-keepalive-secs sent the stream's head before the attempts ended with a plain answer (an error,
        SGLang's abort answer): the answer goes on the stream instead, as its events or as an error event."""
        body = getattr(answer, "body", None)
        raw = bytes(body) if isinstance(body, (bytes, bytearray)) else b""
        if answer.content_type == "text/event-stream" and raw:
            try:
                await record.response.write(raw)
                await record.response.write_eof()
            except (ConnectionError, RuntimeError):
                pass
        else:
            try:
                message = orjson.loads(raw)["error"]["message"]
            except Exception:
                message = record.error or f"the request failed ({answer.status})"
            await end_stream_with_error(record.response, message, answer.status, type_="upstream_error")
        return record.response

    async def _read_body(self, request: web.Request) -> dict:
        """The client's JSON object: a declared size over --max-payload-size is 413 before a byte is read, the
        body is decoded from its content coding (gzip, deflate) and bounded again once decoded."""
        limit = self._max_payload
        check_declared_size(request, limit, "--max-payload-size")
        if self._body_stall and not request.content.is_eof():  # still arriving: bounded by its stalls too
            raw = await read_unstalled(request, limit, self._body_stall)
        else:
            raw = await request.read()  # bounded by the app's client_max_size (the same limit) while it is read
        if "Content-Encoding" in request.headers:
            raw = decode_content(request, raw, limit, "--max-payload-size")
        return parse_json_object(raw)

    # ---- pair selection ----------------------------------------------------------------------------
    def select_pair(self, info: RequestInfo, avoid: set[Worker] | None = None,
                    pinned: tuple[Worker, Worker] | None = None) -> tuple[Worker, Worker]:
        """Pick one routable prefill and decode; `avoid` holds workers that already failed this request
        (used only while the pool has others); `pinned`: the pair to go again on while both stay routable (a
        leg the router could not send for want of its own descriptors)."""
        prefills = self.registry.routable(Role.PREFILL)
        decodes = self.registry.routable(Role.DECODE)
        if pinned is not None and pinned[0] in prefills and pinned[1] in decodes:
            return pinned
        if (room := self.leg_room).per_worker is not None:
            prefills = room.with_room(prefills) or prefills
            decodes = room.with_room(decodes) or decodes
        if (pd := self.pd_admission) is not None:
            if pd.prefill is not None:
                prefills = pd.prefill.with_room(prefills) or prefills
            if pd.decode is not None:
                decodes = pd.decode.with_room(decodes) or decodes
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
        pinned: tuple[Worker, Worker] | None = None  # go again on this pair: its legs could not be sent here
        failed: set[Worker] = set()
        # Failures the request itself may have caused (LegFailed.signature): counted against their workers once
        # the request ends, unless another pair failed on it the same way.
        held: list[LegFailed] = []
        trace = record.trace
        try:
            while True:
                # Also on the first attempt: a request admitted just before a hold must not reach a server that
                # is being quiesced.
                if trace is None or self.admission.is_open:
                    await self.admission.wait_open(deadline)
                else:
                    await self._traced_wait_open(trace, deadline)
                if self.pd_admission is not None:  # room on a prefill (FIFO) and a decode, or 429/503
                    await self.pd_admission.enter()
                if not self.leg_room.can_enter_now():  # the router's connection bounds: wait, FIFO, no worker held
                    record.waiting_for_room = True
                    await self.leg_room.wait()
                    record.waiting_for_room = False
                prefill, decode = self.select_pair(info, failed, pinned)  # no await from here until the legs hold them
                pinned = None
                payload_body = dict(body)
                inject_bootstrap(payload_body, shape, prefill)
                rids = assign_rid(payload_body, shape, self.config.inject_rid)
                decode_payload = ranks = None
                try:
                    if self._ranks is not None:
                        payload, decode_payload, *ranks = self._ranks.place(payload_body, prefill, decode)
                    else:
                        if has_client_ranks(payload_body):
                            complete_client_ranks(payload_body, prefill, decode)
                        payload = orjson.dumps(payload_body)
                except orjson.JSONEncodeError:  # read, but too deep to write back: the same on every attempt
                    raise BadRequest(f"request body is {NESTING_LIMIT}") from None
                attempt = Attempt(prefill, decode, payload, rids, (prefill.abort_epoch, decode.abort_epoch),
                                  decode_payload=decode_payload)
                if ranks:
                    attempt.ranks = (ranks[0], ranks[1])
                    self._ranks.enter(prefill, ranks[0])
                    self._ranks.enter(decode, ranks[1])
                record.prefill, record.decode = prefill, decode
                record.attempts += 1
                if trace is not None:
                    trace.event("pair_chosen", {"pd.attempt": record.attempts})  # the legs' spans name the pair
                    attempt.traces = trace.legs(prefill, decode, record.attempts, rids)
                self.live.add(attempt)
                try:
                    if shape.stream:
                        return await self.dispatcher.stream(request, upstream_path, attempt, shape, headers, record)
                    return await self.dispatcher.unary(upstream_path, attempt, shape, headers, record)
                except LegFailed as failure:
                    if failure.local is not None:  # the router's own descriptors ran out: no server's fault
                        record.local_retries += 1
                        await self.dispatcher.upstream.wait_descriptor(LOCAL_RETRY_WAIT_S)
                        pinned = (prefill, decode)
                        continue
                    if failure.abort is not None:  # the router aborted its servers (a flow, an operator)
                        attempt.ended_aborted = True
                        if failure.abort is AbortAction.RETRY and aborted_retries < MAX_ABORT_RETRIES:
                            # Before any token reached the client: re-sent, once the fleet is open again.
                            aborted_retries += 1
                            record.retries_aborted += 1
                            if trace is not None:
                                trace.event("retry_aborted", {"pd.reason": failure.reason[:500]})
                            logger.info("re-sending request aborted by the router on %s (%s)",
                                        failure.worker.url, failure.reason)
                            continue
                        # The servers' answer to the abort was an error or nothing: give SGLang's abort answer.
                        record.abort_answered = True
                        record.error = failure.reason
                        return abort_response(route, body, shape, attempt.rids,
                                              weight_version=attempt.decode.weight_version)
                    attempt_no += 1
                    failed.add(failure.worker)
                    if failure.signature is not None and failure.worker_fault:
                        if any(f.signature == failure.signature for f in held):
                            # The same failure on another pair: the request's own, not the servers'. Not
                            # retried further, and no breaker counts it.
                            held[:] = [f for f in held if f.signature != failure.signature]
                            record.error = f"{failure.reason} (the same on {attempt_no} pairs: not retried)"
                            logger.info("request failed the same way on two pairs (%s): answered as the servers "
                                        "did, not retried, counted against no server", failure.reason)
                            return failure.response()
                        held.append(failure)
                    if failure.retryable and attempt_no < max_attempts:
                        logger.warning("attempt %d failed on %s: %s; retrying on another pair", attempt_no,
                                       failure.worker.url, failure.reason)
                        if trace is not None:
                            trace.event("retry", {"pd.attempt": attempt_no, "pd.failed_worker": failure.worker.url,
                                                  "pd.reason": failure.reason[:500]})
                        await asyncio.sleep(self._backoff(attempt_no - 1))
                        continue
                    record.error = failure.reason
                    return failure.response()
                finally:
                    if attempt.tally is not None:  # marked by an operation that counts how they end
                        attempt.tally.ended(attempt.ended_aborted)
                    if attempt.ranks is not None:
                        self._ranks.leave(prefill, attempt.ranks[0])
                        self._ranks.leave(decode, attempt.ranks[1])
                    if attempt.lingering:
                        attempt.ended = True  # its prefill leg, still running, takes it out of `live` at its end
                    else:
                        self.live.discard(attempt)
        finally:
            for failure in held:
                self.dispatcher.blame(failure.worker)

    async def _traced_wait_open(self, trace, deadline: float) -> None:
        """`Admission.wait_open`, and an `admission_held` event when the request waited out a fleet-wide hold."""
        started, holds = time.monotonic(), str(self.admission.gate_reasons)
        await self.admission.wait_open(deadline)
        trace.event("admission_held", {"pd.wait_s": time.monotonic() - started, "pd.holds": holds})


def _pair_of(record: RequestRecord) -> dict:
    """The pair an error happened on, for the error body (operators and the soak run attribute failures)."""
    return {"prefill": record.prefill.url if record.prefill else None,
            "decode": record.decode.url if record.decode else None}


PROXY = web.AppKey("proxy", Proxy)
