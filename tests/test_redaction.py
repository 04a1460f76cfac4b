"""No route returns a worker's keys, passwords or tokens.

SGLang 0.5.23's `/server_info` is its launch arguments, `api_key`, `admin_api_key` and
`ssl_keyfile_password` included, and `launch_command` repeats them as flags. The recorded answer of a real
server (tests/fixtures/real_sglang/info.json) is served with its key fields filled in, and every route of
the router, public and admin, is called with and without `--worker-api-key`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import orjson
import pytest

from router.api.access import routes_by_access
from router.core.redact import REDACTED, is_secret_name, redact, redact_text
from simulator.fleet import Fleet

from .helpers import wait_for
from .sim_support import FAST

FIXTURE = Path(__file__).parent / "fixtures" / "real_sglang" / "info.json"
SECRETS = {
    "api_key": "sk-worker-0001",
    "admin_api_key": "sk-admin-0002",
    "ssl_keyfile_password": "ssl-pass-0003",
}
NESTED_SECRETS = ("hf-token-0004", "s3-secret-0005", "url-pass-0006", "bearer-0007")


def recorded(path: str = "/server_info") -> dict:
    steps = json.loads(FIXTURE.read_text())["steps"]
    return next(s["json"] for s in steps if s["path"] == path and s["server"] == "prefill")


def with_secrets(info: dict) -> dict:
    """The recorded answer as a server launched with keys, a token and a password reports it."""
    filled = {**info, **SECRETS}
    filled["launch_command"] = (info["launch_command"] + f" --api-key {SECRETS['api_key']}"
                                f" --admin-api-key={SECRETS['admin_api_key']}"
                                f" --ssl-keyfile-password '{SECRETS['ssl_keyfile_password']}'")
    filled["model_loader_extra_config"] = {"hub": {"hf_token": NESTED_SECRETS[0]}, "revision": "main"}
    filled["hicache_storage_backend_extra_config"] = json.dumps({"bucket": "kv", "secret_key": NESTED_SECRETS[1]})
    filled["dist_init_addr"] = f"tcp://trainer:{NESTED_SECRETS[2]}@10.0.0.5:5000"
    filled["internal_states"] = [{**state, **SECRETS, "lora_paths": [{"name": "a", "access_token": NESTED_SECRETS[3]}]}
                                 for state in info["internal_states"]]
    return filled


ALL_SECRETS = (*SECRETS.values(), *NESTED_SECRETS)


def leaked(text: str) -> list[str]:
    return [s for s in ALL_SECRETS if s in text]


# ---- the function ------------------------------------------------------------------------------------------
def test_redaction_leaves_every_recorded_real_answer_unchanged():
    """No false positive on the ~600 real fields (max_total_tokens, tokenizer_path, per_token, ...)."""
    steps = [s for s in json.loads(FIXTURE.read_text())["steps"] if "json" in s]
    assert len(steps) > 10
    for step in steps:
        assert redact(step["json"]) == step["json"], step["label"]


def test_redaction_hides_every_secret_of_a_real_server_info_and_only_those():
    info = with_secrets(recorded())
    out = redact(info)
    assert not leaked(orjson.dumps(out).decode())
    changed = sorted(k for k in info if out[k] != info[k])
    assert changed == sorted([*SECRETS, "launch_command", "model_loader_extra_config",
                              "hicache_storage_backend_extra_config", "dist_init_addr", "internal_states"])
    assert all(out[k] == REDACTED for k in SECRETS)
    assert out["launch_command"].endswith(f"--api-key {REDACTED} --admin-api-key={REDACTED} "
                                          f"--ssl-keyfile-password '{REDACTED}'")
    assert out["launch_command"].startswith(info["launch_command"].split(" --api-key")[0])
    assert out["model_loader_extra_config"] == {"hub": {"hf_token": REDACTED}, "revision": "main"}
    assert out["internal_states"][0]["lora_paths"] == [{"name": "a", "access_token": REDACTED}]
    assert out["internal_states"][0]["max_total_tokens"] == info["internal_states"][0]["max_total_tokens"]
    assert info["api_key"] == SECRETS["api_key"]  # a copy: the server's answer is not changed in place


@pytest.mark.parametrize("name,secret", [
    ("api_key", True), ("admin_api_key", True), ("ssl_keyfile_password", True), ("hf_token", True),
    ("HF_TOKEN", True), ("accessToken", True), ("watermark_key_b", True), ("aws_secret_access_key", True),
    ("token", True), ("Authorization", True),
    ("ssl_keyfile", False), ("max_total_tokens", False), ("kt_max_deferred_experts_per_token", False),
    ("bucket_time_to_first_token", False), ("speculative_token_map", False), ("tokenizer_path", False),
    ("KeyError", False), ("num_reserved_decode_tokens", False),
])
def test_secret_names(name, secret):
    assert is_secret_name(name) is secret


@pytest.mark.parametrize("text,expected", [
    ("--port 1 --api-key sk-1 --host h", f"--port 1 --api-key {REDACTED} --host h"),
    ("--admin-api-key=sk-2", f"--admin-api-key={REDACTED}"),
    ("ServerArgs(api_key='sk-3', port=1)", f"ServerArgs(api_key='{REDACTED}', port=1)"),
    ('{"hf_token": "hf-4", "admin_api_key": null}', f'{{"hf_token": "{REDACTED}", "admin_api_key": null}}'),
    ("http://user:pw-5@host:1/path", f"http://user:{REDACTED}@host:1/path"),
    ("sent Authorization: Bearer tok-6 to it", f"sent Authorization: {REDACTED} to it"),
    ("bad header 'Bearer tok-7'", f"bad header 'Bearer {REDACTED}'"),
    ("?token=t-8&timeout=3", f"?token={REDACTED}&timeout=3"),
    ("KeyError: 'model_path'", "KeyError: 'model_path'"),
    ("api_key: None", "api_key: None"),
    ("the non-key value --disable-radix-cache --port 3", "the non-key value --disable-radix-cache --port 3"),
])
def test_redacted_text(text, expected):
    assert redact_text(text) == expected


# ---- every route -------------------------------------------------------------------------------------------
def concrete(path: str, worker_id: str) -> str:
    return re.sub(r"\{[^}]+\}", worker_id, path)


@pytest.mark.parametrize("worker_key", [None, "router-to-worker-key"])
async def test_no_route_returns_a_worker_secret(fake_fleet, make_router, caplog, worker_key):
    caplog.set_level(logging.DEBUG)
    p, d, d2 = await fake_fleet(1, 2)
    for fake in (p, d, d2):
        fake.server_args = {k: v for k, v in with_secrets(recorded()).items() if k != "internal_states"}
        fake.message_suffix = f" (launched with --api-key {SECRETS['api_key']})"
    client = await make_router([p], [d, d2], worker_api_key=worker_key)
    await wait_for(lambda: all(w.weight_version for w in client.registry.workers()), message="facts learnt")
    decode = client.registry.workers()[1]

    bodies: dict[tuple[str, str], str] = {}
    # Calls whose answers carry what the servers said: a refused flush, a failed and a successful
    # conversion (their records and per-step messages), the fleet listing.
    d.in_handler = 1
    resp = await client.post("/flush_cache")
    bodies[("POST", "/flush_cache busy")] = await resp.text()
    d.in_handler = 0
    assert resp.status == 400 and "launched with --api-key" in bodies[("POST", "/flush_cache busy")]
    d.switch_fault = "safe"
    resp = await client.post(f"/admin/workers/{decode.id}/convert", json={"new_role": "prefill"})
    bodies[("POST", "convert refused")] = await resp.text()
    d.switch_fault = None
    assert resp.status == 502 and "injected refusal" in bodies[("POST", "convert refused")]
    resp = await client.post("/pd_role_switch", json={"worker_url": d.url, "new_role": "prefill"})
    bodies[("POST", "/pd_role_switch")] = await resp.text()
    assert resp.status == 200, bodies[("POST", "/pd_role_switch")]

    # Every GET route the app has, public and admin, but the actions SGLang also takes as GET (memory
    # release, cache flush: they change the fleet).
    routes = {r for access_routes in routes_by_access(client.app).values() for r in access_routes}
    gets = sorted((m, p) for m, p in routes if m == "GET" and ("POST", p) not in routes)
    assert {("GET", p) for p in ("/server_info", "/get_server_info", "/model_info", "/get_model_info",
                                 "/v1/models")} <= set(gets)
    for method, path in gets:
        resp = await client.request(method, concrete(path, decode.id))
        bodies[(method, path)] = await resp.text()
        assert resp.status < 500 or path == "/health_generate", (path, resp.status, bodies[(method, path)])
    info = json.loads(bodies[("GET", "/server_info")])
    assert info["prefill"][0]["api_key"] == REDACTED and info["decode"][0]["tp_size"] == 1

    assert {where: leaked(text) for where, text in bodies.items() if leaked(text)} == {}
    assert not leaked(caplog.text)


async def test_simulated_server_with_api_key_keeps_its_key_behind_the_router(make_router, session):
    """The simulator reports its --api-key in /server_info as SGLang does; the router does not pass it on."""
    key = "sim-worker-key-0008"
    async with Fleet(prefill=1, decode=1, api_key=key, **FAST) as fleet:
        async with session.get(fleet.decode[0].url + "/server_info",
                               headers={"Authorization": f"Bearer {key}"}) as resp:
            direct = await resp.json()
        assert direct["api_key"] == key and f"--api-key {key}" in direct["launch_command"]
        client = await make_router(fleet.prefill, fleet.decode, worker_api_key=key)
        for path in ("/server_info", "/get_server_info", "/model_info", "/v1/models"):
            resp = await client.get(path)
            text = await resp.text()
            assert resp.status == 200 and key not in text, (path, text[:300])
        info = await (await client.get("/server_info")).json()
        assert info["decode"][0]["api_key"] == REDACTED
        assert f"--api-key {REDACTED}" in info["decode"][0]["launch_command"]
