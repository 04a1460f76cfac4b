"""The fields of a generation request the router reads or injects, judged before anything is sent.

A request every server would refuse, or fail on, the same way costs the fleet nothing when the router refuses
it first (400 naming the field): the prompt's shape (text, input_ids, prompt, messages), which sets how many
sequences the request is; `n` and `sampling_params` (one bootstrap room per sequence); `rid` (the router aborts
by it, SGLang keys its state by it); `stream` and `return_logprob` (the router relays and merges by them);
`max_new_tokens` / `max_tokens`. Nothing else of the body is looked at: the servers judge the rest.

What is refused is what SGLang 0.5.23 refuses itself (its `/generate` contract gate, `api/v1/api_types.py`,
and `GenerateReqInput` normalisation, `managers/io_struct.py`; the OpenAI routes' pydantic models,
`entrypoints/openai/protocol.py`) or fails on: a list `rid` for one prompt is a 500 (its state is keyed by
the rid), and an empty prompt in a batch (`input_ids: [[]]`) kills the server's scheduler. Never something it
serves. The OpenAI routes are parsed by pydantic in lax mode, so there `"2"`, `2.0` and `true` are integers
and `"false"`, `"no"`, `0` booleans: the router reads them the same way (a `stream: "false"` is not a
stream) and forwards the fields it reads (`stream`, `n`) written as JSON's own, so that no server, whatever
its parser, reads them otherwise. Bounds of the router's own: `n` at most `--max-n` (1 by default: 0.5.23 cannot serve
n > 1 across a prefill/decode pair, core/config.py), prompts × n at most `--max-batch-size`, checked before
anything is done per sequence. `n` below 1 is refused (SGLang's
`/generate` reads it as 1 for a single prompt; OpenAI's API refuses it).

Cost: a few dictionary reads per request; what is looked at per prompt (a batch's prompts, its rids, its
sampling_params) is bounded by `--max-batch-size` first, and token ids are never looked at one by one.
"""

from __future__ import annotations

import math
import re

from router.core.config import AdmissionConfig
from router.core.errors import BadRequest

SHOWN = 80  # characters of a refused value quoted back


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


def refuse(param: str, what: str, value: object) -> BadRequest:
    return BadRequest(f"{param} must be {what}, got {_shown(value)}", param=param)


# ---- lax parsing: what pydantic (v2, lax mode) makes of a JSON value --------------------------------------
_INT_TEXT = re.compile(r"\s*[+-]?\d[\d_]*(?:\.0*)?\s*")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_int(value: object) -> int | None:
    """An integer as pydantic reads one (`2`, `true`, `2.0`, `"2"`, `" 2 "`, `"2.0"`); None: not an integer."""
    kind = type(value)
    if kind is int:
        return value
    if kind is bool:
        return int(value)
    if kind is float:
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if kind is str and value.isascii() and _INT_TEXT.fullmatch(value):
        return int(value.strip().partition(".")[0])
    return None


def lax_bool(value: object) -> bool | None:
    """A boolean as pydantic reads one (`true`, `1`, `1.0`, `"yes"`, `"off"`, ...); None: not a boolean."""
    kind = type(value)
    if kind is bool:
        return value
    if kind is int or kind is float:
        return bool(value) if value in (0, 1) else None
    if kind is str:
        lowered = value.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else None
    return None


def flag(body: dict, name: str) -> bool:
    """An optional boolean field (null or absent: false). One written another way (`"false"`, `0`) is
    rewritten as JSON's own, so that every server reads it as the router does."""
    value = body.get(name)
    if value is None or value is False:
        return False
    if value is True:
        return True
    parsed = lax_bool(value)
    if parsed is None:
        raise refuse(name, "true or false", value)
    body[name] = parsed
    return parsed


