"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

They turn the body into the same items as ``/generate`` (bootstrap fields included, a scalar room
with a prompt list or ``n > 1`` expanded to ``room + i`` as SGLang does) and render the answer in
OpenAI's shapes as SGLang 0.5.23 does (``metadata.weight_version``, ``matched_stop``, usage chunk).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from . import outputs
from .requests import Req, RequestFailed
from .httputil import json_response
from .dp_ranks import RANK_FIELDS
from .inputs import BodyError, GenerateCall, parse_generate
from .tokens import apply_chat_template, encode, token_logprob, token_text

from .formats import Format, StreamState, sse

if TYPE_CHECKING:
    from .server import Server


def add_routes(router: web.UrlDispatcher, worker: "Server") -> None:
    routes = OpenAIRoutes(worker)
    router.add_post("/v1/completions", routes.completions)
    router.add_post("/v1/chat/completions", routes.chat_completions)
    router.add_get("/v1/models", routes.models)
    router.add_get("/v1/models/{model:.*}", routes.model_card)


def _bad_request(message: str, err_type: str = "BadRequestError") -> web.Response:
    return json_response(outputs.http_error(400, message, err_type), 400)


class OpenAIRoutes:
    def __init__(self, worker: "Server") -> None:
        self.worker = worker

    def _card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": self.worker.config.context_length}

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._card(self.worker.config.model_name)]})

    async def model_card(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model != self.worker.config.model_name:
            return json_response({"error": {"message": f"The model '{model}' does not exist",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}, 404)
        return json_response(self._card(model))

    async def _body(self, request: web.Request, handler: str) -> Any:
        ctype = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            errs = [{"loc": ["header", "content-type"],
                     "msg": "Unsupported Media Type: Only 'application/json' is allowed", "type": "value_error"}]
            return json_response({"object": "error", "message": f"1 validation error:\n  {errs[0]!r} {errs!r}",
                                  "type": "Bad Request", "param": None, "code": 400}, 400)
        raw = await request.read()
        import orjson  # noqa: PLC0415

        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return json_response(outputs.json_invalid(request.path, handler), 400)

    def _generate_body(self, body: dict, prompt: Any, max_new: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new, "n": body.get("n", 1) or 1}
        if body.get("stop") is not None:
            params["stop"] = body["stop"]
        if body.get("stop_token_ids") is not None:
            params["stop_token_ids"] = body["stop_token_ids"]
        gen: dict[str, Any] = {"sampling_params": params, "stream": bool(body.get("stream", False))}
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            gen["text"] = prompt
        else:
            gen["input_ids"] = prompt
        for key in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room", *RANK_FIELDS):
            if body.get(key) is not None:
                gen[key] = body[key]
        return gen

    async def _serve(self, request: web.Request, body: dict, gen_body: dict, fmt: "OpenAIFormat",
                     route: str) -> web.StreamResponse:
        cfg = self.worker.config
        try:
            call = parse_generate(gen_body, default_max_new_tokens=cfg.default_max_new_tokens,
                                  context_length=cfg.context_length,
                                  default_bootstrap_port=self.worker.launch_bootstrap_port)
        except (BodyError, ValueError) as exc:
            return _bad_request(str(exc))
        if fmt.logprobs:
            for item in call.items:
                item.return_logprob = True
                item.top_logprobs_num = fmt.top_logprobs
        return await self.worker.serve(request, call, route, fmt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.worker.count("completions")
        body = await self._body(request, "openai_v1_completions")
        if isinstance(body, web.StreamResponse):
            return body
        if not isinstance(body, dict) or "prompt" not in body:
            return json_response(outputs.missing_body(request.path, "openai_v1_completions"), 400)
        max_tokens = body.get("max_tokens", 16)
        if max_tokens is not None and max_tokens <= 0:
            return _bad_request("max_tokens must be positive")
        gen = self._generate_body(body, body["prompt"], max_tokens)
        gen["sampling_params"]["max_new_tokens"] = max_tokens if max_tokens is not None else 16
        fmt = CompletionFormat(body)
        return await self._serve(request, body, gen, fmt, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.worker.count("chat_completions")
        body = await self._body(request, "openai_v1_chat_completions")
        if isinstance(body, web.StreamResponse):
            return body
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            inp = body if isinstance(body, dict) else None
            return json_response(outputs.validation_error(request.path, "openai_v1_chat_completions", [
                {"type": "missing", "loc": ("body", "messages"), "msg": "Field required", "input": inp}]), 400)
        prompt_ids = encode(apply_chat_template(body["messages"]))
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or \
            self.worker.config.default_max_new_tokens
        gen = self._generate_body(body, prompt_ids, max_new)
        fmt = ChatFormat(body)
        return await self._serve(request, body, gen, fmt, "chat_completions")


class OpenAIFormat(Format):
    object_name = ""
    chunk_object = ""

    def __init__(self, body: dict) -> None:
        self.body = body
        self.model = body.get("model", "default")
        self.created = int(time.time())
        self.n = body.get("n", 1) or 1
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage"))
        self.logprobs = False
        self.top_logprobs = 0

    # -- shared pieces

    @staticmethod
    def finish(req: Req) -> str | None:
        return req.finish_reason.get("type") if req.finish_reason else None

    @staticmethod
    def matched(req: Req) -> Any:
        return req.finish_reason.get("matched") if req.finish_reason else None

    def usage(self, reqs: list[Req]) -> dict[str, Any]:
        # prompt tokens count once per prompt (n samples share one)
        prompt = sum(len(r.input_ids) for i, r in enumerate(reqs) if i % self.n == 0)
        completion = sum(len(r.output_ids) for r in reqs)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}

    def metadata(self, worker: "Server", req: Req) -> dict[str, Any]:
        spans = outputs.weight_version_spans(req, len(req.output_ids))
        return {"weight_version": spans[-1]["version"] if spans else worker.engine.weight_version,
                "weight_versions": spans}

    def stream_state(self, worker: "Server", reqs: list[Req], call: GenerateCall) -> "StreamState":
        state = StreamState()
        state.extra["index"] = {req.rid: i for i, req in enumerate(reqs)}
        state.extra["id"] = reqs[0].rid if reqs else uuid.uuid4().hex
        return state

    def failed_chunks(self, worker: "Server", req: Req, state: "StreamState", exc: RequestFailed,
                      *, batch: bool) -> list[bytes]:
        state.finals.add(id(req))
        err_type = {400: "BAD_REQUEST", 500: "INTERNAL_SERVER_ERROR", 503: "SERVICE_UNAVAILABLE"}.get(
            exc.status, str(exc.status))
        return [sse({"error": outputs.http_error(exc.status, exc.message, err_type)})]

    def stream_error(self, message: str) -> dict[str, Any]:
        return {"error": outputs.http_error(400, message, "BadRequestError")}

    def failure_response(self, exc: RequestFailed) -> web.Response:
        if exc.status == 400:
            return _bad_request(exc.message)
        return json_response(outputs.http_error(exc.status, exc.message), exc.status)

    def tail(self, worker: "Server", reqs: list[Req], state: "StreamState") -> list[bytes]:
        if not self.include_usage:
            return []
        return [sse({"id": state.extra["id"], "object": self.chunk_object, "created": self.created,
                     "model": self.model, "choices": [], "usage": self.stream_usage(reqs)})]

    def stream_usage(self, reqs: list[Req]) -> dict[str, Any]:
        return self.usage(reqs)


class CompletionFormat(OpenAIFormat):
    object_name = "text_completion"
    chunk_object = "text_completion"

    def stream_usage(self, reqs: list[Req]) -> dict[str, Any]:
        # SGLang 0.5.23's completions usage chunk has no *_details fields (the chat one has them)
        usage = self.usage(reqs)
        return {k: usage[k] for k in ("prompt_tokens", "total_tokens", "completion_tokens", "reasoning_tokens")}

    def __init__(self, body: dict) -> None:
        super().__init__(body)
        if body.get("logprobs") is not None:
            self.logprobs = True
            self.top_logprobs = int(body["logprobs"])

    def _logprobs(self, worker: "Server", req: Req, start: int = 0) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        ids = req.output_ids[start:]
        out: dict[str, Any] = {"text_offset": [-1] * len(ids), "token_logprobs": [token_logprob(t) for t in ids],
                               "tokens": [token_text(t) for t in ids], "top_logprobs": []}
        for t in ids:
            tops = {token_text(t): token_logprob(t)}
            for j in range(1, self.top_logprobs):
                alt = (t * 31 + j) % 32000
                tops.setdefault(token_text(alt), token_logprob(t) - 0.01 * j)
            out["top_logprobs"].append(tops)
        return out

    def whole(self, worker: "Server", reqs: list[Req], call: GenerateCall) -> web.Response:
        engine = worker.engine
        choices = [{"index": i, "text": outputs.output_text(engine, req), "logprobs": self._logprobs(worker, req),
                    "finish_reason": self.finish(req), "matched_stop": self.matched(req)}
                   for i, req in enumerate(reqs)]
        return json_response({"id": reqs[0].rid, "object": "text_completion", "created": self.created,
                              "model": self.model, "choices": choices, "usage": self.usage(reqs),
                              "metadata": self.metadata(worker, reqs[0])})

    def chunks(self, worker: "Server", req: Req, state: "StreamState", *, batch: bool) -> list[bytes]:
        key = id(req)
        sent = state.sent_len.get(key, 0)
        delta = _text_delta(worker, req, state)
        state.sent_len[key] = len(req.output_ids)
        finished = req.done
        if finished:
            state.finals.add(key)
        choice = {"index": state.extra["index"].get(req.rid, 0), "text": delta,
                  "logprobs": self._logprobs(worker, req, sent), "finish_reason": self.finish(req) if finished
                  else None, "matched_stop": self.matched(req) if finished else None}
        return [sse({"id": req.rid, "object": "text_completion", "created": self.created, "model": self.model,
                     "choices": [choice], "usage": None})]


def _text_delta(worker: "Server", req: Req, state: "StreamState") -> str:
    """The text not streamed yet (stop strings trimmed, as the whole answer would be)."""
    if worker.engine.role == "prefill" and not req.done:
        return ""
    sent_chars = state.extra.setdefault("sent_chars", {})
    full = outputs.output_text(worker.engine, req)
    if not req.done and req.gen.stop:
        # hold back a tail that could still become a stop string
        full = full[: max(0, len(full) - max(len(s) for s in req.gen.stop) + 1)]
    start = sent_chars.get(id(req), 0)
    sent_chars[id(req)] = max(start, len(full))
    return full[start:]


class ChatFormat(OpenAIFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, body: dict) -> None:
        super().__init__(body)
        if body.get("logprobs"):
            self.logprobs = True
            self.top_logprobs = int(body.get("top_logprobs") or 0)

    def _logprobs(self, req: Req, start: int = 0) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for t in req.output_ids[start:]:
            text = token_text(t)
            tops = [{"token": text, "bytes": list(text.encode()), "logprob": token_logprob(t)}]
            for j in range(1, self.top_logprobs):
                alt = token_text((t * 31 + j) % 32000)
                tops.append({"token": alt, "bytes": list(alt.encode()), "logprob": token_logprob(t) - 0.01 * j})
            content.append({"token": text, "bytes": list(text.encode()), "logprob": token_logprob(t),
                            "top_logprobs": tops[: self.top_logprobs]})
        return {"content": content}

    def whole(self, worker: "Server", reqs: list[Req], call: GenerateCall) -> web.Response:
        engine = worker.engine
        choices = [{"index": i,
                    "message": {"role": "assistant", "content": outputs.output_text(engine, req),
                                "reasoning_content": None},
                    "logprobs": self._logprobs(req), "finish_reason": self.finish(req),
                    "matched_stop": self.matched(req)}
                   for i, req in enumerate(reqs)]
        return json_response({"id": reqs[0].rid, "object": "chat.completion", "created": self.created,
                              "model": self.model, "choices": choices, "usage": self.usage(reqs),
                              "metadata": self.metadata(worker, reqs[0])})

    def _chunk(self, req: Req, index: int, delta: dict, finish: str | None = None, matched: Any = None,
               logprobs: Any = None) -> bytes:
        return sse({"id": req.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                                 "matched_stop": matched}]})

    def chunks(self, worker: "Server", req: Req, state: "StreamState", *, batch: bool) -> list[bytes]:
        key = id(req)
        index = state.extra["index"].get(req.rid, 0)
        out: list[bytes] = []
        if key not in state.sent_len:
            out.append(self._chunk(req, index, {"reasoning_content": None, "role": "assistant", "content": ""}))
            state.sent_len[key] = 0
        sent = state.sent_len[key]
        n = len(req.output_ids)
        text = _text_delta(worker, req, state)
        if text:
            out.append(self._chunk(req, index, {"reasoning_content": None, "content": text},
                                   logprobs=self._logprobs(req, sent)))
        state.sent_len[key] = n
        if req.done:
            state.finals.add(key)
            out.append(self._chunk(req, index, {"reasoning_content": None}, self.finish(req), self.matched(req)))
        return out
