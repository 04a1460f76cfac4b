"""Scenarios: load through pd-router while something happens to the fleet, then a verdict.

Each scenario starts its own stack (simulated fleet + router), runs locust headless against the router,
acts on the fleet while the load runs (`act`), and judges the request records and what it saw (`judge`).
Steps are placed on a schedule (a fraction of the run time, so that there is load before and after each),
and every wait for a state has a deadline; a step that fails becomes a failed check, and the load still
runs to its end so the summary covers it.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .load import LoadOptions, LoadRun
from .stack import DEFAULT_WORKER_ARGS, SimWorker, Stack, wait_until
from .summary import (Check, Event, Summary, check_answers, check_no_aborts, check_no_errors, phases, stats_of)
from .workload import ABORTED, ERROR, OK

WARMUP_S = 3.0  # the first seconds of load (users starting at once) are left out of the "before" phase
SERVED_AFTER_CHANGE = 5  # requests the router must send a worker in its new role / after rejoining


@dataclass
class Context:
    """What a scenario's steps share: the stack, the load, and what they observed."""

    stack: Stack
    load: LoadRun
    events: list[Event] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    async def at(self, fraction: float) -> None:
        """Wait until `fraction` of the load's run time has passed (a schedule, not a condition)."""
        due = self.load.started_at + fraction * self.load.options.duration_s
        await asyncio.sleep(max(0.0, due - time.time()))

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, passed, detail))
        return passed

    async def served(self, worker: SimWorker, count: int, *, role: str, timeout: float) -> float:
        """Wait until the router has sent `count` more requests to `worker` while it is in `role`;
        the seconds that took."""
        started = time.monotonic()
        first = await self.stack.router_worker(worker.url)
        base = first["requests_total"] if first else 0

        async def enough() -> bool:
            current = await self.stack.router_worker(worker.url)
            return bool(current and current["role"] == role and current["requests_total"] >= base + count)

        await wait_until(enough, timeout=timeout, interval=0.2,
                         what=f"{worker.url} given {count} requests as {role}")
        return time.monotonic() - started


class Scenario:
    name = ""
    help = ""
    prefill = 2
    decode = 2
    default_duration_s = 30.0
    min_duration_s = 5.0
    min_prefill = 1  # what the scenario needs so that no pool empties
    min_decode = 1

    def __init__(self, **options: Any) -> None:
        self.options = options

    def router_args(self) -> list[str]:
        return []

    async def act(self, ctx: Context) -> None:
        """What happens to the fleet while the load runs (nothing by default)."""

    def judge(self, ctx: Context, records: list[dict]) -> list[Check]:
        return [check_no_errors(records), check_no_aborts(records)]


class Steady(Scenario):
    name = "steady"
    help = "steady load, nothing else happens: the baseline (0 failed requests)"
    min_duration_s = 3.0


class Convert(Scenario):
    name = "convert"
    help = "a prefill server converts to decode and back through the router while the load runs"
    default_duration_s = 40.0
    min_duration_s = 15.0
    min_prefill = 2

    async def act(self, ctx: Context) -> None:
        worker = ctx.stack.of_role("prefill")[0]
        mode = self.options.get("convert_mode") or "drain"
        await ctx.load.wait_answers(10, timeout=30, what="answers before the first conversion")
        await ctx.at(0.25)
        await self._convert(ctx, worker, "decode", mode)
        await ctx.at(0.6)
        await self._convert(ctx, worker, "prefill", mode)

    async def _convert(self, ctx: Context, worker: SimWorker, role: str, mode: str) -> None:
        stack = ctx.stack
        start = time.time()
        body = {"worker_url": worker.url, "new_role": role, "mode": mode}
        status, answer = await stack.router_call("POST", "/pd_role_switch", body, timeout=120)
        end = time.time()
        ok = status == 200 and isinstance(answer, dict) and answer.get("success") is True
        detail = f"HTTP {status}: {answer.get('message') if isinstance(answer, dict) else answer}"
        ctx.events.append(Event(f"convert to {role} ({mode})", start, end, detail[:200]))
        ctx.notes[f"convert_to_{role}_s"] = round(end - start, 3)
        if not ctx.check(f"conversion to {role} succeeded", ok, detail[:300]):
            return
        entry = await stack.router_worker(worker.url)
        in_pool = bool(entry and entry["role"] == role and entry["routable"])
        ctx.check(f"{worker.url} routable in the {role} pool", in_pool,
                  f"role {entry and entry['role']}, state {entry and entry['state']}, routable "
                  f"{entry and entry['routable']}")
        if in_pool:
            took = await ctx.served(worker, SERVED_AFTER_CHANGE, role=role, timeout=20)
            ctx.check(f"routed {SERVED_AFTER_CHANGE} requests as {role}", True, f"within {took:.2f} s")

    def judge(self, ctx: Context, records: list[dict]) -> list[Check]:
        checks = [check_no_errors(records)]
        if (self.options.get("convert_mode") or "drain") == "drain":
            checks.append(check_no_aborts(records))
        else:
            # abort mode: answers already streaming when their server was aborted end with finish_reason
            # abort (the router re-sends only those the client has not seen a token of)
            windows = [e for e in ctx.events if e.name.startswith("convert")]
            stray = [r for r in records if r["outcome"] == ABORTED
                     and not any(r["start"] <= e.end and r["end"] >= e.start for e in windows)]
            checks.append(Check("aborted answers only during a conversion", not stray,
                                f"{sum(r['outcome'] == ABORTED for r in records)} aborted, {len(stray)} outside"))
            checks.append(check_aborted_only_once_streaming(records))
        return checks


