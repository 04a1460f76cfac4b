"""--sglang-version: the endpoints and shapes of older servers, and the info endpoints of 0.5.23."""

from __future__ import annotations


from simulator.fleet import Fleet
from tests.sim_support import FAST, get, post


async def test_0_5_23_info_endpoints(session):
    async with Fleet(1, 1, **FAST) as f:
        p = f.prefill[0]
        for path in ("/health", "/health_generate", "/ready"):
            assert await get(session, p.url + path) == (200, "")
        status, info = await get(session, p.url + "/model_info")
        assert status == 200 and info["disaggregation_mode"] == "prefill" and info["weight_version"] == "default"
        assert (await get(session, p.url + "/get_model_info"))[1] == info
        status, server = await get(session, p.url + "/server_info")
        assert status == 200 and server["version"] == "0.5.23" and server["port"] == p.port
        assert server["disaggregation_bootstrap_port"] == p.bootstrap_port and len(server) > 500
        assert server["internal_states"][0]["disaggregation_mode"] == "prefill"
        status, loads = await get(session, p.url + "/v1/loads")
        assert status == 200 and loads["loads"][0]["disaggregation"]["mode"] == "prefill"
        assert await get(session, p.url + "/get_load") == (404, {"detail": "Not Found"})
        assert await get(session, p.url + "/metrics") == (404, {"detail": "Not Found"})
        assert await get(session, p.url + "/generate") == (405, {"detail": "Method Not Allowed"})


async def test_metrics_when_enabled(session):
    async with Fleet(0, 1, enable_metrics=True, **FAST) as f:
        async with session.get(f.decode[0].url + "/metrics") as r:
            text = await r.text()
        assert r.status == 200 and "sglang:num_running_reqs{" in text and "sglang:prompt_tokens_total{" in text


async def test_0_5_6(session):
    async with Fleet(0, 1, sglang_version="0.5.6", **FAST) as f:
        url = f.decode[0].url
        status, load = await get(session, url + "/get_load")
        assert status == 200 and load == [{"rid": None, "http_worker_ipc": None, "dp_rank": 0, "num_reqs": 0,
                                           "num_waiting_reqs": 0, "num_tokens": 0}]
        assert (await get(session, url + "/v1/loads"))[0] == 404
        status, info = await get(session, url + "/model_info")
        assert status == 200 and "disaggregation_mode" not in info
        assert await get(session, url + "/weight_version") == (200, {"weight_version": "default"})
        assert (await post(session, url + "/pause_generation", None))[0] == 400  # a body is required since 0.5.6
        assert (await post(session, url + "/pause_generation", {}))[0] == 200
        assert (await post(session, url + "/continue_generation", {}))[0] == 200
        assert (await post(session, url + "/pd_role_switch", {"new_role": "prefill"}))[0] == 404
        assert (await post(session, url + "/begin_weight_update", {}))[0] == 404


async def test_0_4_9(session):
    async with Fleet(0, 1, sglang_version="0.4.9", health_check_s=5.0, **{k: v for k, v in FAST.items()
                                                                          if k != "health_check_s"}) as f:
        url = f.decode[0].url
        assert await get(session, url + "/health") == (200, "")  # no probe request: answers at once
        assert await get(session, url + "/get_load") == (200, {"load": 0})
        for path in ("/server_info", "/model_info", "/v1/loads"):
            assert (await get(session, url + path))[0] == 404
        status, server = await get(session, url + "/get_server_info")
        assert status == 200 and server["version"] == "0.4.9"
        assert await post(session, url + "/pause_generation", None) == (
            200, {"message": "Generation paused successfully.", "status": "ok"})
        assert (await post(session, url + "/continue_generation", None))[0] == 200
        assert (await post(session, url + "/update_weight_version", {"new_version": "x"}))[0] == 404
