"""SGLang's answer to an aborted request, for requests the router aborted before any server could give one.

When the router aborts a pair (abort endpoint, pause, weight update), the servers usually answer with
`finish_reason: {"type": "abort"}` and the partial output, which the request path relays as it is. But a
request aborted before its KV transfer finished gets a 500 from prefill ("Prefill bootstrap failed ...
Aborted by AbortReq.") or decode ("Decode transfer failed ..."), or a closed connection. The client asked
for none of that: it gets the abort answer SGLang gives an aborted request with no output, in the shape of
its route (native or OpenAI, single, batch or n>1, streaming or not).

The request path also recognises an abort answer the client has seen nothing of (`some_sequence_aborted`,
`aborted_before_first_token`): such a request can be re-sent whole.
"""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from router.core.request_shape import RequestShape
from router.dataplane import sse

ABORT_MESSAGE = "Aborted by the router"


def sequence_ids(shape: RequestShape, rids: list[str]) -> list[str]:
    """One id per sequence, as SGLang names them (a batch's own rids, or `rid_i` of an expanded rid)."""
    count = shape.sequences
    if len(rids) == count:
        return list(rids)
    if len(rids) == count + 1:
        return rids[1:]
    return [rids[0] if rids else ""] * count


def _native(rid: str, message: str, weight_version: str | None, index: int | None) -> dict:
    meta = {"id": rid, "finish_reason": {"type": "abort", "message": message, "status_code": None},
            "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    if weight_version is not None:
        meta["weight_version"] = weight_version
    item = {"text": "", "output_ids": [], "meta_info": meta}
    if index is not None:
        item["index"] = index
    return item


def _openai(route: str, rid: str, model: object, count: int, stream: bool) -> dict:
    chat = route == "/v1/chat/completions"
    choices = []
    for i in range(count):
        choice: dict = {"index": i, "logprobs": None, "finish_reason": "abort", "matched_stop": None}
        if chat:
            choice["delta" if stream else "message"] = {"role": "assistant", "content": ""}
        else:
            choice["text"] = ""
        choices.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    answer = {"id": rid, "object": kind + (".chunk" if stream and chat else ""), "created": int(time.time()),
              "model": model, "choices": choices}
    if not stream:
        answer["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return answer


def abort_response(route: str, body: dict, shape: RequestShape, rids: list[str], *,
                   message: str = ABORT_MESSAGE, weight_version: str | None = None) -> web.Response:
    ids = sequence_ids(shape, rids)
    if route == "/generate":
        many = shape.is_batch or shape.n > 1
        items = [_native(rid, message, weight_version, i if (many and shape.stream) else None)
                 for i, rid in enumerate(ids)]
        if shape.stream:
            payload = b"".join(b"data: " + orjson.dumps(item) + b"\n\n" for item in items)
            return web.Response(body=payload + b"data: [DONE]\n\n", headers=sse.RESPONSE_HEADERS)
        answer: object = items if many else items[0]
    else:
        answer = _openai(route, ids[0], body.get("model"), len(ids), shape.stream)
        if shape.stream:
            return web.Response(body=b"data: " + orjson.dumps(answer) + b"\n\ndata: [DONE]\n\n",
                                headers=sse.RESPONSE_HEADERS)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


def some_sequence_aborted(body: bytes) -> bool:
    """A whole (non-streaming) answer in which some sequence ended with finish_reason abort."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return _answer_aborted(answer)


def last_event_aborted(stream_end: bytes) -> bool:
    """The last data event of a stream's end (before its [DONE]) says some sequence ended with abort."""
    for block in reversed(stream_end.split(b"\n\n")):
        block = block.strip()
        if block.startswith(b"data:") and not sse.is_done(block + b"\n\n"):
            return some_sequence_aborted(block[5:])
    return False


def _answer_aborted(answer: object) -> bool:
    for item in answer if isinstance(answer, list) else [answer]:
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info")
        if isinstance(meta, dict):
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and reason.get("type") == "abort":
                return True
        choices = item.get("choices")
        if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort"
                                             for c in choices):
            return True
    return False


def aborted_before_first_token(answer: object) -> bool:
    """True when every sequence of an answer (or a stream's first event) was aborted with no output."""
    items = answer if isinstance(answer, list) else [answer]
    if not items:
        return False
    for item in items:
        if not isinstance(item, dict):
            return False
        meta = item.get("meta_info")
        if isinstance(meta, dict):
            reason = meta.get("finish_reason")
            if not (isinstance(reason, dict) and reason.get("type") == "abort"):
                return False
            if meta.get("completion_tokens") or item.get("output_ids") or item.get("text"):
                return False
            continue
        choices = item.get("choices")
        if isinstance(choices, list) and choices:
            for choice in choices:
                if choice.get("finish_reason") != "abort":
                    return False
                content = (choice.get("message") or choice.get("delta") or {}).get("content") or choice.get("text")
                if content:
                    return False
            continue
        return False
    return True