def check_aborted_only_once_streaming(records: list[dict]) -> Check:
    """With retry_aborted, the router re-sends every request it aborted before the client saw a token."""
    unseen = [r for r in records if r["outcome"] == ABORTED and r["ttft_ms"] is None]
    return Check("aborted answers only once tokens were streamed", not unseen,
                 "the router re-sent the others" if not unseen else
                 f"{len(unseen)} aborted before the client saw a token (whole or stream): "
                 + ", ".join(f"{r['id']} {r['route']}{' stream' if r['stream'] else ''}" for r in unseen[:3]))


class KillDecode(Scenario):
    name = "kill"
    help = "a decode server is SIGKILLed and started again on its port; the router takes it out and back"
    default_duration_s = 40.0
    min_duration_s = 20.0
    min_decode = 2
    # Probes every second, out after 2 failures, back after 2 passes; an open breaker retries after 3 s.
    ROUTER_ARGS = ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "3",
                   "--health-failure-threshold", "2", "--health-success-threshold", "2",
                   "--cb-timeout-duration-secs", "3"]

    def router_args(self) -> list[str]:
        return list(self.ROUTER_ARGS)

    async def act(self, ctx: Context) -> None:
        stack = ctx.stack
        victim = stack.of_role("decode")[0]
        ctx.notes["killed"] = victim.url
        await ctx.load.wait_answers(10, timeout=30, what="answers before the kill")
        await ctx.at(0.25)
        kill_at = time.time()
        await stack.kill(victim)
        ctx.notes["kill_at"] = kill_at

        async def out_of_routing() -> bool:
            entry = await stack.router_worker(victim.url)
            return bool(entry) and not entry["routable"]

        await wait_until(out_of_routing, timeout=20, interval=0.1, what=f"{victim.url} out of routing")
        out_at = time.time()
        entry = await stack.router_worker(victim.url)
        ctx.notes["out_at"] = out_at
        ctx.events.append(Event("killed decode out of routing", kill_at, out_at,
                                f"{entry['health_reason']} (breaker {entry['breaker']})"))
        await ctx.at(0.45)
        restart_at = time.time()
        await stack.restart(victim)
        up_at = time.time()

        async def routable() -> bool:
            entry = await stack.router_worker(victim.url)
            return bool(entry) and entry["routable"]

        await wait_until(routable, timeout=30, interval=0.1, what=f"{victim.url} routable after restart")
        back_at = time.time()
        ctx.notes["back_at"] = back_at
        ctx.events.append(Event("restarted decode up", restart_at, up_at, "its /health answers 200"))
        ctx.events.append(Event("restarted decode back in routing", up_at, back_at))
        took = await ctx.served(victim, SERVED_AFTER_CHANGE, role="decode", timeout=20)
        ctx.check("the killed decode rejoined", True,
                  f"routable {back_at - up_at:.2f} s after it was up, routed {SERVED_AFTER_CHANGE} requests within "
                  f"{took:.2f} s more")

    def judge(self, ctx: Context, records: list[dict]) -> list[Check]:
        errors = [r for r in records if r["outcome"] == ERROR]
        killed = ctx.notes.get("killed")
        router_lines = failed_requests_in_router_log(ctx.stack.router.log_path) if ctx.stack.router else {}
        elsewhere = [r for r in errors if (router_lines.get(r["id"]) or {}).get("decode") != killed]
        checks = [Check("failures only on the killed decode's requests", not elsewhere,
                        f"{len(errors)} failed, all had decode {killed}" if not elsewhere else
                        f"{len(elsewhere)} of {len(errors)} not attributed to {killed}: "
                        + "; ".join(f"{r['id']}: {r['error']} (router: {router_lines.get(r['id'])})"
                                    for r in elsewhere[:3]))]
        out_at = ctx.notes.get("out_at")
        users = ctx.load.options.users
        late = [r for r in errors if out_at is None or r["start"] > out_at]
        checks.append(Check("failures bounded", len(errors) <= users and not late,
                            f"{len(errors)} failed (bound: {users} users in flight at the kill); "
                            f"{len(late)} started after the router took the server out"))
        checks.append(check_no_aborts(records))
        return checks


