"""Turn a ``/generate`` body into scheduled items, as SGLang's GenerateReqInput normalises it.

- ``text`` (str or list) or ``input_ids`` (list or list of lists); ``sampling_params`` (dict or list).
- ``rid``: a str (batch: ``rid_i``), a list (one per prompt) or absent (uuid hex each).
- ``n > 1`` turns one prompt into a batch of n samples.
- bootstrap fields: a scalar room with a batch becomes ``room + i``; lists are per item.
Errors carry SGLang's messages; ``BodyError`` is a pydantic-style 400, ``ValueError`` the plain one.
"""

from __future__ import annotations

import math

import random
from dataclasses import dataclass
from typing import Any

from .dp_ranks import rank_fields
from .tokens import encode


def new_rid() -> str:
    """A uuid4-style hex id, without uuid4's os.urandom call per request."""
    return "%032x" % random.getrandbits(128)


class BodyError(Exception):
    """The body fails schema validation (pydantic in SGLang): a list of error dicts."""

    def __init__(self, errors: list[dict]) -> None:
        super().__init__(str(errors))
        self.errors = errors


@dataclass
class ItemSpec:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stop: list[str]
    stop_token_ids: list[int] | None
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None


@dataclass
class GenerateCall:
    items: list[ItemSpec]
    is_single: bool
    stream: bool
    parallel_sample_num: int
    # SGLang's call-level DP fields (simulator/dp_ranks.py): the rank to run on, and decode's prefill rank
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None


def _check_types(body: dict) -> None:
    text = body.get("text")
    if text is not None and not isinstance(text, str) and not (
            isinstance(text, list) and all(isinstance(t, str) for t in text)):
        raise BodyError([
            {"type": "string_type", "loc": ("body", "text", "str"), "msg": "Input should be a valid string",
             "input": text},
            {"type": "list_type", "loc": ("body", "text", "list[str]"), "msg": "Input should be a valid list",
             "input": text},
        ])
    ids = body.get("input_ids")
    if ids is not None and not isinstance(ids, list):
        raise BodyError([{"type": "list_type", "loc": ("body", "input_ids"), "msg": "Input should be a valid list",
                          "input": ids}])
    sp = body.get("sampling_params")
    if sp is not None and not isinstance(sp, (dict, list)):
        raise BodyError([{"type": "dict_type", "loc": ("body", "sampling_params"),
                          "msg": "Input should be a valid dictionary", "input": sp}])


def _per_item(value: Any, num: int, batch_size: int, n: int, default: Any) -> list:
    if value is None:
        return [default] * num
    if isinstance(value, list):
        return value * n if n > 1 else value
    return [value] * num


def _context_problem(input_tokens: int, max_new_tokens: Any, context_length: int) -> str | None:
    """TokenizerManager._validate_one_request: the input alone, then input + max_new_tokens when it was given."""
    if input_tokens >= context_length:
        return f"The input ({input_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
    if max_new_tokens is not None and max_new_tokens + input_tokens > context_length:
        return (f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
                f"You requested a total of {max_new_tokens + input_tokens} tokens: {input_tokens} tokens from the "
                f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens "
                "in the input messages or the completion to fit within the limit.")
    return None


def _number(params: dict, key: str, default: float) -> Any:
    value = params.get(key)
    return default if value is None else value


