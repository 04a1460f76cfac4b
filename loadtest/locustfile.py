"""Locust users for an SGLang-style endpoint (pd-router, mini_lb, a server): `/generate`, `/v1/completions`,
`/v1/chat/completions`, streaming and not.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 16 -t 30s \\
        --prompt-tokens 128:32 --output-tokens 32:8 --stream-fraction 0.5 [--rate 20] [--csv out/run]

Every request appears in locust's stats (UI, CSV, percentiles) under its route, e.g. `/generate stream`:
- request type `POST`: end-to-end latency (until the last byte), failures with their reason;
- `TTFT`: time to the first token (streaming answers);
- `ITL`: the answer's mean inter-token latency (streaming answers with two tokens or more);
- `ABORTED`: answers that ended with finish_reason abort, counted apart from errors.

`--rate R` sends R requests/s in all (slots shared by the users of this process, at most one request in
flight per user: use enough users); without it each user sends its next request as soon as the last ends.
`--record-file PATH` also writes one JSON line per request (what the scenarios of `python -m loadtest` check).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time

import gevent
import orjson
from locust import FastHttpUser, events, task

try:
    from loadtest.workload import ROUTES
except ImportError:  # `locust -f path/to/loadtest/locustfile.py` without pd-router installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadtest.workload import (ABORTED, ERROR, OK, ROUTES, ArrivalClock, Lengths, Verdict, make_prompt,  # noqa: E402
                               parse_route_weights)

ALL_STATUSES = frozenset(range(100, 600))  # judge statuses here, keeping error bodies for the report
_request_ids = itertools.count(1)
_user_numbers = itertools.count()
_id_prefix = f"lt{os.getpid():x}"


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--routes", default="generate,completions,chat",
                       help="routes and weights: generate,completions,chat or generate=2,chat=1")
    parser.add_argument("--stream-fraction", type=float, default=0.5, help="share of streaming requests (0..1)")
    parser.add_argument("--prompt-tokens", default="128:32", help="prompt length MEAN[:STD[:LOW:HIGH]]")
    parser.add_argument("--output-tokens", default="32:8", help="answer length MEAN[:STD[:LOW:HIGH]]")
    parser.add_argument("--rate", type=float, default=0.0,
                       help="fixed arrival rate, requests/s over all users of this process (0: closed loop)")
    parser.add_argument("--model", default="default", help="model name sent to the OpenAI routes")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds, per request")
    parser.add_argument("--seed", type=int, default=None, help="seed of prompts, lengths and routes")
    parser.add_argument("--record-file", default="", include_in_web_ui=False,
                       help="write one JSON line per request to this file")


class Workload:
    """The parsed options, shared by every user of this process."""

    def __init__(self, options) -> None:
        self.weights = parse_route_weights(options.routes)
        self.prompt = Lengths.parse(options.prompt_tokens)
        self.output = Lengths.parse(options.output_tokens)
        if not 0.0 <= options.stream_fraction <= 1.0:
            raise ValueError(f"--stream-fraction must be within 0..1, got {options.stream_fraction}")
        if options.rate < 0:
            raise ValueError(f"--rate must not be negative, got {options.rate}")
        self.stream_fraction = options.stream_fraction
        self.model = options.model
        self.timeout = options.request_timeout
        self.seed = options.seed
        self.clock = ArrivalClock(options.rate) if options.rate > 0 else None
        self.record = open(options.record_file, "a", buffering=1) if options.record_file else None

    def close(self) -> None:
        if self.record is not None:
            self.record.close()
            self.record = None


_workload: Workload | None = None


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    """Read the options when a test starts (the web UI may have changed them since the command line)."""
    global _workload
    if _workload is not None:
        _workload.close()
    _workload = Workload(environment.parsed_options)


@events.quitting.add_listener
def _on_quit(environment, **_kw) -> None:
    if _workload is not None:
        _workload.close()


class LLMUser(FastHttpUser):
    """One client: picks a route, a streaming mode, a prompt and an answer length; sends; judges."""

    def __init__(self, environment) -> None:
        workload = _workload
        assert workload is not None, "the locustfile's options were not parsed"
        self.workload = workload
        self.network_timeout = self.connection_timeout = workload.timeout  # read by FastHttpUser.__init__
        super().__init__(environment)

    def wait_time(self) -> float:
        """Closed loop: none. Fixed rate: until the next free slot (locust interrupts this wait on stop)."""
        clock = self.workload.clock
        if clock is None:
            return 0.0
        now = time.monotonic()
        self.due = clock.take(now)
        return max(self.due - now, 0.0)

    def on_start(self) -> None:
        workload = self.workload
        seed = None if workload.seed is None else workload.seed * 100_003 + next(_user_numbers)
        self.rng = random.Random(seed)
        self.routes = list(workload.weights)
        self.route_weights = [workload.weights[name] for name in self.routes]
        self.client.client.valid_response_codes = ALL_STATUSES
        self.due = 0.0
        if workload.clock is not None:
            gevent.sleep(self.wait_time())  # the first request waits for its slot too

    @task
    def next_request(self) -> None:
        workload = self.workload
        lag = max(time.monotonic() - self.due, 0.0) if workload.clock is not None else 0.0
        rng = self.rng
        route = ROUTES[rng.choices(self.routes, self.route_weights)[0]]
        stream = rng.random() < workload.stream_fraction
        prompt_tokens = workload.prompt.sample(rng)
        max_tokens = workload.output.sample(rng)
        body = route.body(make_prompt(rng, prompt_tokens), max_tokens, stream, workload.model)
        self.send(route, stream, body, max_tokens, prompt_tokens, lag)

    def send(self, route, stream: bool, body: dict, max_tokens: int, prompt_tokens: int, lag: float) -> None:
        name = route.path + (" stream" if stream else "")
        request_id = f"{_id_prefix}-{next(_request_ids):x}"
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        payload = orjson.dumps(body)
        started_wall = time.time()
        started = time.perf_counter()
        ttft = itl = None
        size = 0
        status = 0
        with self.client.request("POST", route.path, data=payload, headers=headers, name=name, stream=stream,
                                 catch_response=True) as resp:
            status = resp.status_code
            error = getattr(resp, "error", None)
            if error is not None:  # no answer at all: connection refused, reset, timeout
                verdict = Verdict(ERROR, f"{type(error).__name__}: {error}"[:300])
            elif stream and status == 200:
                reader = route.stream_reader(max_tokens)
                # Line by line: FastResponse.iter_content(n) waits for n bytes, which would hide token timing.
                raw = resp._response
                try:
                    while line := raw.readline(b"\n"):
                        size += len(line)
                        reader.feed(line, time.perf_counter())
                except Exception as exc:  # noqa: BLE001 - a broken stream is the server's failure, judged below
                    reader.problem = reader.problem or f"stream broke: {type(exc).__name__}: {exc}"
                verdict = reader.verdict()
                if reader.first_token_at is not None:
                    ttft = reader.first_token_at - started
                itl = reader.itl_s()
            else:
                content = resp.content or b""
                size = len(content)
                verdict = route.read_whole(status, content, max_tokens)
            e2e = time.perf_counter() - started
            resp.request_meta["response_time"] = e2e * 1000
            resp.request_meta["response_length"] = size
            if verdict.outcome == OK:
                resp.success()
            elif verdict.outcome == ABORTED:
                resp.request_meta["request_type"] = "ABORTED"  # its own row, not a failure of POST
                resp.success()
            else:
                resp.failure(verdict.error)
        fire = self.environment.events.request.fire
        if verdict.outcome == OK and ttft is not None:
            fire(request_type="TTFT", name=name, response_time=ttft * 1000, response_length=0, exception=None,
                 context={})
        if verdict.outcome == OK and itl is not None:
            fire(request_type="ITL", name=name, response_time=itl * 1000, response_length=0, exception=None,
                 context={})
        record = self.workload.record
        if record is not None:
            record.write(orjson.dumps({
                "id": request_id, "route": route.name, "stream": stream, "start": started_wall,
                "end": started_wall + e2e, "status": status, "outcome": verdict.outcome, "error": verdict.error,
                "e2e_ms": round(e2e * 1000, 3), "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
                "itl_ms": None if itl is None else round(itl * 1000, 3), "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens, "completion_tokens": verdict.completion_tokens,
                "finish_reason": verdict.finish_reason, "weight_version": verdict.weight_version,
                "lag_ms": round(lag * 1000, 3),
            }).decode() + "\n")
