"""Light client load on a router while a test changes the fleet: a few threads sending greedy /generate
requests (streaming and not, in turn) in a loop, each answer checked against what the reference server says."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from .real_client import post_json, stream_events

REQUEST_TIMEOUT_S = 120.0


Prompt = str | tuple[int, ...]  # a text, or token ids (sent as input_ids)


@dataclass
class Outcome:
    prompt: Prompt
    stream: bool
    status: int | None
    output_ids: list | None = None
    error: str = ""
    sent: float = 0.0  # time.monotonic() when it was sent


@dataclass
class Load:
    url: str  # the router
    expected: dict[Prompt, list[int]]  # prompt -> output_ids the reference server answers
    sampling_params: dict
    concurrency: int = 3
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _done: threading.Condition = field(default_factory=threading.Condition)  # guards outcomes

    def __enter__(self) -> "Load":
        turns = itertools.count()
        for _ in range(self.concurrency):
            thread = threading.Thread(target=self._run, args=(turns,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=REQUEST_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in self._threads), "a load thread did not end"
        return self.outcomes

    def completed(self) -> int:
        with self._done:
            return len(self.outcomes)

    def wait_completed(self, count: int, timeout: float) -> None:
        """Until `count` requests in all have ended (fails at the deadline)."""
        with self._done:
            if not self._done.wait_for(lambda: len(self.outcomes) >= count, timeout=timeout):
                raise AssertionError(f"only {len(self.outcomes)} of {count} requests ended within {timeout}s")

    def failures(self) -> list[Outcome]:
        with self._done:
            return [o for o in self.outcomes
                    if o.status != 200 or o.output_ids != self.expected[o.prompt] or o.error]

    def _run(self, turns) -> None:
        prompts = list(self.expected)
        while not self._stop.is_set():
            turn = next(turns)
            sent = time.monotonic()
            outcome = self._one(prompts[turn % len(prompts)], stream=turn % 2 == 1)
            outcome.sent = sent
            with self._done:
                self.outcomes.append(outcome)
                self._done.notify_all()

    def _one(self, prompt: Prompt, stream: bool) -> Outcome:
        body = {**prompt_body(prompt), "sampling_params": self.sampling_params}
        try:
            if stream:
                status, events = stream_events(self.url + "/generate", dict(body, stream=True),
                                               timeout=REQUEST_TIMEOUT_S)
                if status != 200 or not events or events[-1] != "[DONE]":
                    return Outcome(prompt, True, status, error=f"stream {events[-2:]}")
                last = events[-2]
                if last["meta_info"]["finish_reason"]["type"] == "abort":
                    return Outcome(prompt, True, status, error=f"aborted: {last['meta_info']}")
                return Outcome(prompt, True, status, last["output_ids"])
            status, answer = post_json(self.url + "/generate", body, timeout=REQUEST_TIMEOUT_S)
            if status != 200:
                return Outcome(prompt, False, status, error=str(answer)[:500])
            return Outcome(prompt, False, status, answer["output_ids"])
        except Exception as e:  # a transport failure is an outcome to report, not a dead thread
            return Outcome(prompt, stream, None, error=f"{type(e).__name__}: {e}")


def prompt_body(prompt: Prompt) -> dict:
    return {"input_ids": list(prompt)} if isinstance(prompt, tuple) else {"text": prompt}
