"""The PD bootstrap protocol, for real over HTTP on loopback.

Prefill side: every worker that serves prefill runs a bootstrap listener (its own aiohttp server
on ``--disaggregation-bootstrap-port``). It answers SGLang's own listener routes (``/health``,
``/route``) the way the real one does, and holds the room store: one entry per bootstrap room.

Decode side: a decode leg pulls its room from the listener at ``bootstrap_host:bootstrap_port``
with ``POST /_sim/kv/pull`` — a long poll that first answers ``accepted`` (the handshake) and
later the KV descriptor (the transfer). The two legs may arrive in any order; the room entry is
created by whichever comes first. A listener that is not a prefill's (503), a closed port, a
missing room, an aborted or timed-out partner all end in the same failures SGLang reports.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from harness.processes import free_port

from .dp_ranks import pulled_rank, room_key, sort_key
from .requests import HANDSHAKE, TRANSFER, Req

if TYPE_CHECKING:
    from .config import WorkerConfig


class Engine(Protocol):
    """What the bootstrap side uses of a worker's engine (`engine.Engine`, which uses this module)."""

    config: WorkerConfig
    role: str
    rooms: RoomStore
    unhealthy: bool

    async def sleep(self, req: Req, delay: float) -> None: ...

NOT_REGISTERED = "Prefill server not fully registered yet (0 workers registered)."
TOMBSTONE_TTL_S = 60.0  # how long a failed room keeps answering "failed" to a late decode leg


@dataclass(eq=False)
class Room:
    room: int
    created: float = field(default_factory=time.monotonic)
    prefill_rid: str | None = None
    prompt_hash: int | None = None
    prompt_tokens: int | None = None
    prefill_waiter: Any = None  # the prefill Req to wake on any change
    decode_attached: bool = False
    kv: dict | None = None
    taken: bool = False
    failed: bool = False
    failure_reason: str | None = None  # None: "unknown reason from another rank"
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        if self.prefill_waiter is not None:
            self.prefill_waiter.poke()

    def fail(self, reason: str | None) -> None:
        if not self.failed and not self.taken:
            self.failed = True
            self.failure_reason = reason
            self.notify()

    def publish(self, *, first_token: int, weight_version: str, cached_tokens: int = 0) -> None:
        # cached_tokens: the decode server reports the prefill's prefix-cache hit as its own (0.5.23)
        self.kv = {"first_token": first_token, "prompt_tokens": self.prompt_tokens,
                   "prompt_hash": self.prompt_hash, "weight_version": weight_version, "cached_tokens": cached_tokens}
        self.notify()


class RoomStore:
    """The prefill side's rooms (both legs meet here), with tombstones for failed ones."""

    def __init__(self) -> None:
        self.rooms: dict[int, Room] = {}
        self.tombstones: dict[int, tuple[float, str | None]] = {}
        self.collisions = 0
        self.opened = 0

    @staticmethod
    def prompt_hash(input_ids: list[int]) -> int:
        return hash(tuple(input_ids))

    def open_prefill(self, room_id: int | None, rid: str, input_ids: list[int], waiter: Any) -> Room:
        room = self.rooms.get(room_id)  # type: ignore[arg-type]
        if room is not None and room.prefill_rid is not None:
            # two prefill legs with one room: a router bug (e.g. scalar room + n colliding)
            self.collisions += 1
            dup = Room(room_id)  # type: ignore[arg-type]
            dup.failed, dup.failure_reason = True, "Duplicate bootstrap room"
            dup.prefill_rid = rid
            return dup
        if room is None:
            room = Room(room_id)  # type: ignore[arg-type]
            self.rooms[room_id] = room  # type: ignore[index]
        self.opened += 1
        room.prefill_rid = rid
        room.prompt_hash = self.prompt_hash(input_ids)
        room.prompt_tokens = len(input_ids)
        room.prefill_waiter = waiter
        self.tombstones.pop(room_id, None)  # type: ignore[arg-type]
        return room

    def close_prefill(self, room: Room, *, succeeded: bool) -> None:
        room.prefill_waiter = None
        if not succeeded:
            room.fail(None)
            self._bury(room)
        if self.rooms.get(room.room) is room and (room.taken or room.failed or not room.decode_attached):
            del self.rooms[room.room]

    def attach_decode(self, room_id: int) -> Room:
        self._prune()
        room = self.rooms.get(room_id)
        if room is None:
            tomb = self.tombstones.get(room_id)
            room = Room(room_id)
            if tomb is not None:
                room.failed, room.failure_reason = True, tomb[1]
            else:
                self.rooms[room_id] = room
        elif room.decode_attached:
            self.collisions += 1
            dup = Room(room_id)
            dup.failed, dup.failure_reason = True, "Duplicate decode bootstrap room"
            return dup
        room.decode_attached = True
        room.notify()
        return room

    def detach_decode(self, room: Room, *, took_kv: bool) -> None:
        if not took_kv:
            room.decode_attached = False
            if room.prefill_rid is not None:
                room.fail(None)  # the decode leg went away: prefill fails "from another rank"
        if self.rooms.get(room.room) is room and (room.prefill_rid is None or room.taken or room.failed):
            if room.prefill_waiter is None:
                del self.rooms[room.room]

    def _bury(self, room: Room) -> None:
        self.tombstones[room.room] = (time.monotonic(), room.failure_reason)

    def _prune(self) -> None:
        if len(self.tombstones) > 256:
            horizon = time.monotonic() - TOMBSTONE_TTL_S
            self.tombstones = {k: v for k, v in self.tombstones.items() if v[0] >= horizon}

    def snapshot(self) -> dict[str, Any]:
        return {
            "open": sorted(self.rooms, key=sort_key),
            "waiting_for_decode": sorted((r.room for r in self.rooms.values()
                                          if r.prefill_rid is not None and not r.decode_attached),
                                         key=sort_key),
            "waiting_for_prefill": sorted((r.room for r in self.rooms.values()
                                           if r.decode_attached and r.prefill_rid is None),
                                          key=sort_key),
            "opened": self.opened,
            "collisions": self.collisions,
            "failed_recently": len(self.tombstones),
        }


