"""What the load users send and how they judge the answers: no locust, no I/O (unit-testable).

- `Lengths`: a token-count distribution (`"128:32"` = normal, mean 128, std 32, at least 1).
- `Route`: one endpoint (`generate`, `completions`, `chat`): builds a request body for a prompt and an
  answer length, and reads its answer (whole, or a stream fed event by event) into a `Verdict`.
- A `Verdict` is `ok`, `aborted` (the server ended the answer with finish_reason abort: counted apart from
  errors) or `error` (bad status, error event, no `[DONE]`, missing finish_reason, wrong length).

Prompts are random words: one simulator token each (BOS adds one), so a prompt of N tokens is N-1 words.
Answers are asked with `ignore_eos`, so an answer that ends with finish_reason `length` must have exactly
the tokens asked for: a shorter one means tokens were lost on the way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import orjson

OK, ABORTED, ERROR = "ok", "aborted", "error"
DONE = b"[DONE]"
ROUTE_NAMES = ("generate", "completions", "chat")
# Short, common words: each is one simulator token (and one or two tokens for real tokenizers).
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had "
         "by word but not what all were we when your can said there use an each which she do how their if will "
         "up other about out many then them these so some her would make like him into time has look two more "
         "write go see number no way could people my than first water been call who oil its now find long down "
         "day did get come made may part").split()


@dataclass(frozen=True)
class Lengths:
    """Token counts drawn from a normal distribution, rounded and clipped to [low, high]."""

    mean: int
    std: float = 0.0
    low: int = 1
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Lengths":
        """`MEAN`, `MEAN:STD` or `MEAN:STD:LOW:HIGH` (e.g. `128:32`, `32:8:16:64`)."""
        parts = text.split(":")
        try:
            if len(parts) not in (1, 2, 4):
                raise ValueError
            mean = int(parts[0])
            std = float(parts[1]) if len(parts) > 1 else 0.0
            low, high = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (1, None)
        except ValueError:
            raise ValueError(f"expected MEAN[:STD[:LOW:HIGH]] (e.g. 128:32), got {text!r}") from None
        if mean < 1 or std < 0 or low < 1 or (high is not None and high < max(low, 1)):
            raise ValueError(f"lengths must be positive with 1 <= LOW <= HIGH and STD >= 0, got {text!r}")
        return cls(mean, std, low, high)

    def sample(self, rng: random.Random) -> int:
        value = round(rng.gauss(self.mean, self.std)) if self.std else self.mean
        value = max(value, self.low)
        return min(value, self.high) if self.high is not None else value

    def __str__(self) -> str:
        bounds = f":{self.low}:{self.high}" if self.high is not None or self.low != 1 else ""
        return f"{self.mean}:{self.std:g}{bounds}"


def parse_route_weights(text: str) -> dict[str, float]:
    """`generate,chat` or `generate=2,completions=1,chat=1` -> {route: weight}."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.partition("=")
        if name not in ROUTE_NAMES:
            raise ValueError(f"unknown route {name!r} (known: {', '.join(ROUTE_NAMES)})")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"route weight must be a number, got {item!r}") from None
        if value < 0:
            raise ValueError(f"route weight must not be negative, got {item!r}")
        weights[name] = value
    if not weights or not any(weights.values()):
        raise ValueError(f"no route with a positive weight in {text!r}")
    return weights


class ArrivalClock:
    """Slots at a fixed rate for all users: slot k is due at start + k / rate. A user that is free takes
    the next slot and waits for it; when every user is busy, slots fall due late (the lag is recorded)."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.next_due: float | None = None

    def take(self, now: float) -> float:
        """The (monotonic) time of the next slot."""
        if self.next_due is None:
            self.next_due = now
        due, self.next_due = self.next_due, self.next_due + self.interval
        return due


def make_prompt(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choices(WORDS, k=max(tokens - 1, 1)))


@dataclass
class Verdict:
    outcome: str = OK
    error: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    weight_version: str | None = None


def _error(message: str) -> Verdict:
    return Verdict(ERROR, message[:300])


def error_message(body: bytes) -> str:
    """The message of an error body, in any of the shapes servers and routers use."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode(errors="replace")
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if doc.get("message"):
            return str(doc["message"])
    return body[:200].decode(errors="replace")


class Route:
    """One endpoint: request bodies, and the reading of its answers (subclasses per shape)."""

    name = ""
    path = ""

    def body(self, prompt: str, max_tokens: int, stream: bool, model: str) -> dict[str, Any]:
        raise NotImplementedError

    # -- reading answers: the shape-specific parts
    def _finish_reason(self, doc: dict) -> str | None:
        raise NotImplementedError

    def _tokens(self, doc: dict) -> int | None:
        raise NotImplementedError

    def _weight_version(self, doc: dict) -> str | None:
        return None

    def _token_count_in_event(self, doc: dict) -> int:
        """How many new tokens a stream event carries (0 for role/usage/finish-only events)."""
        raise NotImplementedError

    # -- whole answers
    def read_whole(self, status: int, body: bytes, max_tokens: int) -> Verdict:
        if status != 200:
            return _error(f"HTTP {status}: {error_message(body)}")
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _error(f"answer is not JSON: {body[:100]!r}")
        if not isinstance(doc, dict):
            return _error(f"answer is not a JSON object: {body[:100]!r}")
        if "error" in doc:
            return _error(f"error answer: {error_message(body)}")
        return self._judge(self._finish_reason(doc), self._tokens(doc), self._weight_version(doc), max_tokens)

    def _judge(self, finish: str | None, tokens: int | None, version: str | None, max_tokens: int) -> Verdict:
        verdict = Verdict(OK, "", finish, tokens, version)
        if finish == "abort":
            verdict.outcome, verdict.error = ABORTED, "finish_reason abort"
        elif finish is None:
            verdict.outcome, verdict.error = ERROR, "answer has no finish_reason"
        elif finish == "length" and tokens is not None and tokens != max_tokens:
            verdict.outcome, verdict.error = ERROR, f"finish_reason length after {tokens} tokens, asked for {max_tokens}"
        return verdict

    def stream_reader(self, max_tokens: int) -> "StreamReader":
        return StreamReader(self, max_tokens)


