"""Small synchronous HTTP helpers for talking to real SGLang servers in tests (stdlib only)."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

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
    """Poll predicate until true; at the deadline fail with `what` (a string, or a callable for late detail)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what() if callable(what) else what}")
        time.sleep(interval)


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
