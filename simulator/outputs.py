"""SGLang 0.5.23 answer shapes: ``/generate`` outputs and ``meta_info``, error bodies.

Key order and presence follow the captured answers in ``tests/fixtures/real_sglang/``
(``test_simulator_fidelity.py`` compares them field by field).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .tokens import token_logprob, token_text

if TYPE_CHECKING:
    from .engine import Engine, Req


def weight_version_spans(req: "Req", num_output_tokens: int) -> list[dict]:
    """SGLang's ``weight_versions``: which weights produced which output tokens."""
    spans = req.spans
    out = []
    for i, (version, start) in enumerate(spans):
        if start < num_output_tokens or start == 0:
            end = spans[i + 1][1] if i + 1 < len(spans) else num_output_tokens
            out.append({"version": version, "start": start, "end": min(end, num_output_tokens)})
    return out


def _logprob_fields(meta: dict, engine: "Engine", req: "Req", n_out: int) -> None:
    ids = req.output_ids[:n_out]
    input_lp: list = []
    if req.logprob_start_len >= 0 and engine.role != "decode":
        start = req.logprob_start_len
        input_lp = [[None if i == 0 else token_logprob(t), t, None]
                    for i, t in enumerate(req.input_ids) if i >= start]
    meta["input_token_logprobs"] = input_lp
    meta["output_token_logprobs"] = [[token_logprob(t), t, None] for t in ids]
    meta["output_token_logprobs_length"] = len(ids)
    if req.top_logprobs_num > 0:
        k = req.top_logprobs_num
        meta["input_top_logprobs"] = [None if i == 0 else [] for i in range(len(input_lp))] if input_lp else []
        meta["output_top_logprobs"] = [
            [[token_logprob(t), t, None]] + [[token_logprob(t) - 0.01 * j, (t * 31 + j) % 32000, None]
                                             for j in range(1, k)]
            for t in ids
        ]


def meta_info(engine: "Engine", req: "Req", *, finished: bool, first: bool) -> dict[str, Any]:
    n_out = len(req.output_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason if finished else None,
        "prompt_tokens": len(req.input_ids),
        "weight_version": engine.weight_version,
        "num_retractions": req.num_retractions,
    }
    if req.return_logprob:
        _logprob_fields(meta, engine, req, n_out)
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = n_out
    meta["cached_tokens"] = req.cached_tokens
    if finished:
        spans = weight_version_spans(req, n_out)
        meta["weight_versions"] = spans
        if spans:
            meta["weight_version"] = spans[-1]["version"]
    # OutputStreamer.get_cached_tokens_details without host/storage tiers: only device hits, or null
    meta["cached_tokens_details"] = {"device": req.cached_tokens, "host": 0} if req.cached_tokens > 0 else None
    meta["dp_rank"] = None
    if finished:
        meta["e2e_latency"] = time.perf_counter() - req.created
    if first:
        meta["response_sent_to_client_ts"] = time.time()
    return meta


def output_text(engine: "Engine", req: "Req") -> str:
    if engine.role == "prefill":
        return token_text(req.output_ids[0]) if req.output_ids else ""
    return req.gen.text


def generate_output(engine: "Engine", req: "Req", *, finished: bool, first: bool) -> dict[str, Any]:
    """One ``/generate`` answer (or one cumulative stream chunk) for one item."""
    return {
        "text": output_text(engine, req),
        "output_ids": list(req.output_ids),
        "meta_info": meta_info(engine, req, finished=finished, first=first),
    }


def waiting_abort_output(engine: "Engine", req: "Req") -> dict[str, Any]:
    """An item aborted before it ran (TokenizerManager._handle_abort_req shape)."""
    n_out = len(req.output_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "weight_version": engine.weight_version,
        "e2e_latency": time.perf_counter() - req.created,
    }
    spans = weight_version_spans(req, n_out)
    meta["weight_versions"] = spans
    meta["completion_tokens"] = n_out
    return {"text": output_text(engine, req), "output_ids": list(req.output_ids), "meta_info": meta}


def failed_output(engine: "Engine", req: "Req", status: int, message: str) -> dict[str, Any]:
    """A stream's last chunk for an item that failed with a status (prepare_abort)."""
    req.finish_reason = {"type": "abort", "message": message, "status_code": status, "err_type": None}
    out = generate_output(engine, req, finished=True, first=not req.first_output_sent)
    out["output_ids"] = []
    out["text"] = ""
    out["meta_info"]["completion_tokens"] = 0
    out["meta_info"]["weight_versions"] = [{"version": engine.weight_version, "start": 0, "end": 0}]
    return out


# ------------------------------------------------------------------ error bodies


def value_error(message: str) -> dict[str, Any]:
    """``_create_error_response``: a ValueError from request handling (400)."""
    return {"error": {"message": message}}


def http_error(status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    """FastAPI HTTPException through SGLang's handler (``ErrorResponse``)."""
    return {"object": "error", "message": message, "type": err_type or str(status), "param": None, "code": status}


def validation_error(path: str, handler: str, errors: list[dict]) -> dict[str, Any]:
    """A request body that fails pydantic validation (SGLang turns 422 into 400)."""
    n = len(errors)
    lines = "\n".join(f"  {e!r}" for e in errors)
    message = (f"{n} validation error{'s' if n != 1 else ''}:\n{lines}\n\n"
               f"  File \"sglang/srt/entrypoints/http_server.py\", in {handler}\n    POST {path} {errors!r}")
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def not_an_instance(struct: str, body: Any) -> dict[str, Any]:
    """Pydantic's first error for a body that is not the request struct (it always leads the list)."""
    return {"type": "is_instance_of", "loc": ("body", f"is-instance[{struct}]"),
            "msg": f"Input should be an instance of {struct}", "input": body, "ctx": {"class": struct}}


def missing_field(path: str, handler: str, field_name: str, body: Any, struct: str) -> dict[str, Any]:
    return validation_error(path, handler, [
        not_an_instance(struct, body),
        {"type": "missing", "loc": ("body", f"function-after[build_struct(), {struct}]", field_name),
         "msg": "Field required", "input": body},
    ])


def not_a_choice(path: str, handler: str, struct: str, field_name: str, value: Any, body: Any,
                 choices: tuple[str, ...]) -> dict[str, Any]:
    """A Literal field given a value outside its choices."""
    expected = ", ".join(map(repr, choices[:-1])) + " or " + repr(choices[-1])  # pydantic's wording
    return validation_error(path, handler, [
        not_an_instance(struct, body),
        {"type": "literal_error", "loc": ("body", f"function-after[build_struct(), {struct}]", field_name),
         "msg": f"Input should be {expected}", "input": value, "ctx": {"expected": expected}},
    ])


def missing_body(path: str, handler: str) -> dict[str, Any]:
    return validation_error(path, handler, [{"type": "missing", "loc": ("body",), "msg": "Field required",
                                             "input": None}])


def json_invalid(path: str, handler: str) -> dict[str, Any]:
    return validation_error(path, handler, [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                                             "input": {}, "ctx": {"error": "invalid JSON"}}])