class GenerateRoute(Route):
    name, path = "generate", "/generate"

    def body(self, prompt: str, max_tokens: int, stream: bool, model: str) -> dict[str, Any]:
        return {"text": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}

    def _finish_reason(self, doc: dict) -> str | None:
        reason = (doc.get("meta_info") or {}).get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else reason

    def _tokens(self, doc: dict) -> int | None:
        return (doc.get("meta_info") or {}).get("completion_tokens")

    def _weight_version(self, doc: dict) -> str | None:
        return (doc.get("meta_info") or {}).get("weight_version")

    def _token_count_in_event(self, doc: dict) -> int:
        return -1  # cumulative counts: the reader takes completion_tokens as they grow


class CompletionsRoute(Route):
    name, path = "completions", "/v1/completions"

    def body(self, prompt: str, max_tokens: int, stream: bool, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _choice(self, doc: dict) -> dict:
        choices = doc.get("choices")
        return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}

    def _finish_reason(self, doc: dict) -> str | None:
        return self._choice(doc).get("finish_reason")

    def _tokens(self, doc: dict) -> int | None:
        usage = doc.get("usage")
        return usage.get("completion_tokens") if isinstance(usage, dict) else None

    def _weight_version(self, doc: dict) -> str | None:
        metadata = doc.get("metadata")  # SGLang adds it to whole answers only (not to stream chunks)
        return metadata.get("weight_version") if isinstance(metadata, dict) else None

    def _text(self, choice: dict) -> str:
        return choice.get("text") or ""

    def _token_count_in_event(self, doc: dict) -> int:
        return 1 if self._text(self._choice(doc)) else 0


class ChatRoute(CompletionsRoute):
    name, path = "chat", "/v1/chat/completions"

    def body(self, prompt: str, max_tokens: int, stream: bool, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _text(self, choice: dict) -> str:
        return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


ROUTES: dict[str, Route] = {r.name: r for r in (GenerateRoute(), CompletionsRoute(), ChatRoute())}


@dataclass
class StreamReader:
    """Reads one SSE answer as it arrives: `feed(bytes, now)` per chunk, then `verdict()`.

    Records when the first token arrived (TTFT) and the last one (for the inter-token latency)."""

    route: Route
    max_tokens: int
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    events: int = 0
    done: bool = False
    finish: str | None = None
    usage_tokens: int | None = None
    version: str | None = None
    problem: str = ""
    _buffer: bytes = b""
    _after_done: bool = field(default=False, repr=False)

    def feed(self, chunk: bytes, now: float) -> None:
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r\n" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        *complete, self._buffer = buffer.split(b"\n\n")
        for raw in complete:
            self._event(raw, now)

    def _event(self, raw: bytes, now: float) -> None:
        data = None
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
        if data is None:
            return  # a comment or a keep-alive
        if self.done:
            self._after_done = True
            return
        if data == DONE:
            self.done = True
            return
        self.events += 1
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.problem = self.problem or f"event is not JSON: {data[:80]!r}"
            return
        if not isinstance(doc, dict):
            self.problem = self.problem or f"event is not a JSON object: {data[:80]!r}"
            return
        if "error" in doc:
            self.problem = self.problem or f"error event: {error_message(data)}"
            return
        route = self.route
        new = route._token_count_in_event(doc)
        if new < 0:  # cumulative (generate)
            count = route._tokens(doc) or 0
            new, self.tokens = max(count - self.tokens, 0), max(count, self.tokens)
        else:
            self.tokens += new
        if new:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        usage = route._tokens(doc) if not isinstance(route, GenerateRoute) else None
        if usage is not None:
            self.usage_tokens = usage
        finish = route._finish_reason(doc)
        if finish is not None:
            self.finish = finish
        version = route._weight_version(doc)
        if version is not None:
            self.version = version

    def verdict(self) -> Verdict:
        if self.problem:
            return _error(self.problem)
        if not self.done:
            return _error("stream ended without [DONE]" + (f" after {self.events} event(s)" if self.events else ""))
        if self._after_done:
            return _error("events after [DONE]")
        tokens = self.usage_tokens if self.usage_tokens is not None else self.tokens
        return self.route._judge(self.finish, tokens, self.version, self.max_tokens)

    def itl_s(self) -> float | None:
        """Mean time between tokens after the first (time per output token)."""
        tokens = self.usage_tokens if self.usage_tokens is not None else self.tokens
        if self.first_token_at is None or self.last_token_at is None or tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (tokens - 1)
