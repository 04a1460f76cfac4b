"""What the router needs to know about a generation request, and the PD fields it injects.

SGLang expands a request into `batch_size * n` sequences; each needs its own bootstrap room on both legs.
A scalar room is expanded by SGLang to room+i; a list is repeated n times, so a list must already hold one
distinct room per sequence. We send a scalar only for a single sequence, and a list of distinct rooms
otherwise (mini_lb sends one room for OpenAI batches and n>1, which can collide).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from router.core.config import AdmissionConfig
from router.core.errors import BadRequest
from router.core.registry import Worker

MAX_ROOM = 2**63 - 1
DEFAULT_LIMITS = AdmissionConfig()
_getrandbits = random.getrandbits

# Routes the router proxies to a P/D pair, and the upstream path of each.
GENERATE_ROUTES = {
    "/generate": "/generate",
    "/v1/completions": "/v1/completions",
    "/v1/chat/completions": "/v1/chat/completions",
}


def new_room() -> int:
    return _getrandbits(63)


@dataclass(slots=True)
class RequestShape:
    """Sizes and flags read once from the client's body."""

    batch_size: int  # number of prompts; 1 for a single prompt
    is_batch: bool  # the prompt was given as a list (even of length 1)
    n: int  # parallel samples per prompt
    stream: bool
    return_logprob: bool
    client_rid: object  # the client's own rid (str, list or None)

    @property
    def sequences(self) -> int:
        return self.batch_size * self.n


def _n_of(body: dict, route: str, limits: AdmissionConfig) -> int:
    if route == "/generate":
        params = body.get("sampling_params")
        if isinstance(params, list):
            params = params[0] if params else None
        n = params.get("n", 1) if isinstance(params, dict) else 1
    else:
        n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"n must be a positive integer, got {n!r}", param="n")
    if n > limits.max_n:
        raise BadRequest(f"n must be at most {limits.max_n} (--max-n), got {n}", param="n")
    return n


def bound_sequences(prompts: int, n: int, limits: AdmissionConfig) -> None:
    """At most --max-batch-size sequences (prompts x n): checked before anything is done per sequence."""
    if prompts * n > limits.max_batch_size:
        what = f"{prompts} prompt(s) x n={n}" if n > 1 else f"{prompts} prompts"
        raise BadRequest(f"the request asks for {prompts * n} sequences ({what}): at most "
                         f"{limits.max_batch_size} (--max-batch-size)", param="n" if n > 1 else None)


def _generate_batch(body: dict) -> tuple[int, bool]:
    text = body.get("text")
    if text is not None:
        if isinstance(text, str):
            return 1, False
        if isinstance(text, list):
            if not text:
                raise BadRequest("text must not be an empty list", param="text")
            return len(text), True
        raise BadRequest("text must be a string or a list of strings", param="text")
    input_ids = body.get("input_ids")
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise BadRequest("input_ids must be a list of token ids or a list of lists", param="input_ids")
        if input_ids and isinstance(input_ids[0], list):
            return len(input_ids), True
        return 1, False
    embeds = body.get("input_embeds")
    if isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0] \
            and isinstance(embeds[0][0], list):
        return len(embeds), True
    return 1, False


def _completions_batch(body: dict) -> tuple[int, bool]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt), True
    return 1, False


def shape_of(route: str, body: dict, limits: AdmissionConfig = DEFAULT_LIMITS) -> RequestShape:
    """The request's shape; 400 for one the router cannot route. The number of sequences is bounded first:
    nothing is looked at per prompt (or built per sequence, later) before."""
    if route == "/generate":
        batch_size, is_batch = _generate_batch(body)
    elif route == "/v1/completions":
        batch_size, is_batch = _completions_batch(body)
    else:
        batch_size, is_batch = 1, False
    n = _n_of(body, route, limits)
    bound_sequences(batch_size, n, limits)
    return_logprob = False
    if route == "/generate":
        logprob = body.get("return_logprob")
        return_logprob = any(bool(x) for x in logprob) if isinstance(logprob, list) else bool(logprob)
    return RequestShape(
        batch_size=batch_size,
        is_batch=is_batch,
        n=n,
        stream=bool(body.get("stream")),
        return_logprob=return_logprob,
        client_rid=body.get("rid"),
    )


def inject_bootstrap(body: dict, shape: RequestShape, prefill: Worker) -> None:
    """Add bootstrap_host/port/room for this attempt (in place: `body` is the router's own copy)."""
    count = shape.sequences
    if count == 1 and not shape.is_batch:
        body["bootstrap_host"] = prefill.bootstrap_host
        body["bootstrap_port"] = prefill.bootstrap_port
        body["bootstrap_room"] = new_room()
        return
    rooms = set()
    while len(rooms) < count:
        rooms.add(new_room())
    body["bootstrap_host"] = [prefill.bootstrap_host] * count
    body["bootstrap_port"] = [prefill.bootstrap_port] * count
    body["bootstrap_room"] = list(rooms)


def assign_rid(body: dict, shape: RequestShape, inject: bool) -> list[str]:
    """Make sure the request carries a rid; return every rid SGLang will know its sequences by.

    SGLang 0.5.23 aborts by exact rid, and names the sequences of a batch or of n>1 `rid_i`.
    """
    rid = shape.client_rid
    if rid is None:
        if not inject:
            return []
        rid = f"{_getrandbits(128):032x}"  # as unique as uuid4().hex, without a syscall per request
        if shape.is_batch and shape.n == 1:
            # One rid per prompt: every SGLang version accepts a list of batch size.
            rid = [f"{rid}-{i}" for i in range(shape.batch_size)]
        body["rid"] = rid
    if isinstance(rid, list):
        return [str(r) for r in rid]
    rid = str(rid)
    count = shape.sequences
    if count == 1 and not shape.is_batch:
        return [rid]
    return [rid] + [f"{rid}_{i}" for i in range(count)]


def prompt_text(route: str, body: dict) -> str | None:
    """A cheap text key for prefix-aware policies (first prompt only)."""
    if route == "/generate":
        text = body.get("text")
        if isinstance(text, list):
            text = text[0] if text else None
        if isinstance(text, str):
            return text
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids:
            first = ids[0] if isinstance(ids[0], list) else ids
            return " ".join(map(str, first[:512]))
        return None
    if route == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else None
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            return " ".join(map(str, prompt[:512]))
        return None
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
        return "\n".join(parts)
    return None