class BootstrapListener:
    """One bootstrap HTTP server (SGLang's CommonKVBootstrapServer) on its own port."""

    def __init__(self, worker: Any, host: str, port: int) -> None:
        self.worker = worker  # anything with .engine and .config (the Worker)
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.registered = False  # a prefill registered here (it stays so after a switch to decode)
        self._runner: web.AppRunner | None = None
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/route", self._route)
        app.router.add_post("/_sim/kv/pull", self._pull)
        self.app = app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.requested_port, reuse_address=True)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _serving_prefill(self) -> bool:
        return self.registered and not self.worker.engine.unhealthy

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return web.Response(text="Method not allowed", status=405, content_type="application/json")
        q = request.query
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(q.get(k) for k in keys):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        if not self._serving_prefill():
            return web.Response(text=NOT_REGISTERED, status=503)
        if all(q.get(k) == "-1" for k in keys):
            return web.json_response({
                "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": self.worker.config.dp_size, "pp_size": 1,
                "page_size": 1,
                "kv_cache_dtype": "auto", "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
                "decode_allocation_policy": "early", "enable_kv_cache_sharding": False,
                "prefill_http_port": self.worker.port, "target_tp_rank": None, "target_tp_ranks": None,
                "target_cp_ranks": None, "target_pp_ranks": None, "required_dst_info_num": None,
                "required_prefill_response_num": None})
        ranks = self.worker.config.dp_size
        if any(q.get(k) != "0" for k in keys[1:]) or q["prefill_dp_rank"] not in {str(r) for r in range(ranks)}:
            return web.Response(
                text=f"Bootstrap info not found for dp_rank={q['prefill_dp_rank']} cp_rank={q['prefill_cp_rank']} "
                     f"tp_rank={q['target_tp_rank']} pp_rank={q['target_pp_rank']}", status=404)
        return web.json_response({"rank_ip": self.host, "rank_port": self.port})

    async def _pull(self, request: web.Request) -> web.StreamResponse:
        """Decode leg's long poll: ``accepted`` line at once, then the room's outcome line."""
        if not self._serving_prefill() or self.worker.faults.faults.bootstrap_unreachable:
            return web.Response(text=NOT_REGISTERED, status=503)
        try:
            body = orjson.loads(await request.read())
            room_id = int(body["room"])
            timeout = float(body.get("timeout", 300.0))
            asked_rank = body.get("dp_rank")
            asked_rank = None if asked_rank is None else int(asked_rank)
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": {"message": "room and timeout required"}}, status=400)
        engine: Engine = self.worker.engine
        ranks = engine.config.dp_size
        rank = pulled_rank(room_id, ranks, asked_rank)
        if not 0 <= rank < ranks:  # decode asks the listener for a rank it does not have
            reason = f"Bootstrap info not found for dp_rank={rank} cp_rank=0 tp_rank=0 pp_rank=0"
            return web.Response(body=orjson.dumps({"status": "accepted", "acks": True}) + b"\n"
                                + orjson.dumps({"status": "failed", "reason": reason}) + b"\n",
                                content_type="application/x-ndjson")
        store = engine.rooms
        room = store.attach_decode(room_key(rank, room_id))
        took = False
        try:
            # "acks": a live prefill answers a decode's abort at once; a stale registration never does
            pending = orjson.dumps({"status": "accepted", "acks": engine.role == "prefill"}) + b"\n"
            resp: web.StreamResponse | None = None
            deadline = time.monotonic() + timeout
            while room.kv is None and not room.failed:
                if resp is None:  # about to wait: the decode leg must know the handshake is done
                    resp = web.StreamResponse()
                    resp.content_type = "application/x-ndjson"
                    await resp.prepare(request)
                if pending:
                    await resp.write(pending)
                    pending = b""
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                room.changed.clear()
                try:
                    async with asyncio.timeout(remaining):
                        await room.changed.wait()
                except TimeoutError:
                    break
            if room.kv is not None and not room.failed:
                room.taken = True
                took = True
                room.notify()
                outcome = {"status": "ok", **room.kv}
            elif room.failed:
                outcome = {"status": "failed", "reason": room.failure_reason}
            else:
                outcome = {"status": "timeout"}
            pending += orjson.dumps(outcome) + b"\n"
            if resp is None:  # nothing to wait for: one plain answer
                return web.Response(body=pending, content_type="application/x-ndjson")
            await resp.write_eof(pending)  # the outcome and the end of the stream in one write
            return resp
        finally:
            store.detach_decode(room, took_kv=took)


