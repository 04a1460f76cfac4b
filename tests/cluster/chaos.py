"""A seeded chaos soak of router replicas: an operator's worst day, replayable.

Three `python -m router` replicas on a real etcd, with the same command line (a 3P+3D simulated fleet whose
servers have both switch APIs), clients sending requests to all of them throughout, and a random event every
1-3 s (several may run at once):

    convert    a conversion at a random replica: drain or abort mode, through the router's /pd_role_switch
               or /convert_pd_role (the server's two APIs)
    update     a weight update with or without abort_all_requests
    pause      pause (abort, retract or in place) at one replica, continue at another
    kill       a replica SIGKILLed (its clients moved off first, as a balancer would), started again with its
               original flags after a moment
    term       the same with SIGTERM: it must exit 0
    replace    a server removed through the worker API, killed, and a new one registered in its place
    etcd       etcd stopped (SIGTERM) or frozen (SIGSTOP) for 0.5-4 s, sometimes longer than the leases' TTL
    bad        a burst of bad requests (broken JSON, unknown fields, wrong types, unknown workers)

Then everything quiesces (etcd back, every replica up, the fleet continued) and is checked: every replica
routes exactly the servers the cluster has, each as the server itself reports (role, bootstrap port) and as
etcd records it, removed servers nowhere; no operation runs, admission is open; no request was lost (each
ended with its tokens, or, a stream, with a clean finish_reason abort); no answer mixes weight versions, and
every request sent after an update answered is served on that version or a later one; no replica logged a
traceback; each replica exits 0 on SIGTERM; a replica's memory stays flat.

`PDR_CHAOS_SEEDS` (e.g. `7` or `1-20`), `PDR_CHAOS_DURATION_S` and `PDR_CHAOS_CLIENTS` (per replica) size a run;
`PDR_CHAOS_OUT=DIR` keeps each run's summary (JSON) there.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import aiohttp
import orjson

from harness.processes import rss_kib
from simulator.fleet import Fleet, WorkerHandle

from ..router_process import RouterProcess
from .chaos_clients import Answer, Clients
from .processes import TTL, fleet_view, get
from .servers import Servers, cluster_workers

NAME = "chaos"
MODEL = "sim/tiny-llama"
KINDS = ("convert", "convert", "convert", "update", "update", "pause", "kill", "term", "replace", "etcd", "etcd",
         "bad")
# The replicas' own deadlines (their flags): a drain or an abort ends within its timeout (504 or 502 when the
# fleet did not get quiet), an operation waits for the one before it at most WEIGHT_UPDATE_S, a switch SWITCH_S.
# A control call that outlives them all (CALL_TIMEOUT_S) is a problem; a loaded machine makes drains slow, not
# endless.
DRAIN_S, SWITCH_S, WEIGHT_UPDATE_S = 20, 10, 30
DEADLINE_FLAGS = ["--drain-timeout-secs", str(DRAIN_S), "--switch-timeout-secs", str(SWITCH_S),
                  "--weight-update-timeout-secs", str(WEIGHT_UPDATE_S), "--abort-timeout-secs", str(DRAIN_S)]
CALL_TIMEOUT_S = WEIGHT_UPDATE_S + DRAIN_S + SWITCH_S + 10.0
SETTLE_TIMEOUT_S = 45.0
# a replica's RSS may grow this much between the first third of its life and the end of the run
MEMORY_SLACK = (1.25, 16 * 1024)  # factor, KiB


def seeds(text: str) -> list[int]:
    """`7`, `1,4,9` or `1-20`."""
    found: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        found += list(range(int(low), int(high or low) + 1))
    return found


@dataclass
class Event:
    at: float
    kind: str
    detail: str
    outcome: str = "running"
    ended: float | None = None


@dataclass
class Report:
    seed: int
    duration_s: float
    events: list[Event] = field(default_factory=list)
    answers: int = 0
    problems: list[str] = field(default_factory=list)
    memory_kib: dict[str, tuple[int, int]] = field(default_factory=dict)
    exits: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        outcomes: dict[str, dict[str, int]] = {}
        for event in self.events:
            bucket = outcomes.setdefault(event.kind, {})
            bucket[event.outcome] = bucket.get(event.outcome, 0) + 1
        return {"seed": self.seed, "duration_s": self.duration_s, "events": len(self.events), "outcomes": outcomes,
                "requests": self.answers, "memory_kib": self.memory_kib, "sigterm_exits": self.exits,
                "problems": self.problems,
                "timeline": [f"{e.at:7.2f}-{e.ended if e.ended is not None else '?':>7} {e.kind} {e.detail}: {e.outcome}"
                             for e in self.events]}


class Chaos:
    def __init__(self, etcd, fleet: Fleet, tmp_path: Path, seed: int, duration_s: float, per_replica: int) -> None:
        self.etcd, self.fleet, self.tmp_path = etcd, fleet, tmp_path
        self.rng = random.Random(seed)
        self.duration_s = duration_s
        self.per_replica = per_replica
        self.report = Report(seed, duration_s)
        self.servers = Servers(fleet)
        self.members: dict[str, WorkerHandle] = {h.url: h for h in fleet.workers}
        self.removed: set[str] = set()
        self.routers: list[RouterProcess] = []
        self.down: set[int] = set()  # replicas being restarted
        self.etcd_away = False
        self.replacing = False
        self.reducing: set[str] = set()  # roles a conversion or a replacement is taking a server out of
        self.versions = 0  # weight versions asked for
        self.updated: list[tuple[float, str]] = []  # (answered at, version) of each update that succeeded
        # (sent at, answered at, version) of each update that found the fleet paused in place: its quiesce was
        # skipped, so requests parked on the servers resumed on the new weights (a partial rollout's answer,
        # by design: its tokens carry both versions)
        self.updated_while_paused: list[tuple[float, float, str]] = []
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        self.memory: dict[int, list[tuple[float, int]]] = {}  # pid -> (time, RSS KiB)
        self.clients: Clients | None = None
        self.t0 = 0.0
        self._events: set[asyncio.Task] = set()

    # ---- the run ---------------------------------------------------------------------------------------------
    async def run(self) -> Report:
        command_line = SimpleNamespace(prefill=self.fleet.prefill, decode=self.fleet.decode)
        flags = ["--log-level", "info", "--etcd-endpoints", *self.etcd.endpoints, "--cluster-name", NAME,
                 "--etcd-lease-ttl-secs", str(TTL), "--health-check-interval-secs", "1", *DEADLINE_FLAGS]
        self.routers = [RouterProcess(command_line, *flags, log_path=self.tmp_path / f"replica{i}.log")
                        for i in range(3)]
        try:
            await asyncio.gather(*(r.start() for r in self.routers))
            self.clients = Clients([r.url for r in self.routers], self.per_replica)
            self.clients.start()
            self.t0 = time.monotonic()
            sampler = asyncio.ensure_future(self._sample_memory())
            while time.monotonic() - self.t0 < self.duration_s:
                kind = self.rng.choice(KINDS)
                self._spawn(kind)
                await asyncio.sleep(self.rng.uniform(1.0, 3.0))  # the pace of the events, not a wait
            await asyncio.gather(*self._events, return_exceptions=True)
            sampler.cancel()
            dead = [i for i, r in enumerate(self.routers) if r.proc is None or r.proc.poll() is not None]
            if dead:  # a restart that failed (its event says why): nothing to quiesce and compare
                self.report.problems.append(f"replicas {dead} not running after the events")
                return self.report
            await self._quiesce()
            answers = await self.clients.finish()
            self._check_answers(answers)
            self._check_memory()
            await self._check_logs_and_exit()
        finally:
            if self.clients is not None:
                await self.clients.finish()
            for event in self._events:
                event.cancel()
            self.etcd.thaw()
            await asyncio.gather(*(r.__aexit__(None, None, None) for r in self.routers if r.proc is not None),
                                 return_exceptions=True)
            await self.session.close()
            await self.servers.close()
        return self.report

    def _spawn(self, kind: str) -> None:
        event = Event(round(time.monotonic() - self.t0, 2), kind, "")
        self.report.events.append(event)

        async def run() -> None:
            try:
                event.outcome = await getattr(self, f"_{kind}")(event)
            except AssertionError as exc:
                event.outcome = "PROBLEM"
                self.report.problems.append(f"{kind} at {event.at} s ({event.detail}): {exc}")
            event.ended = round(time.monotonic() - self.t0, 2)

        task = asyncio.ensure_future(run())
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    # ---- calls -----------------------------------------------------------------------------------------------
    def _up(self) -> list[int]:
        return [i for i in range(3) if i not in self.down]

    async def _call(self, replica: int, method: str, path: str, body=None, *, raw: bytes | None = None,
                    timeout: float = CALL_TIMEOUT_S) -> tuple[int, dict | None]:
        """(status, JSON body); status 0 when the replica did not answer (it was killed meanwhile)."""
        router = self.routers[replica]
        kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
        try:
            async with self.session.request(method, router.url + path, timeout=aiohttp.ClientTimeout(total=timeout),
                                            **kwargs) as resp:
                text = await resp.read()
                try:
                    return resp.status, orjson.loads(text) if text else None
                except orjson.JSONDecodeError:
                    return resp.status, {"not_json": text[:200].decode(errors="replace")}
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if replica in self.down:
                return 0, {"replica": "restarting", "error": repr(exc)}
            raise AssertionError(f"replica {replica} did not answer {method} {path}: {router.why_unreachable(exc)}") \
                from None

    @staticmethod
    def _expected(status: int, answer, allowed: tuple[int, ...], what: str) -> str:
        if status == 0:
            return "replica restarting"
        assert status in allowed, f"{what}: {status} {answer}"
        if status >= 400:
            assert isinstance(answer, dict) and isinstance(answer.get("error"), dict) \
                and answer["error"].get("message"), f"{what}: {status} without a JSON error: {answer}"
            if "lost it" in answer["error"]["message"]:  # its replica's lease ended while it ran
                return f"{status} lost it"
            return f"{status} {answer['error'].get('type', '')}".strip()
        return str(status)

    async def _listed(self, replica: int, url: str) -> bool:
        status, _ = await self._call(replica, "GET", f"/workers/{quote(url, safe='')}", timeout=10)
        return status == 200

    async def _live(self, handle: WorkerHandle) -> dict:
        return await self.fleet.state(handle)

    # ---- the events --------------------------------------------------------------------------------------------
    async def _routable(self) -> dict[str, str]:
        """The servers routed now (as a replica that serves says), with their roles."""
        status, answer = await self._call(self._up()[0], "GET", "/workers", timeout=10)
        if status != 200:
            return {}
        return {w["url"]: w["role"] for w in answer["workers"] if w["routable"] and w["url"] in self.members}

    def _reduce(self, role: str) -> bool:
        """One event at a time takes a server out of a role (a conversion from it, a replacement in it), so
        that the fleet always keeps a routable server of each role: both at once could leave none, the
        operator's own doing, not the router's."""
        if role in self.reducing:
            return False
        self.reducing.add(role)
        return True

    async def _convert(self, event: Event) -> str:
        roles = await self._routable()
        if not roles:
            return "skipped: no view"
        url = self.rng.choice(sorted(roles))
        if list(roles.values()).count(roles[url]) < 2:
            return "skipped: last of its role"
        if not self._reduce(roles[url]):
            return "skipped: its role is being reduced"
        try:
            return await self._convert_one(event, url, roles[url])
        finally:
            self.reducing.discard(roles[url])

    async def _convert_one(self, event: Event, url: str, role: str) -> str:
        replica = self.rng.choice(self._up())
        mode = self.rng.choice(("drain", "abort"))
        new_role = "decode" if role == "prefill" else "prefill"
        if self.rng.random() < 0.5:
            path, body = "/pd_role_switch", {"worker_url": url, "new_role": new_role, "mode": mode}
        else:
            path, body = "/convert_pd_role", {"server_url": url, "mode": mode}
        event.detail = f"{url} -> {new_role} ({mode}, {path}) at replica {replica}"
        status, answer = await self._call(replica, "POST", path, body)
        if status == 404 and url in self.removed:
            return "404: replaced meanwhile"
        # 409: busy, the last routable of its pool, under a fleet operation; 503: etcd away or the replica lost
        # it; 502/504: the switch refused or late, the worker back in its old pool (its outcome says so)
        outcome = self._expected(status, answer, (200, 409, 502, 503, 504), event.detail)
        if status in (502, 504):
            assert answer.get("outcome") in ("restored", "failed"), answer
            return f"{status} {answer.get('outcome')}"
        return outcome

    async def _update(self, event: Event) -> str:
        replica = self.rng.choice(self._up())
        self.versions += 1
        version, abort = f"v{self.versions}", self.rng.random() < 0.5
        event.detail = f"{version} abort_all_requests={abort} at replica {replica}"
        sent = time.monotonic()
        status, answer = await self._call(replica, "POST", "/update_weights_from_disk", {
            "model_path": MODEL, "weight_version": version, "abort_all_requests": abort, "retry_aborted": True})
        if status == 502:  # a server that a `replace` removed and killed meanwhile: left out, the others updated
            failed = {w["url"] for w in answer["workers"] if not w["success"]}
            assert failed and failed <= self.removed, f"{event.detail}: 502 {answer}"
            return "502: a server replaced meanwhile"
        # 504: a drain that did not end within DRAIN_S (nothing was changed)
        outcome = self._expected(status, answer, (200, 409, 503, 504), event.detail)
        if status == 200:
            assert answer["success"] and answer["weight_version"] == version, answer
            self.updated.append((time.monotonic(), version))
            if await self._skipped_quiesce(replica, answer["update_id"]):
                self.updated_while_paused.append((sent, time.monotonic(), version))
        return outcome

    async def _skipped_quiesce(self, replica: int, op_id: str) -> bool:
        """Whether the update's record (at the replica that ran it) says it found the fleet paused and did
        not wait for requests; unknown (the replica gone meanwhile) counts as paused: no answer is blamed."""
        status, record = await self._call(replica, "GET", f"/weight_updates/{op_id}", None)
        if status != 200:
            return True
        return any(s["name"] == "quiesce" and s["outcome"] == "skipped" for s in record.get("steps", ()))

    async def _pause(self, event: Event) -> str:
        at, then = self.rng.choice(self._up()), self.rng.choice(self._up())
        mode = self.rng.choice(("abort", "retract", "in_place"))
        event.detail = f"{mode} at replica {at}, continue at replica {then}"
        status, answer = await self._call(at, "POST", "/pause_generation", {"mode": mode, "retry_aborted": True})
        outcome = self._expected(status, answer, (200, 409, 503), event.detail)
        await asyncio.sleep(self.rng.uniform(0.1, 1.0))  # how long the fleet stays paused (not a wait)
        return f"{outcome}, continued: {await self._continue(then)}"

    async def _continue(self, replica: int) -> str:
        """Until a continue_generation is taken (etcd may be away, another operation running): the fleet must
        not stay paused."""
        deadline = time.monotonic() + 2 * CALL_TIMEOUT_S
        while True:
            status, answer = await self._call(replica if replica not in self.down else self._up()[0],
                                              "POST", "/continue_generation", {})
            if status == 200:
                return "200"
            assert status in (0, 409, 503) and time.monotonic() < deadline, f"continue: {status} {answer}"
            await asyncio.sleep(0.2)  # a retry cadence: the replicas cannot agree yet

    async def _restart(self, event: Event, sig: signal.Signals) -> str:
        up = self._up()
        if len(up) < 3:
            return "skipped: a replica is already down"
        replica = self.rng.choice(up)
        event.detail = f"replica {replica}"
        self.down.add(replica)  # at once: one replica down at a time
        if not await self.clients.leave(replica, [i for i in up if i != replica], self.rng):
            self.down.discard(replica)
            return "skipped: its clients did not leave"
        router = self.routers[replica]
        try:
            if sig is signal.SIGKILL:
                await router.kill()
            else:
                sent = router.send(sig)
                code = await router.exited(30)
                self.report.exits.append(code)
                assert code == 0, f"SIGTERM exit status {code} after {time.monotonic() - sent:.1f} s"
            await asyncio.sleep(self.rng.uniform(0.0, 2.0))  # how long it stays down (not a wait)
            await router.start()
        finally:
            self.down.discard(replica)
        self.clients.spread(self._up())
        return "restarted"

    async def _kill(self, event: Event) -> str:
        return await self._restart(event, signal.SIGKILL)

    async def _term(self, event: Event) -> str:
        return await self._restart(event, signal.SIGTERM)

    async def _replace(self, event: Event) -> str:
        if self.replacing:
            return "skipped: one at a time"
        roles = await self._routable()
        if not roles:
            return "skipped: no view"
        url = self.rng.choice(sorted(roles))
        role = roles[url]
        if list(roles.values()).count(role) < 2:
            return "skipped: last of its role"
        if not self._reduce(role):
            return "skipped: its role is being reduced"
        self.replacing = True
        try:
            replica = self.rng.choice(self._up())
            event.detail = f"{role} {url} at replica {replica}"
            status, answer = await self._call(replica, "DELETE", f"/workers/{quote(url, safe='')}")
            if status != 200:  # an operation runs on it, etcd away: it stays
                return "kept: " + self._expected(status, answer, (404, 409, 503), event.detail)
            handle = self.members.pop(url)
            self.removed.add(url)
            # no replica routes it any more; its requests already sent finish there, then it dies
            deadline = time.monotonic() + 30
            while any([await self._listed(i, url) for i in self._up()]):
                assert time.monotonic() < deadline, f"{url} still routed after its removal"
                await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
            while (state := await self._live(handle))["running_rids"] or state["waiting_rids"]:
                assert time.monotonic() < deadline, f"{url} still busy after its removal: {state['running_rids']}"
                await asyncio.sleep(0.05)  # the poll interval of a wait with a deadline
            await self.servers.kill(handle)
            new = await self.servers.start(role)
            fleet_version = (await self._live(next(iter(self.members.values()))))["weight_version"]
            async with self.session.post(new.url + "/update_weights_from_disk",
                                         json={"model_path": MODEL, "weight_version": fleet_version}) as resp:
                assert resp.status == 200
            deadline = time.monotonic() + 30
            while True:
                replica = self.rng.choice(self._up())
                status, answer = await self._call(replica, "POST", "/workers", {"url": new.url, "worker_type": role})
                if status == 200:
                    break
                assert status in (0, 503) and time.monotonic() < deadline, f"adding {new.url}: {status} {answer}"
                await asyncio.sleep(0.2)  # a retry cadence: etcd is away
            self.members[new.url] = new
            return f"replaced by {new.url}"
        finally:
            self.replacing = False
            self.reducing.discard(role)

    async def _etcd(self, event: Event) -> str:
        if self.etcd_away:
            return "skipped: etcd already away"
        self.etcd_away = True
        how, away = self.rng.choice(("stop", "freeze")), self.rng.uniform(0.5, 4.0)
        event.detail = f"{how} for {away:.1f} s"
        try:
            if how == "stop":
                await self.etcd.stop()
            else:
                await self.etcd.freeze()
            await asyncio.sleep(away)  # how long etcd is away (not a wait)
        finally:
            if how == "stop":
                await self.etcd.start()
            else:
                self.etcd.thaw()
            self.etcd_away = False
        return "back"

    async def _bad(self, event: Event) -> str:
        replica = self.rng.choice(self._up())
        event.detail = f"at replica {replica}"
        member = self.rng.choice(sorted(self.members))
        cases = [
            ("POST", "/generate", None, b"{not json", (400,)),
            ("POST", "/generate", None, b"[1, 2]", (400,)),
            ("POST", "/workers", {"url": "not a url", "worker_type": "decode"}, None, (400,)),
            ("POST", "/workers", {"url": member, "worker_type": "regular"}, None, (400,)),
            ("POST", "/workers", {"url": member, "worker_type": "decode", "surprise": 1}, None, (400, 409)),
            ("DELETE", "/workers/http%3A%2F%2F127.0.0.1%3A9", None, None, (404,)),
            ("POST", "/pause_generation", {"mode": "sideways"}, None, (400,)),
            ("POST", "/update_weights_from_disk", {"model_path": 7}, None, (400,)),
            ("POST", "/update_weights_from_disk", {}, None, (400,)),
            ("POST", "/pd_role_switch", {"worker_url": member, "new_role": "both"}, None, (400,)),
            ("POST", "/convert_pd_role", {"server_url": member, "mode": "later"}, None, (400,)),
            ("POST", f"/admin/workers/{quote(member, safe='')}/convert", {"wait": "soon"}, None, (400,)),
            ("POST", "/abort_request", {"rid": 5}, None, (400,)),
        ]
        self.rng.shuffle(cases)
        for method, path, body, raw, allowed in cases:
            status, answer = await self._call(replica, method, path, body, raw=raw, timeout=10)
            if status == 0:
                return "replica restarting"
            assert status in allowed, f"{method} {path} {body or raw!r}: {status} {answer}"
            assert isinstance(answer, dict) and answer.get("error", {}).get("message"), (path, answer)
        return f"{len(cases)} refused"

    # ---- quiesce and check --------------------------------------------------------------------------------------
    async def _quiesce(self) -> None:
        if not self.etcd.running:
            await self.etcd.start()
        self.etcd.thaw()
        await self._continue(0)  # whatever pause the events left (a continue may have lost to an update)
        self.clients.spread([0, 1, 2])
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        found: list = []
        while time.monotonic() < deadline:
            found = await self._disagreements()
            if not found:
                return
            await asyncio.sleep(0.2)  # the poll interval of a wait with a deadline
        self.report.problems.append(f"not settled within {SETTLE_TIMEOUT_S:g} s: {found[:8]}")

    async def _disagreements(self) -> list:
        found = []
        live = {url: await self._live(h) for url, h in self.members.items()}
        records = await cluster_workers(self.etcd.endpoints, NAME)
        removals = set(records.pop(None))
        expected = sorted((url, state["role"], state["bootstrap_port"] if state["role"] == "prefill" else None)
                          for url, state in live.items())
        recorded = sorted((url, role, port) for url, (role, port, _) in records.items())
        if recorded != expected:
            found.append(("etcd", recorded, "servers", expected))
        if not self.removed <= removals:
            found.append(("removal records missing", sorted(self.removed - removals)))
        for index, router in enumerate(self.routers):
            view = await fleet_view(router)
            routed = sorted((url, role, port if role == "prefill" else None) for url, role, port, _, _ in view)
            if routed != expected:
                found.append((index, "routes", routed))
            workers = (await get(router, "/workers"))["workers"]
            cluster, updates = await get(router, "/admin/cluster"), await get(router, "/weight_updates")
            fleet_version = updates["fleet_weight_version"]
            # a server held out for its weights is right where it serves another version than the fleet (a
            # replacement that missed an update running while it was registered): an update brings it back
            stray = [w for w in workers if not w["routable"] and not (
                (w.get("hold") or {}).get("kind") == "weights" and w["url"] in live
                and live[w["url"]]["weight_version"] != fleet_version)]
            if stray:
                found.append((index, "not routable", [(w["url"], w["state"], w.get("unroutable_reason"))
                                                      for w in stray]))
            if cluster["operations"] or updates["current"] or not updates["admission"]["open"]:
                found.append((index, "busy", cluster["operations"], updates["current"], updates["admission"]))
            if not cluster["lease"]["id"]:
                found.append((index, "no lease"))
        return found

    def _check_answers(self, answers: list[Answer]) -> None:
        self.report.answers = len(answers)
        lost = [a for a in answers if a.status != 200
                or a.finish not in ("length", "stop", *(("abort",) if a.stream else ()))]
        for answer in lost[:5]:
            self.report.problems.append(f"lost request: {answer} (events then: {self._events_at(answer)})")
        if lost:
            self.report.problems.append(f"{len(lost)} of {len(answers)} requests lost")
        mixed = [a for a in answers if len(set(a.versions)) > 1 and not self._parked_across_update(a)]
        if mixed:
            self.report.problems.append(f"{len(mixed)} answers mix weight versions: {mixed[:3]}")
        # updates answered in order; a request sent after one answered is never served on a version that an
        # earlier one replaced (nor on the first weights): only on the newest answered or one still to come
        answered = sorted(self.updated)
        for answer in answers:
            if answer.status != 200 or not answer.versions:
                continue
            before = [version for at, version in answered if at <= answer.sent]
            if before and answer.versions[-1] in ({"default"} | set(before[:-1])) - {before[-1]}:
                at = next(at for at, version in answered if version == before[-1]) - self.t0
                self.report.problems.append(
                    f"an answer on {answer.versions} sent {answer.sent - self.t0:.3f} s into the run, after "
                    f"{before[-1]} answered ({at:.3f} s): {answer}")
                break

    def _parked_across_update(self, answer: Answer) -> bool:
        """An answer whose versions changed exactly once, to one that an update on a paused fleet brought while
        the answer was running."""
        changes = [new for old, new in zip(answer.versions, answer.versions[1:]) if new != old]
        return len(changes) == 1 and any(version == changes[0] and sent <= answer.ended and answered >= answer.sent
                                         for sent, answered, version in self.updated_while_paused)

    def _events_at(self, answer: Answer) -> list[str]:
        start, end = answer.sent - self.t0, answer.ended - self.t0
        return [f"{e.kind} {e.detail} [{e.at}-{e.ended}]" for e in self.report.events
                if e.at <= end and (e.ended is None or e.ended >= start)]

    async def _sample_memory(self) -> None:
        while True:
            for index, router in enumerate(self.routers):
                # from when it serves: a replica still starting (imports, joining) is not its settled size
                if index not in self.down and router.proc is not None and router.proc.poll() is None:
                    rss = rss_kib(router.proc.pid)
                    if rss is not None:
                        self.memory.setdefault(router.proc.pid, []).append((time.monotonic(), rss))
            await asyncio.sleep(0.5)  # a sampling cadence

    def _check_memory(self) -> None:
        """A replica that lived through most of the run: its RSS at the end against a third into its life."""
        for pid, samples in self.memory.items():
            if len(samples) < 12 or samples[-1][0] - samples[0][0] < self.duration_s / 2:
                continue
            settled = samples[len(samples) // 3][1]
            last = samples[-1][1]
            self.report.memory_kib[str(pid)] = (settled, last)
            factor, slack = MEMORY_SLACK
            if last > settled * factor + slack:
                self.report.problems.append(f"replica pid {pid} grew from {settled} to {last} KiB")

    async def _check_logs_and_exit(self) -> None:
        for index, router in enumerate(self.routers):
            router.send(signal.SIGTERM)
            code = await router.exited(30)
            self.report.exits.append(code)
            if code != 0:
                self.report.problems.append(f"replica {index} exited {code} on SIGTERM")
            log = router.log()
            for marker in ("Traceback", "background task failed", "ERROR"):
                if marker in log:
                    line = next(line for line in log.splitlines() if marker in line)
                    self.report.problems.append(f"replica {index} logged {marker!r}: {line[:300]}")
                    break


def settings() -> tuple[list[int], float, int]:
    return (seeds(os.environ.get("PDR_CHAOS_SEEDS", "25")), float(os.environ.get("PDR_CHAOS_DURATION_S", "20")),
            int(os.environ.get("PDR_CHAOS_CLIENTS", "2")))


def save(report: Report) -> None:
    out = os.environ.get("PDR_CHAOS_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"chaos-{report.seed}.json").write_bytes(orjson.dumps(report.summary(), option=orjson.OPT_INDENT_2))