def count(body: dict, name: str, limits: AdmissionConfig, *, param: str | None = None,
          lax: bool = True) -> int:
    """`n`: null or absent is 1; an integer in 1..--max-n, written as one when the client wrote it another way
    (strict inside /generate's sampling_params: there SGLang takes the JSON value as it is)."""
    value = body.get(name)
    if value is None:
        return 1
    param = param or name
    n = value if type(value) is int else lax_int(value) if lax else None
    if n is None:
        raise refuse(param, "an integer", value)
    if n is not value:
        body[name] = n
    if n < 1:
        raise BadRequest(f"{param} must be a positive integer, got {_shown(value)}", param=param)
    if n > limits.max_n:
        if limits.max_n == 1:
            raise BadRequest(f"{param} must be 1, got {n}: SGLang 0.5.23 does not serve n > 1 across a "
                             f"prefill/decode pair (its decode server waits for a warm-up's KV transfer that never "
                             f"comes); send {n} requests, or raise --max-n for servers that serve it", param=param)
        raise BadRequest(f"{param} must be at most {limits.max_n} (--max-n), got {n}", param=param)
    return n


def token_budget(value: object, param: str, *, lax: bool) -> None:
    """max_new_tokens / max_tokens: null, or a non-negative integer (strict on /generate: 0.5.23's gate)."""
    if value is None:
        return
    number = value if type(value) is int else lax_int(value) if lax else None
    if number is None:
        raise refuse(param, "a non-negative integer or null", value)
    if number < 0:
        raise refuse(param, "a non-negative integer or null", value)


def bound_sequences(prompts: int, n: int, limits: AdmissionConfig) -> None:
    """At most --max-batch-size sequences (prompts x n): checked before anything is done per sequence."""
    if prompts * n > limits.max_batch_size:
        what = f"{prompts} prompt(s) x n={n}" if n > 1 else f"{prompts} prompts"
        raise BadRequest(f"the request asks for {prompts * n} sequences ({what}): at most "
                         f"{limits.max_batch_size} (--max-batch-size)", param="n" if n > 1 else None)


# ---- rid -------------------------------------------------------------------------------------------------
def check_rid(rid: object, prompts: int, is_batch: bool) -> None:
    """A string, or one string per prompt for a batch (SGLang expands them for n > 1 itself)."""
    if rid is None or type(rid) is str:
        return
    if type(rid) is not list:
        raise refuse("rid", "a string or a list of strings", rid)
    if not is_batch:
        raise refuse("rid", "a string for a single prompt (a list of rids goes with a list of prompts)", rid)
    if len(rid) != prompts:
        raise BadRequest(f"rid has {len(rid)} entries for {prompts} prompts: one rid per prompt", param="rid")
    for item in rid:
        if type(item) is not str:
            raise refuse("rid", "a list of strings", item)


# ---- /generate -------------------------------------------------------------------------------------------
def generate_prompts(body: dict) -> tuple[int, bool]:
    """(prompts, is_batch) from text, input_ids or input_embeds (the first given, as SGLang reads them)."""
    text = body.get("text")
    if text is not None:
        if type(text) is str:
            return 1, False
        if type(text) is list:
            if not text:
                raise BadRequest("text must not be an empty list", param="text")
            return len(text), True
        raise refuse("text", "a string or a list of strings", text)
    input_ids = body.get("input_ids")
    if input_ids is not None:
        if type(input_ids) is not list:
            raise refuse("input_ids", "a list of token ids or a list of lists of token ids", input_ids)
        if not input_ids:
            if isinstance(body.get("session_params"), dict) and body["session_params"].get("id"):
                return 1, False  # a session's history may be the whole prompt
            raise BadRequest("input_ids must not be empty", param="input_ids")
        first = input_ids[0]
        if type(first) is int:
            return 1, False
        if type(first) is list:
            return len(input_ids), True
        raise refuse("input_ids", "a list of token ids or a list of lists of token ids", first)
    embeds = body.get("input_embeds")
    if embeds is None:  # SGLang's own refusal, without the round trip
        raise BadRequest("one of text, input_ids or input_embeds is required", param="text")
    if isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0] \
            and isinstance(embeds[0][0], list):
        return len(embeds), True
    return 1, False


