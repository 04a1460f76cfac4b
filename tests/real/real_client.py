"""Small synchronous HTTP helpers for talking to real SGLang servers in tests (stdlib only)."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from harness import processes

REQUEST_TIMEOUT_S = 60.0


def request_json(method: str, url: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
        e.close()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def get_json(url: str, timeout: float = 10.0) -> Any:
    status, body = request_json("GET", url, timeout=timeout)
    assert status == 200, f"GET {url} -> {status}: {body}"
    return body


def live_role(url: str) -> str:
    """The schedulers' role (server_info's top-level disaggregation_mode is the launch role)."""
    states = get_json(f"{url}/server_info")["internal_states"]
    roles = {s["disaggregation_mode"] for s in states}
    assert len(roles) == 1, roles
    return roles.pop()


def is_idle(url: str) -> bool:
    loads = get_json(f"{url}/v1/loads")["loads"]
    return all(l["num_running_reqs"] == 0 and l["num_waiting_reqs"] == 0 for l in loads)


def running_requests(url: str) -> int:
    return sum(l["num_running_reqs"] for l in get_json(f"{url}/v1/loads")["loads"])


def wait_until(predicate: Callable[[], bool], *, timeout: float, what, interval: float = 0.2) -> None:
    """Poll predicate until true; at the deadline fail with `what` (a string, or a callable for late detail):
    the harness's wait (`harness.processes.wait_until`) with the real tier's interval and a test failure."""
    try:
        processes.wait_until(predicate, timeout=timeout, what=what, interval=interval)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def convert(url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    return request_json("POST", f"{url}/convert_pd_role", {} if body is None else body, timeout=timeout)


def pd_generate(prefill_url: str, decode_url: str, bootstrap_port: int, text: str, *, max_new_tokens: int = 8,
                timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """One PD request by hand, as a router sends it: the same body and bootstrap room to both servers."""
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        p = pool.submit(_leg, f"{prefill_url}/generate", body, timeout)
        d = pool.submit(_leg, f"{decode_url}/generate", body, timeout)
        (p_status, p_body), (d_status, d_body) = p.result(), d.result()
    return {"prefill_status": p_status, "prefill": p_body, "decode_status": d_status, "decode": d_body}


def _leg(url: str, body: dict, timeout: float) -> tuple[Any, Any]:
    """One leg's (status, body); a transport failure (server died, timeout) is (None, "ExcName: text")."""
    try:
        return request_json("POST", url, body, timeout)
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def output_ids(result: dict) -> list[int]:
    assert result["prefill_status"] == 200, result
    assert result["decode_status"] == 200, result
    return result["decode"]["output_ids"]


# ---- through a router, and answers compared with the reference server -------------------------------------
def post_json(url: str, body: Any, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    return request_json("POST", url, body, timeout=timeout)


def stream_events(url: str, body: dict, *, timeout: float = REQUEST_TIMEOUT_S,
                  on_event: Callable[[Any], None] | None = None) -> tuple[int, list]:
    """POST a streaming request; (status, the SSE data payloads decoded, "[DONE]" kept as the string)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    events: list = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            for raw in resp:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                event = payload if payload == "[DONE]" else json.loads(payload)
                events.append(event)
                if on_event is not None:
                    on_event(event)
    except urllib.error.HTTPError as e:
        status, raw_body = e.code, e.read()
        e.close()
        return status, [json.loads(raw_body) if raw_body else None]
    return status, events


def fully_idle(url: str) -> bool:
    """Nothing running or waiting, and nothing in the PD queues (bootstrap, in flight, prealloc, transfer)."""
    for load in get_json(f"{url}/v1/loads")["loads"]:
        queues = load.get("disaggregation") or {}
        if load["num_running_reqs"] or load["num_waiting_reqs"]:
            return False
        if any(v for k, v in queues.items() if k.endswith("_queue_reqs")):
            return False
    return True


# meta_info fields that legitimately differ between two servers answering the same request (ids, timing, the
# state of the prefix cache), and fields that only exist on one side of a PD pair.
VOLATILE_META = frozenset({"id", "e2e_latency", "response_sent_to_client_ts", "cached_tokens",
                           "cached_tokens_details", "dp_rank"})


def generation_view(answer: dict) -> dict:
    """What must be identical between the router's answer and the reference server's: the tokens, text,
    finish reason, counts, logprobs, weight version."""
    meta = {k: v for k, v in answer["meta_info"].items() if k not in VOLATILE_META}
    return {"text": answer["text"], "output_ids": answer.get("output_ids"), "meta_info": meta}


def stream_view(events: list) -> dict:
    """A /generate stream reduced to what must match: its final event (how the tokens were cut into events
    depends on timing). Checks on the way that it ends with [DONE], each event's output_ids extend the last
    one's (0.5.23 streams them cumulatively) and only the last event has a finish reason."""
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    seen: list = []
    for i, chunk in enumerate(chunks):
        ids = chunk.get("output_ids") or []
        assert ids[: len(seen)] == seen and len(ids) >= len(seen), (seen, ids)
        seen = ids
        assert (chunk["meta_info"]["finish_reason"] is None) == (i < len(chunks) - 1), chunk["meta_info"]
    return generation_view(chunks[-1])


def openai_stream_view(events: list) -> dict:
    """An OpenAI stream reduced to what must match whatever the chunking: per choice the concatenated text
    (completions) or content (chat), the token logprobs in order, and the finish reason."""
    assert events and events[-1] == "[DONE]", events[-3:]
    view: dict = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            out = view.setdefault(choice["index"], {"text": "", "logprobs": [], "finish_reason": None})
            delta = choice.get("delta")
            out["text"] += (delta.get("content") or "") if delta is not None else choice.get("text", "")
            logprobs = choice.get("logprobs") or {}
            if "token_logprobs" in logprobs:
                out["logprobs"] += list(zip(logprobs["tokens"], logprobs["token_logprobs"]))
            for item in logprobs.get("content") or []:
                out["logprobs"].append((item["token"], item["logprob"]))
            if choice.get("finish_reason") is not None:
                assert out["finish_reason"] is None, "two finish reasons for one choice"
                out["finish_reason"] = choice["finish_reason"]
    return view
