"""Dispatching one attempt's two legs to its pair and reading their answers.

Both legs run as tasks of the request; a leg that fails first cancels the other (closing its connection and
aborting its rids on the server), because the survivor would otherwise wait for a KV transfer that never
comes. Nothing reaches the client before decode's first event, so every failure up to then raises
`LegFailed`, for the proxy to answer or retry; from decode's first event on, `relay` streams to the client.
Each leg holds its worker's in-flight count until it ends, and its outcome goes to the role's policy, the
worker's failure count and the leg observers (passive health).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import orjson
from aiohttp import web

from policies import LegOutcome, Policy
from router.core.records import RequestRecord
from router.core.registry import Registry, Role, Worker
from router.core.request_shape import RequestShape
from router.core.traffic import AbortAction
from router.dataplane import sse
from router.dataplane.aborts import aborted_before_first_token, some_sequence_aborted
from router.dataplane.attempt import Attempt, Leg, LegFailed, answer_signature, first_done
from router.dataplane.leg_aborts import LegAborts, with_authorization
from router.dataplane.leg_room import LegRoom
from router.dataplane.live import LiveRequests
from router.dataplane.logprobs import index_prefill_events, merge_answer
from router.dataplane.pd_admission import PdAdmission
from router.dataplane.stream_relay import KEEPALIVE_COMMENT, ClientGone, relay
from router.dataplane.sse import RESPONSE_HEADERS
from router.dataplane.upstream_http import (LocalResourceError, UpstreamError, UpstreamPool, UpstreamProtocolError,
                                            UpstreamResponse, UpstreamSilent)

logger = logging.getLogger(__name__)

# Before the first byte, a server error on either leg is retried on a fresh pair: in PD most 5xx are tied
# to the pair (SGLang answers 500 for a KV transfer that failed because the *other* server died), so a new
# pair usually succeeds. 4xx are the request's fault and go back as they are (except timeout / rate limit).
RETRYABLE_CLIENT_STATUSES = frozenset({408, 429})
CLOSED_BEFORE_ANSWER = "closed the connection before answering"  # upstream_http's words
# Server errors a request can cause (an exception on its input, an unsupported feature); 502, 503 and 504 tell
# the server's state (a proxy's, overloaded, unavailable), not the request's.
REQUEST_SHAPED = frozenset({500, 501})
LINGER_LOOKS_PER_TIMEOUT = 4  # how often overdue prefill legs are looked for (at most every 5 s)
LINGER_LOOK_MAX_S = 5.0

# (worker, verdict) for passive health: True served, False failed by the worker's fault (unreachable, 5xx,
# stream cut), None no verdict (cancelled, client error, router abort).
LegObserver = Callable[[Worker, "bool | None"], None]


async def open_stream(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    """The request's stream, its head sent (once: an attempt after a kept-alive one writes on the same stream)."""
    if record.response is None:
        response = web.StreamResponse(status=200, headers=RESPONSE_HEADERS)
        record.response = response
        try:
            await response.prepare(request)
        except ConnectionError as exc:  # the client left before the stream's head went out (its connection
            raise ClientGone(str(exc)) from None  # closing, the handler's cancellation not run yet)
    return record.response


