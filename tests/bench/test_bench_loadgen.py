"""bench.loadgen against in-process servers: counts, TTFT, errors, and the router-less PD baseline."""

import orjson
from aiohttp import web

from bench.loadgen import DirectPD, run_load


def sglang_like(seen: list[dict], *, status: int = 200):
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if status != 200:
            return web.json_response({"error": {"message": "boom"}}, status=status)
        if not body.get("stream"):
            return web.json_response({"text": "hi", "meta_info": {"id": "x"}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(b"data: " + orjson.dumps({"text": "hi" * (i + 1)}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


async def test_non_streaming_load_counts_every_answer(aiohttp_server):
    seen: list[dict] = []
    server = await aiohttp_server(sglang_like(seen))
    result = await run_load(url=str(server.make_url("/generate")), concurrency=4, duration=0.5, warmup=0.1,
                            stream=False)
    assert result["errors"] == 0
    assert result["requests"] > 0 and result["rps"] > 0
    assert result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert "ttft_p50_ms" not in result
    assert len(seen) >= result["requests"]  # warm-up and in-flight requests are sent but not counted
    assert len(seen) >= result["answered"] >= result["requests"] > 0  # answered: all of them, whenever
    assert seen[0]["sampling_params"]["max_new_tokens"] == 16


async def test_streaming_load_measures_time_to_first_token(aiohttp_server):
    server = await aiohttp_server(sglang_like([]))
    result = await run_load(url=str(server.make_url("/generate")), concurrency=2, duration=0.5, warmup=0.1,
                            stream=True)
    assert result["errors"] == 0 and result["requests"] > 0
    assert 0 < result["ttft_p50_ms"] <= result["p50_ms"]


async def test_failed_answers_are_errors_not_latencies(aiohttp_server):
    server = await aiohttp_server(sglang_like([], status=500))
    result = await run_load(url=str(server.make_url("/generate")), concurrency=2, duration=0.3, warmup=0.0,
                            stream=False)
    assert result["errors"] == result["requests"] > 0
    assert result["error_kinds"] == {"http 500": result["errors"]}
    assert result["p50_ms"] is None and result["rps"] == 0


async def test_direct_pd_sends_both_legs_with_bootstrap_fields(aiohttp_server):
    p_seen, d_seen = [], []
    prefill = await aiohttp_server(sglang_like(p_seen))
    decode = await aiohttp_server(sglang_like(d_seen))
    direct = DirectPD([(str(prefill.make_url("")).rstrip("/"), 8998)], [str(decode.make_url("")).rstrip("/")])
    result = await run_load(url="", concurrency=2, duration=0.3, warmup=0.0, stream=False, direct=direct)
    assert result["errors"] == 0 and result["requests"] > 0
    assert len(p_seen) == len(d_seen)
    for p_body, d_body in zip(sorted(p_seen, key=lambda b: b["bootstrap_room"]),
                              sorted(d_seen, key=lambda b: b["bootstrap_room"])):
        assert p_body == d_body
        assert (p_body["bootstrap_host"], p_body["bootstrap_port"]) == ("127.0.0.1", 8998)
    assert len({b["bootstrap_room"] for b in p_seen}) == len(p_seen)
