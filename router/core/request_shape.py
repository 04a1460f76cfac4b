"""What the router needs to know about a generation request, and the PD fields it injects.

SGLang expands a request into `batch_size * n` sequences; each needs its own bootstrap room on both legs.
A scalar room is expanded by SGLang to room+i; a list is repeated n times, so a list must already hold one
distinct room per sequence. We send a scalar only for a single sequence, and a list of distinct rooms
otherwise (mini_lb sends one room for OpenAI batches and n>1, which can collide).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from router.core import request_fields as fields
from router.core.config import AdmissionConfig
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


def shape_of(route: str, body: dict, limits: AdmissionConfig = DEFAULT_LIMITS) -> RequestShape:
    """The request's shape, its fields judged (`request_fields`): 400 for one no server would serve. The number
    of sequences is bounded first: nothing is looked at per prompt (or built per sequence, later) before."""
    if route == "/generate":
        prompts, is_batch = fields.generate_prompts(body)
        params, n = fields.generate_n(body, limits)
        fields.bound_sequences(prompts, n, limits)
        fields.check_generate_items(body, params, prompts, is_batch, n)
        return_logprob = fields.generate_logprob(body)
    elif route == "/v1/completions":
        prompts, is_batch = fields.completion_prompts(body)
        n = fields.count(body, "n", limits)
        fields.bound_sequences(prompts, n, limits)
        fields.check_completion_items(body, is_batch)
        fields.token_budget(body.get("max_tokens"), "max_tokens", lax=True)
        return_logprob = False
    else:
        fields.chat_messages(body)
        prompts, is_batch = 1, False
        n = fields.count(body, "n", limits)
        fields.token_budget(body.get("max_tokens"), "max_tokens", lax=True)
        fields.token_budget(body.get("max_completion_tokens"), "max_completion_tokens", lax=True)
        return_logprob = False
    rid = body.get("rid")
    fields.check_rid(rid, prompts, is_batch or n > 1)  # one prompt with n > 1 is a batch of one in SGLang
    return RequestShape(
        batch_size=prompts,
        is_batch=is_batch,
        n=n,
        stream=fields.flag(body, "stream"),
        return_logprob=return_logprob,
        client_rid=rid,
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


def _answer_budget(body: dict, route: str) -> int:
    if route == "/generate":
        params = body.get("sampling_params")
        value = params.get("max_new_tokens") if isinstance(params, dict) else None
    else:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def request_sizes(route: str, body: dict) -> tuple[int, int]:
    """(prompt, answer) sizes of a request as the router can read them cheaply, for the rebalancer's mix: the
    first prompt's token ids when given, else its characters / 4; the answer's token budget. 0: unknown. Only
    their ratios are used (the servers' counters give the scale), so a proxy serves."""
    answer = _answer_budget(body, route)
    if route == "/generate":
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids:
            return len(ids[0]) if isinstance(ids[0], list) else len(ids), answer
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        chars = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)) \
            if isinstance(messages, list) else 0
        return chars // 4, answer
    prompt = body.get("text" if route == "/generate" else "prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return len(prompt) // 4, answer
    return (len(prompt) if isinstance(prompt, list) else 0), answer  # a completion's prompt as token ids