class Dispatcher:
    """Runs attempts on their pairs: `unary` and `stream` return the client's response or raise LegFailed."""

    def __init__(self, *, registry: Registry, upstream: UpstreamPool, policies: dict[Role, Policy],
                 spawn: Callable[[Awaitable], asyncio.Task], aborts: LegAborts, live: LiveRequests,
                 room: LegRoom, pd_admission: PdAdmission | None, retry_aborted: bool,
                 leg_observers: tuple[LegObserver, ...] = (), linger_timeout: float | None = None,
                 sse_keepalive: float | None = None) -> None:
        """`room` counts the legs in flight; a leg's end frees room there and in `pd_admission` (SMG's gates;
        None when both are off). `leg_observers`: told each leg's verdict (passive health). `linger_timeout`: how long a prefill leg may run on after its decode answered (None: no bound).
        `sse_keepalive`: --sse-keepalive-secs on the streams relayed (None: none)."""
        self._sse_keepalive = sse_keepalive
        self.room = room
        self.pd_admission = pd_admission
        self.registry = registry
        self.upstream = upstream  # the legs
        self.aborts = aborts  # a stopped leg's rids aborted on its server
        self.policies = policies
        self.spawn = spawn  # owned background tasks (lingering prefill legs)
        self.leg_observers = leg_observers
        self._retry_aborted = retry_aborted
        self._live = live
        self._linger_timeout = linger_timeout
        self._lingering: dict[Leg, tuple[Attempt, float]] = {}  # leg -> (its attempt, its deadline)
        self._linger_look: asyncio.TimerHandle | None = None

    def router_abort(self, attempt: Attempt) -> AbortAction | None:
        """What the request path does with this attempt's answer if it is an abort the router made (None: the
        router aborted neither of its servers): RETRY, re-sent once the fleet is open (the client has seen
        nothing of it), or ANSWER, SGLang's abort answer. The attempt's mark says which (a flow's or an
        operator's abort); an abort seen only from the servers' abort epochs follows `retry_aborted`. The one
        place that decides it: `LegFailed.abort` carries the decision to the attempt loop."""
        if attempt.abort_action is not None:
            return attempt.abort_action
        if (attempt.prefill.abort_epoch, attempt.decode.abort_epoch) != attempt.epochs:
            return AbortAction.RETRY if self._retry_aborted else AbortAction.ANSWER
        return None

    # ---- legs --------------------------------------------------------------------------------------
    def _open_leg(self, worker: Worker, role: Role, coro, attempt: Attempt) -> Leg:
        self.registry.acquire(worker)
        self.room.open_legs += 1
        trace = None if attempt.traces is None else attempt.traces[role is Role.DECODE]
        return Leg(self, worker, role, asyncio.get_running_loop().create_task(coro), trace)

    def leg_done(self, worker: Worker, role: Role, outcome: LegOutcome, fault: bool = True) -> None:
        self.registry.release(worker)
        self.room.leg_ended()
        if (pd := self.pd_admission) is not None:
            pd.leg_ended(role)
        if outcome is LegOutcome.SUCCESS:
            verdict: bool | None = True
        else:
            verdict = False if outcome is LegOutcome.ERROR and fault else None
            if outcome is LegOutcome.ERROR:
                worker.failures_total += 1
        for observe in self.leg_observers:
            observe(worker, verdict)
        self.policies[role].on_complete(worker, outcome)

    def _failure(self, leg: Leg, attempt: Attempt) -> LegFailed | None:
        """Classify a finished leg task: None if it answered 200."""
        task, worker, role = leg.task, leg.worker, leg.role
        abort = self.router_abort(attempt)
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
            if isinstance(exc, LocalResourceError):  # the router's own limit: nothing reached the server
                return LegFailed(worker, 503, b"", "", retryable=True, abort=abort, local=exc.kind,
                                 reason=f"{role} {worker.url} not reached: {exc}")
            # Closed before answering what it was sent (a request that crashes the server looks like this):
            # the request may be why; refused, silent or slow servers are the servers' state.
            closed = isinstance(exc, UpstreamProtocolError) and CLOSED_BEFORE_ANSWER in str(exc)
            return LegFailed(worker, 502, b"", "", retryable=True, abort=abort,
                             signature=b"closed before answering" if closed else None,
                             reason=f"{role} {worker.url} failed: {type(exc).__name__}: {exc}")
        status, body, content_type = task.result()[:3]
        if status == 200:
            return None
        retryable = status >= 500 or status in RETRYABLE_CLIENT_STATUSES
        text = body[:300].decode(errors="replace")
        return LegFailed(worker, status, body, content_type, retryable=retryable, abort=abort,
                         signature=answer_signature(status, body) if status in REQUEST_SHAPED else None,
                         reason=f"{role} {worker.url} answered {status}: {text}")

    def _conclude(self, leg: Leg, attempt: Attempt) -> LegFailed | None:
        """Close a finished leg, counting its outcome; return its failure if any."""
        failure = self._failure(leg, attempt)
        if failure is None:
            leg.finish(LegOutcome.SUCCESS)
        elif failure.local is not None:  # never sent: neither the policy nor the worker's counts learn of it
            leg.finish(LegOutcome.CANCELLED)
        else:
            leg.finish(LegOutcome.ERROR, fault=failure.blame_now)
        return failure

    def blame(self, worker: Worker) -> None:
        """A failure held back until its request showed it was not its own (`LegFailed.signature`) counts now."""
        for observe in self.leg_observers:
            observe(worker, False)

    # ---- lingering prefill legs ----------------------------------------------------------------------
    def linger(self, leg: Leg, attempt: Attempt) -> None:
        """Decode has answered (or begun streaming) while the prefill leg still runs: a background task keeps
        the leg counted until it ends, and it is cut if it is still open `linger_timeout` later (a prefill
        whose KV was taken owes only the end of its answer). Deadlines are checked by a periodic look, not a
        timer per request."""
        leg.detach()
        attempt.lingering = True
        if self._linger_timeout is not None:
            self._lingering[leg] = (attempt, time.monotonic() + self._linger_timeout)
            if self._linger_look is None:
                self._linger_look = asyncio.get_running_loop().call_later(
                    min(self._linger_timeout / LINGER_LOOKS_PER_TIMEOUT, LINGER_LOOK_MAX_S), self._cut_overdue)
        self.spawn(self._finish_later(leg, attempt))

    def _cut_overdue(self) -> None:
        self._linger_look = None
        now = time.monotonic()
        for leg, (attempt, deadline) in list(self._lingering.items()):
            if now >= deadline and not leg.task.done():
                logger.warning("prefill %s had not ended its answer %g s after its decode answered: cut and "
                               "aborted (rids %s)", leg.worker.url, self._linger_timeout, attempt.rids)
                self.aborts.abort_on(leg.worker, attempt.rids)
                leg.stop()  # _finish_later concludes it: an error that counts against the worker
        if self._lingering:
            self._linger_look = asyncio.get_running_loop().call_later(
                min(self._linger_timeout / LINGER_LOOKS_PER_TIMEOUT, LINGER_LOOK_MAX_S), self._cut_overdue)

    async def _finish_later(self, leg: Leg, attempt: Attempt) -> None:
        """A prefill leg still running after decode answered: keep it counted (and its attempt live) until it
        ends."""
        try:
            await first_done((leg.task,))
            self._conclude(leg, attempt)
        except asyncio.CancelledError:  # router shutting down
            leg.cancel(attempt.rids)
            raise
        except Exception:
            leg.finish(LegOutcome.ERROR, fault=False)
        finally:
            self._lingering.pop(leg, None)
            attempt.lingering = False
            if attempt.ended:
                self._live.discard(attempt)

    def _post(self, worker: Worker, path: str, attempt: Attempt, headers: bytes) -> Awaitable[UpstreamResponse]:
        if attempt.traces is not None:  # each leg names its own span as the server's parent
            headers += attempt.traces[worker is attempt.decode].header_line
        payload = attempt.payload
        if attempt.decode_payload is not None and worker is attempt.decode:
            payload = attempt.decode_payload
        if worker.auth_line is not None:  # the worker's own api_key (worker API), over the request's
            headers = with_authorization(headers, worker.auth_line)
        return self.upstream.post(worker.url, path, payload, headers)

    async def _first_done_kept_alive(self, tasks, request: web.Request, record: RequestRecord) -> None:
        """`first_done`, and with --sse-keepalive-secs a comment each silent interval before decode's first event
        (a long prefill): the stream's head goes out with the first one, so from then on a failure ends the stream
        with an error event (the proxy's retries still run, on the same stream)."""
        try:
            async with asyncio.timeout(self._sse_keepalive):
                await first_done(tasks)
            return
        except TimeoutError:
            pass
        response = await open_stream(request, record)
        try:
            await response.write(KEEPALIVE_COMMENT)
        except ConnectionError as exc:
            raise ClientGone(str(exc)) from None

    # ---- non-streaming -----------------------------------------------------------------------------
    async def _unary_leg(self, worker: Worker, path: str, attempt: Attempt, headers) -> tuple[int, bytes, str]:
        resp = await self._post(worker, path, attempt, headers)
        try:
            return resp.status, await resp.read(), resp.content_type
        except UpstreamSilent:
            self.aborts.abort_on(worker, attempt.rids)  # cut for its silence: the server may still hold the request
            raise
        finally:
            resp.close()

    async def unary(self, path, attempt: Attempt, shape: RequestShape, headers, record) -> web.Response:
        p = self._open_leg(attempt.prefill, Role.PREFILL, self._unary_leg(attempt.prefill, path, attempt, headers),
                           attempt)
        d = self._open_leg(attempt.decode, Role.DECODE, self._unary_leg(attempt.decode, path, attempt, headers),
                           attempt)
        attempt.legs = [p, d]
        try:
            while d.is_open:
                await first_done([leg.task for leg in (p, d) if leg.is_open])
                for leg, other in ((p, d), (d, p)):
                    if leg.is_open and leg.task.done():
                        failure = self._conclude(leg, attempt)
                        if failure is not None:
                            other.cancel(attempt.rids)
                            raise failure
            status, body, content_type = d.task.result()
            router_abort = self.router_abort(attempt)
            if router_abort is not None and some_sequence_aborted(body):
                attempt.ended_aborted = True
            if router_abort is AbortAction.RETRY and attempt.ended_aborted:
                # Nothing has reached the client yet, so even a partial answer can be re-sent whole.
                p.cancel(attempt.rids)
                raise LegFailed(d.worker, status, body, content_type, retryable=False, abort=AbortAction.RETRY,
                                reason="aborted by the router before the client saw a token")
            if shape.return_logprob:
                if p.is_open:
                    await first_done((p.task,))
                    self._conclude(p, attempt)
                if not p.task.cancelled() and p.task.exception() is None and p.task.result()[0] == 200:
                    answer = orjson.loads(body)
                    merge_answer(orjson.loads(p.task.result()[1]), answer)
                    body = orjson.dumps(answer)
            if p.is_open:
                self.linger(p, attempt)
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
        except UpstreamSilent:
            self.aborts.abort_on(worker, attempt.rids)
            raise
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
        except UpstreamSilent:
            self.aborts.abort_on(worker, attempt.rids)
            raise
        finally:
            if resp is not None:
                resp.close()

    async def stream(self, request: web.Request, path, attempt: Attempt, shape: RequestShape, headers,
                     record: RequestRecord) -> web.StreamResponse:
        p = self._open_leg(attempt.prefill, Role.PREFILL,
                           self._prefill_stream_leg(attempt.prefill, path, attempt, headers, shape.return_logprob),
                           attempt)
        d = self._open_leg(attempt.decode, Role.DECODE,
                           self._decode_first_event(attempt.decode, path, attempt, headers), attempt)
        attempt.legs = [p, d]
        d_resp: UpstreamResponse | None = None
        try:
            # Phase 1: until decode's first event, any failure is answered (or retried) as plain HTTP.
            while not d.task.done():
                waiting = [leg.task for leg in (p, d) if leg.is_open and not leg.task.done()]
                if self._sse_keepalive is None:
                    await first_done(waiting)
                else:
                    await self._first_done_kept_alive(waiting, request, record)
                if p.is_open and p.task.done():
                    failure = self._conclude(p, attempt)
                    if failure is not None:
                        d.cancel(attempt.rids)
                        raise failure
            failure = self._failure(d, attempt)
            if failure is not None:
                if failure.local is not None:
                    d.finish(LegOutcome.CANCELLED)
                else:
                    d.finish(LegOutcome.ERROR, fault=failure.blame_now)
                p.cancel(attempt.rids)
                raise failure
            d_resp, events, splitter = d.task.result()[3]
            if self.router_abort(attempt) is AbortAction.RETRY \
                    and aborted_before_first_token(sse.parse_event(events[0])):
                d.finish(LegOutcome.CANCELLED)
                p.cancel(attempt.rids)
                raise LegFailed(d.worker, 200, b"", "", retryable=False, abort=AbortAction.RETRY,
                                reason="aborted by the router before the first token")

            # Phase 2: the client sees a stream from here on.
            attempt.streaming = True
            prefill_first: dict[int, dict] = {}
            if shape.return_logprob:
                if p.is_open:
                    await first_done((p.task,))
                    self._conclude(p, attempt)
                if not p.task.cancelled() and p.task.exception() is None:
                    prefill_first = index_prefill_events(p.task.result()[3])
            if p.is_open:
                # Decode has its KV: the prefill leg holds its worker until its own answer ends, not until
                # decode's stream does (that would count it as prefill load, and stretch prefill drains).
                self.linger(p, attempt)
            response = await open_stream(request, record)
            first_at = time.monotonic()
            record.ttft_s = first_at - record.started
            attempt.relaying = d_resp
            ok = await relay(response, d_resp, events, splitter, prefill_first, record, first_at, self._sse_keepalive,
                             attempt)
            if not ok:  # cut mid-stream (silent, closed early): the server may still hold the request
                self.aborts.abort_on(d.worker, attempt.rids)
            d.finish(LegOutcome.SUCCESS if ok else LegOutcome.ERROR)
            return response
        except (asyncio.CancelledError, ClientGone):  # the client left: both legs stop, here and on the servers
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