class UpdateWeights(Scenario):
    name = "weights"
    help = "the fleet's weights are updated twice through the router (/update_weights_from_disk) under load"
    default_duration_s = 40.0
    min_duration_s = 15.0
    VERSIONS = ("loadtest-v1", "loadtest-v2")

    async def act(self, ctx: Context) -> None:
        stack = ctx.stack
        status, info = await stack.router_call("GET", "/get_model_info", timeout=10)
        model_path = info.get("model_path") if status == 200 and isinstance(info, dict) else None
        if not model_path:
            raise RuntimeError(f"GET /get_model_info answered {status}: {info}")
        await ctx.load.wait_answers(10, timeout=30, what="answers before the first update")
        ctx.notes["updates"] = []
        for fraction, version in zip((0.25, 0.6), self.VERSIONS):
            await ctx.at(fraction)
            await self._update(ctx, model_path, version)

    async def _update(self, ctx: Context, model_path: str, version: str) -> None:
        stack = ctx.stack
        mode = self.options.get("update_mode") or "drain"
        body = {"model_path": model_path, "weight_version": version}
        if mode in ("abort", "abort-retry"):
            body["abort_all_requests"] = True
        if mode == "abort-retry":
            body["retry_aborted"] = True  # a router field: re-send what the client has not seen a token of
        start = time.time()
        status, answer = await stack.router_call("POST", "/update_weights_from_disk", body, timeout=120)
        end = time.time()
        ok = status == 200 and isinstance(answer, dict) and answer.get("success") is True
        detail = f"HTTP {status}: {answer.get('message') if isinstance(answer, dict) else answer}"
        ctx.events.append(Event(f"update weights to {version} ({mode})", start, end, detail[:200]))
        ctx.notes["updates"].append({"version": version, "start": start, "end": end, "ok": ok})
        if not ctx.check(f"update to {version} succeeded", ok, detail[:300]):
            return
        workers = await stack.router_workers()
        stale = [f"{w['url']} {w['weight_version']} ({w['state']})" for w in workers if w["weight_version"] != version]
        ctx.check(f"every worker reports {version}", not stale, "; ".join(stale) or f"{len(workers)} workers")
        await ctx.load.wait_answers(SERVED_AFTER_CHANGE, since=end, timeout=20,
                                    what=f"{SERVED_AFTER_CHANGE} answers after the update to {version}")

    def judge(self, ctx: Context, records: list[dict]) -> list[Check]:
        checks = [check_no_errors(records)]
        updates = ctx.notes.get("updates") or []
        if (self.options.get("update_mode") or "drain") == "drain":
            checks.append(check_no_aborts(records))
        else:
            stray = [r for r in records if r["outcome"] == ABORTED
                     and not any(r["start"] <= u["end"] and r["end"] >= u["start"] for u in updates)]
            checks.append(Check("aborted answers only during an update", not stray,
                                f"{sum(r['outcome'] == ABORTED for r in records)} aborted, {len(stray)} outside"))
            if self.options.get("update_mode") == "abort-retry":
                checks.append(check_aborted_only_once_streaming(records))
        checks.extend(version_checks(records, updates, initial="default"))
        return checks


def version_checks(records: list[dict], updates: list[dict], initial: str) -> list[Check]:
    """Answers sent after an update ended carry its version (until the next update began); answers that
    ended before an update began carry the version before it. Streamed OpenAI answers carry none."""
    checks = []
    versioned = [r for r in records if r["outcome"] == OK and r.get("weight_version") is not None]
    previous = initial
    for i, update in enumerate(updates):
        if not update["ok"]:
            break
        next_start = updates[i + 1]["start"] if i + 1 < len(updates) else float("inf")
        after = [r for r in versioned if update["end"] <= r["start"] and r["end"] <= next_start]
        wrong = [r for r in after if r["weight_version"] != update["version"]]
        checks.append(Check(f"answers sent after the update carry {update['version']}", bool(after) and not wrong,
                            f"{len(after)} answers, {len(wrong)} with another version"
                            + (f": {wrong[0]['id']} has {wrong[0]['weight_version']}" if wrong else "")))
        before = [r for r in versioned if r["end"] <= update["start"]
                  and (i == 0 or updates[i - 1]["end"] <= r["start"])]
        old = [r for r in before if r["weight_version"] != previous]
        checks.append(Check(f"answers done before the update carry {previous}", not old,
                            f"{len(before)} answers, {len(old)} with another version"))
        previous = update["version"]
    return checks