def generate_n(body: dict, limits: AdmissionConfig) -> tuple[object, int]:
    """(sampling_params, n): n from the (first) sampling params, 1 for beam search (n is then the number of
    beams returned, not of sequences run)."""
    params = body.get("sampling_params")
    if params is None:
        return None, 1
    first = params
    if type(params) is list:
        if not params:
            raise refuse("sampling_params", "an object or a non-empty list of objects", params)
        first = params[0]
    if type(first) is not dict:
        raise refuse("sampling_params", "an object or a list of objects", params)
    n = count(first, "n", limits, param="sampling_params.n", lax=False)
    beams = first.get("beam_width")
    if type(beams) is int and beams > 1:
        n = 1
    return params, n


def check_generate_items(body: dict, params: object, prompts: int, is_batch: bool, n: int) -> None:
    """What is judged prompt by prompt (after the sequences are bounded)."""
    if is_batch:
        text = body.get("text")
        if type(text) is list:
            for item in text:
                if type(item) is not str:
                    raise refuse("text", "a string or a list of strings", item)
        elif text is None and type(body.get("input_ids")) is list:
            for item in body["input_ids"]:
                if type(item) is not list:
                    raise refuse("input_ids", "a list of lists of token ids (one list per prompt)", item)
                if not item:
                    raise BadRequest("input_ids holds an empty prompt", param="input_ids")
    if type(params) is dict:
        budget = params.get("max_new_tokens")
        if budget is not None and (type(budget) is not int or budget < 0):  # (n came from it: nothing else)
            token_budget(budget, "sampling_params.max_new_tokens", lax=False)
    elif type(params) is list:
        if not is_batch and n == 1:  # SGLang reads a single prompt's sampling_params as an object (500)
            raise refuse("sampling_params", "an object for a single prompt", params)
        if len(params) != prompts:
            raise BadRequest(f"sampling_params has {len(params)} entries for {prompts} prompt(s): one object "
                             f"per prompt, or a single object for all", param="sampling_params")
        for item in params:
            check_sampling_params(item, n)


def check_sampling_params(params: object, n: int) -> None:
    if type(params) is not dict:
        raise refuse("sampling_params", "an object or a list of objects", params)
    token_budget(params.get("max_new_tokens"), "sampling_params.max_new_tokens", lax=False)
    value = params.get("n")
    if n > 1 and (value if value is not None else 1) != n:
        raise BadRequest(f"sampling_params.n must be the same for every prompt, got {_shown(value)} and {n}",
                         param="sampling_params.n")


def generate_logprob(body: dict) -> bool:
    """return_logprob: a boolean or a list of booleans (one per prompt); whether any prompt asks for them."""
    value = body.get("return_logprob")
    if type(value) is list:
        wanted = False
        for item in value:
            parsed = item if type(item) is bool else lax_bool(item)
            if parsed is None:
                raise refuse("return_logprob", "true, false or a list of them", item)
            wanted |= parsed
        return wanted
    return flag(body, "return_logprob")


# ---- the OpenAI routes -----------------------------------------------------------------------------------
def completion_prompts(body: dict) -> tuple[int, bool]:
    """prompt: a string, a list of token ids, a list of strings or a list of lists of token ids."""
    if "prompt" not in body:
        raise BadRequest("prompt is required", param="prompt")
    prompt = body["prompt"]
    if type(prompt) is str:
        return 1, False
    if type(prompt) is not list:
        raise refuse("prompt", "a string, a list of strings, a list of token ids or a list of lists of them",
                     prompt)
    if not prompt:
        raise BadRequest("prompt must not be an empty list", param="prompt")
    first = prompt[0]
    if type(first) is str or type(first) is list:
        return len(prompt), True
    if lax_int(first) is None:
        raise refuse("prompt", "a string, a list of strings, a list of token ids or a list of lists of them",
                     first)
    return 1, False


def check_completion_items(body: dict, is_batch: bool) -> None:
    if not is_batch:
        return
    prompt = body["prompt"]
    kind = type(prompt[0])
    for item in prompt:
        if type(item) is not kind:
            raise refuse("prompt", "a list of strings or a list of lists of token ids, not both", item)
        if kind is list and not item:
            raise BadRequest("prompt holds an empty list of token ids", param="prompt")


def chat_messages(body: dict) -> None:
    messages = body.get("messages")
    if type(messages) is not list:
        raise refuse("messages", "a list of messages", messages)