@dataclass
class FetchResult:
    stage: str  # "ok" | "handshake" | "transfer"
    reason: str | None = None
    prompt_tokens: int | None = None
    prompt_hash: int | None = None
    weight_version: str | None = None
    cached_tokens: int = 0


class KvClient:
    """Decode side of the protocol: fetch a room's KV from a prefill's bootstrap listener."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def fetch(self, engine: "Engine", req: "Req") -> FetchResult:
        cfg = engine.config
        attempts = 0
        while True:
            if req.done:
                return FetchResult("handshake", "Aborted by AbortReq.")
            req.phase = HANDSHAKE
            outcome = await self._pull_once(req, cfg.kv_wait_timeout_s)
            if outcome is None:  # aborted: the pull's connection was closed, which fails the room
                return FetchResult(req.phase, "Aborted by AbortReq.")
            if outcome.stage == "retry":
                attempts += 1
                if attempts >= cfg.bootstrap_retries:
                    return FetchResult("handshake", "Aborted by AbortReq.")
                await engine.sleep(req, cfg.bootstrap_retry_interval_s)
                continue
            if outcome.stage == "transfer" and outcome.reason == "timeout":
                return FetchResult(TRANSFER, f"Request {req.room} timed out after {cfg.kv_wait_timeout_s:.1f}s "
                                             "in KVPoll.WaitingForInput")
            return outcome

    async def _pull_once(self, req: "Req", timeout: float) -> FetchResult | None:
        """One long poll; None if the request was aborted meanwhile (its abort closes the connection)."""
        url = f"http://{req.bootstrap_addr}/_sim/kv/pull"
        body = orjson.dumps({"room": req.room, "rid": req.rid, "timeout": timeout,
                             "dp_rank": req.disagg_prefill_dp_rank})
        try:
            async with self.session.post(
                url, data=body, headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=timeout + 30),
            ) as resp:
                if req.done:
                    return None
                req.on_abort = resp.close
                try:
                    if resp.status != 200:
                        return FetchResult("retry", await resp.text())
                    first = await resp.content.readline()
                    if not first.startswith(b'{"status":"accepted"'):
                        return FetchResult("retry", first.decode(errors="replace"))
                    req.phase = TRANSFER
                    req.peer_acks = b'"acks":true' in first
                    line = await resp.content.readline()
                    if not line:
                        return None if req.done else FetchResult(TRANSFER, None)  # the prefill went away
                    outcome = orjson.loads(line)
                finally:
                    req.on_abort = None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, OSError) as exc:
            if req.done:
                return None
            if req.phase == TRANSFER:
                return FetchResult(TRANSFER, None)
            return FetchResult("retry", repr(exc))
        status = outcome.get("status")
        if status == "ok":
            return FetchResult("ok", None, outcome.get("prompt_tokens"), outcome.get("prompt_hash"),
                               outcome.get("weight_version"), int(outcome.get("cached_tokens") or 0))
        if status == "timeout":
            return FetchResult(TRANSFER, "timeout")
        return FetchResult(TRANSFER, outcome.get("reason"))


def first_free_port(host: str, base: int) -> int:
    """The first port from ``base`` that binds (``/convert_pd_role``); 0 asks the OS."""
    if base == 0:
        return free_port(host)
    port = base
    while port < 65536:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
                return port
            except OSError:
                port += 1
    raise OSError(f"no free port from {base}")