def _sampling_problem(params: dict, max_new_tokens: int) -> str | None:
    """SamplingParams.verify's checks (0.5.23), in its order, with its messages; non-numbers are not judged."""
    def num(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    temperature = _number(params, "temperature", 1.0)
    top_p, min_p = _number(params, "top_p", 1.0), _number(params, "min_p", 0.0)
    top_k = _number(params, "top_k", -1)
    frequency, presence = _number(params, "frequency_penalty", 0.0), _number(params, "presence_penalty", 0.0)
    repetition, min_new = _number(params, "repetition_penalty", 1.0), _number(params, "min_new_tokens", 0)
    if num(temperature) and (not math.isfinite(temperature) or temperature < 0):
        return f"temperature must be a non-negative finite number, got {temperature}."
    if num(top_p) and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    if num(min_p) and not 0.0 <= min_p <= 1.0:
        return f"min_p must be in [0, 1], got {min_p}."
    if num(top_k) and top_k != -1 and top_k < 1:  # -1 (all) is replaced before the check
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    if num(frequency) and not -2.0 <= frequency <= 2.0:
        return f"frequency_penalty must be in [-2, 2], got {frequency}."
    if num(presence) and not -2.0 <= presence <= 2.0:
        return f"presence_penalty must be in [-2, 2], got {presence}."
    if num(repetition) and not 0.0 < repetition <= 2.0:
        return f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}."
    if num(min_new) and not 0 <= min_new:
        return f"min_new_tokens must be in [0, max_new_tokens], got {min_new}."
    if max_new_tokens < 0:
        return f"max_new_tokens must be at least 0, got {max_new_tokens}."
    if num(min_new) and not min_new <= max_new_tokens:
        return f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new}."
    return None


def _single(body: dict, default_max_new_tokens: int, context_length: int,
            default_bootstrap_port: int | None) -> GenerateCall | None:
    """The common case (one prompt, n = 1, scalar fields) without the batch machinery; None otherwise."""
    text = body.get("text")
    if isinstance(text, str):
        ids = encode(text)
    else:
        ids = body.get("input_ids")
        if text is not None or not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
            return None
        ids = list(ids)
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    elif not isinstance(sp, dict) or sp.get("n", 1) not in (1, None):
        return None
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        return None
    room = body.get("bootstrap_room")
    if isinstance(room, list) or isinstance(body.get("bootstrap_port"), list):
        return None
    max_new = sp.get("max_new_tokens", default_max_new_tokens)
    if max_new is None:
        max_new = default_max_new_tokens
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        return None  # the general path has the messages
    if _context_problem(len(ids), sp.get("max_new_tokens"), context_length) or _sampling_problem(sp, max_new):
        return None
    stop = sp.get("stop") or []
    port = body.get("bootstrap_port")
    item = ItemSpec(
        rid=rid or new_rid(), input_ids=ids, max_new_tokens=max_new,
        stop=[stop] if isinstance(stop, str) else list(stop), stop_token_ids=sp.get("stop_token_ids"),
        return_logprob=bool(body.get("return_logprob")), top_logprobs_num=int(body.get("top_logprobs_num") or 0),
        logprob_start_len=int(-1 if body.get("logprob_start_len") is None else body["logprob_start_len"]),
        bootstrap_host=body.get("bootstrap_host"),
        bootstrap_port=port if port is not None else default_bootstrap_port, bootstrap_room=room)
    return GenerateCall(items=[item], is_single=True, stream=bool(body.get("stream", False)), parallel_sample_num=1)


def parse_generate(body: Any, *, default_max_new_tokens: int, context_length: int,
                   default_bootstrap_port: int | None) -> GenerateCall:
    routed, prefill_rank, errors = rank_fields(body)
    if errors:
        raise BodyError(errors)
    call = _parse_generate(body, default_max_new_tokens=default_max_new_tokens, context_length=context_length,
                           default_bootstrap_port=default_bootstrap_port)
    call.routed_dp_rank, call.disagg_prefill_dp_rank = routed, prefill_rank
    return call