SCENARIOS: dict[str, type[Scenario]] = {s.name: s for s in (Steady, Convert, UpdateWeights, KillDecode)}


async def settled(stack: Stack, timeout: float = 10.0) -> Check:
    """Once the load has ended, nothing may stay in flight: not in the router's counts, not on a server
    (a leg left waiting for a KV transfer that never comes, a leaked count)."""
    busy: list[str] = []

    async def idle() -> bool:
        busy.clear()
        for entry in await stack.router_workers():
            if entry["inflight"]:
                busy.append(f"router counts {entry['inflight']} in flight on {entry['url']}")
        for worker in stack.workers:
            try:
                state = await stack.sim_state(worker)
            except Exception as exc:  # noqa: BLE001 - a server that does not answer is not idle
                busy.append(f"{worker.url}: {type(exc).__name__}: {exc}")
                continue
            left = state["running_rids"] + state["waiting_rids"] + state["undispatched_rids"]
            if left or state["inflight_calls"]:
                busy.append(f"{worker.url} ({state['role']}): {state['inflight_calls']} calls, rids {left[:3]}")
        return not busy

    try:
        await wait_until(idle, timeout=timeout, interval=0.2, what="nothing in flight after the load")
        return Check("nothing left in flight", True, "router and servers idle")
    except TimeoutError:
        return Check("nothing left in flight", False, "; ".join(busy[:4]))


def failed_requests_in_router_log(path: Path) -> dict[str, dict]:
    """request id -> the router's access line, for every request the router logged as not successful."""
    found: dict[str, dict] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return found
    for line in lines:
        if not line.startswith(b"{"):
            continue
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if entry.get("logger") == "router.access" and entry.get("outcome") != "success" and "request_id" in entry:
            found[entry["request_id"]] = entry
    return found


@dataclass
class RunOptions:
    load: LoadOptions
    workdir: Path
    prefill: int | None = None
    decode: int | None = None
    worker_args: tuple[str, ...] = DEFAULT_WORKER_ARGS
    extra_router_args: tuple[str, ...] = ()
    faults: dict[str, Any] = field(default_factory=dict)  # set on every worker once the stack is up


async def run(scenario: Scenario, options: RunOptions) -> Summary:
    workdir = options.workdir
    """Start the stack, run the load while the scenario acts, judge; the stack is stopped in every case."""
    stack = Stack(workdir, prefill=options.prefill or scenario.prefill, decode=options.decode or scenario.decode,
                  worker_args=tuple(options.worker_args),
                  router_args=(*scenario.router_args(), *options.extra_router_args))
    try:
        await stack.start()
        for worker in stack.workers if options.faults else ():
            await stack.set_faults(worker, options.faults)
    except Exception as exc:  # noqa: BLE001 - reported as the run's verdict
        await stack.stop()
        return _saved(Summary(scenario.name, stats_of([]), [Check("stack started", False, f"{type(exc).__name__}: {exc}")],
                              workdir=str(workdir)))
    try:
        load = LoadRun(stack.router_url, options.load, workdir)
        ctx = Context(stack, load)
        ctx.notes["load_average_at_start"] = round(os.getloadavg()[0], 2)  # the machine's other users
        load.start()
        try:
            try:
                await asyncio.wait_for(scenario.act(ctx), timeout=options.load.duration_s + 60)
            except Exception as exc:  # noqa: BLE001 - a failed step is a failed check; the load runs on
                ctx.check("scenario steps", False, f"{type(exc).__name__}: {exc}")
                (workdir / "scenario-error.txt").write_text(traceback.format_exc())
            budget = max(load.time_left(), 0) + max(10.0, options.load.request_timeout_s) + 30
            code = await load.wait(timeout=budget)
            if code != 0:
                ctx.check("locust ran", False, f"exit code {code}: {load.process.log_tail(500)}")
        finally:
            load.stop()
        ctx.checks.append(await settled(stack))
        ctx.notes["load_average_at_end"] = round(os.getloadavg()[0], 2)
        records = load.records()
        stats = stats_of(records)
        checks = [check_answers(stats), *ctx.checks, *scenario.judge(ctx, records)]
        if ctx.events:
            warmup = min(WARMUP_S, 0.1 * options.load.duration_s)
            first_sent = min((r["start"] for r in records), default=load.started_at)
            ctx.notes["phases"] = phases(records, ctx.events, warmup_until=first_sent + warmup)
    finally:
        await stack.stop()
    return _saved(Summary(scenario.name, stats, checks, ctx.events, ctx.notes, str(workdir)))


def _saved(summary: Summary) -> Summary:
    Path(summary.workdir, "summary.json").write_bytes(orjson.dumps(summary.to_dict(), option=orjson.OPT_INDENT_2))
    return summary