def _parse_generate(body: Any, *, default_max_new_tokens: int, context_length: int,
                    default_bootstrap_port: int | None) -> GenerateCall:
    if isinstance(body, dict):
        call = _single(body, default_max_new_tokens, context_length, default_bootstrap_port)
        if call is not None:
            return call
    if not isinstance(body, dict):
        raise BodyError([{"type": "model_attributes_type", "loc": ("body",),
                          "msg": "Input should be a valid dictionary or object to extract fields from",
                          "input": body}])
    _check_types(body)
    text = body.get("text")
    input_ids = body.get("input_ids")
    if text is None and input_ids is None and body.get("input_embeds") is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        is_single = isinstance(text, str)
        prompts: list = [text] if is_single else list(text)
        tokenized = None
    else:
        if input_ids is None or len(input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        is_single = isinstance(input_ids[0], int)
        tokenized = [input_ids] if is_single else list(input_ids)
        prompts = tokenized
    batch_size = len(prompts)

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        n = sp[0].get("n", 1) if sp else 1
        if any(p.get("n", 1) != n for p in sp):
            raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    else:
        n = (sp or {}).get("n", 1)
    n = n or 1
    if n > 1 and is_single:
        is_single = False
    num = batch_size * n

    # rids
    rid = body.get("rid")
    if is_single:
        if rid is not None and not isinstance(rid, str):
            raise ValueError("The rid should be a string or a list of strings.")
        rids = [rid or new_rid()]
    elif rid is None:
        rids = [new_rid() for _ in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    elif isinstance(rid, list):
        if len(rid) != batch_size:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = list(rid)
    else:
        raise ValueError("The rid should be a string or a list of strings.")
    if len(set(rids)) != len(rids):
        seen: dict[str, int] = {}
        for r in rids:
            seen[r] = seen.get(r, 0) + 1
        raise ValueError(f"Duplicate request IDs detected within the request: {[r for r, c in seen.items() if c > 1]}")
    if n > 1:
        # parallel sampling: every sample gets a fresh rid (TokenizerManager._handle_batch_request)
        rids = [new_rid() for _ in range(num)]

    prompts = prompts * n if n > 1 else prompts
    params = _per_item(sp, num, batch_size, n, {})
    stream = bool(body.get("stream", False))
    return_logprob = _per_item(body.get("return_logprob"), num, batch_size, n, False)
    top_k = _per_item(body.get("top_logprobs_num"), num, batch_size, n, 0)
    start_len = _per_item(body.get("logprob_start_len"), num, batch_size, n, -1)

    hosts = body.get("bootstrap_host")
    ports = body.get("bootstrap_port")
    rooms = body.get("bootstrap_room")
    hosts = [hosts] * num if not isinstance(hosts, list) else (hosts * n if n > 1 else hosts)
    ports = [ports] * num if not isinstance(ports, list) else (ports * n if n > 1 else ports)
    if rooms is None:
        rooms = [None] * num
    elif not isinstance(rooms, list):
        rooms = [rooms + i for i in range(num)] if not is_single else [rooms]
    else:
        rooms = rooms * n if n > 1 else rooms

    items: list[ItemSpec] = []
    for i in range(num):
        p = params[i] if i < len(params) else {}
        asked = p.get("max_new_tokens")
        max_new = default_max_new_tokens if asked is None else asked
        if not isinstance(max_new, int) or isinstance(max_new, bool):
            raise ValueError(f"max_new_tokens must be an integer, got {max_new!r}.")
        ids = list(prompts[i]) if tokenized is not None else encode(prompts[i])
        # TokenizerManager._validate_one_request first, then SamplingParams.verify, as on 0.5.23
        context_problem = _context_problem(len(ids), asked, context_length)
        if context_problem:
            raise ValueError(context_problem)
        sampling_problem = _sampling_problem(p, max_new)
        if sampling_problem:
            raise ValueError(sampling_problem)
        stop = p.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        port = ports[i] if i < len(ports) else None
        items.append(ItemSpec(
            rid=rids[i], input_ids=ids, max_new_tokens=max_new, stop=list(stop),
            stop_token_ids=p.get("stop_token_ids"),
            return_logprob=bool(return_logprob[i]), top_logprobs_num=int(top_k[i] or 0),
            logprob_start_len=int(-1 if start_len[i] is None else start_len[i]),
            bootstrap_host=hosts[i] if i < len(hosts) else None,
            bootstrap_port=port if port is not None else default_bootstrap_port,
            bootstrap_room=rooms[i] if i < len(rooms) else None,
        ))
    return GenerateCall(items=items, is_single=is_single, stream=stream, parallel_sample_num=n)
