"""`python -m bench.routers` end to end on the ceiling setup, with a stand-in router from a scratch checkout."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from bench.contenders import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("nginx", path="/usr/sbin:/usr/bin") is None,
                                reason="nginx and wrk not installed (python -m bench.setup)")

# Takes mini_lb's flags and relays /generate to the first decode server: enough to be measured.
STAND_IN_ROUTER = textwrap.dedent('''
    import argparse
    import aiohttp
    from aiohttp import web

    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", nargs="+", action="append")
    parser.add_argument("--decode", action="append")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--policy")
    args = parser.parse_args()

    async def session_ctx(app):
        app["session"] = aiohttp.ClientSession()
        yield
        await app["session"].close()

    async def generate(request):
        async with request.app["session"].post(args.decode[0] + "/generate", data=await request.read(),
                                               headers={"Content-Type": "application/json"}) as upstream:
            return web.Response(body=await upstream.read(), status=upstream.status,
                                content_type="application/json")

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/generate", generate)
    web.run_app(app, host=args.host, port=args.port, print=None)
''')


def test_ceiling_run_measures_baseline_and_router(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "router").mkdir(parents=True)
    (checkout / "router" / "__main__.py").write_text(STAND_IN_ROUTER)
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.routers", "--setup", "ceiling", "--routers", "pd-router",
         "--pd-router-checkout", str(checkout), "--concurrency", "4", "--duration", "1", "--warmup", "0",
         "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = orjson.loads(out.read_text())
    best = {row["router"]: row for row in result["best"]}
    assert set(best) == {"direct", "pd-router"}
    assert best["pd-router"]["errors"] == 0 and best["pd-router"]["rps"] > 0
    assert best["pd-router"]["router_cpu_ms_per_req"] > 0
    assert "added_p50_ms" in best["pd-router"]
    assert "pd-router" in done.stdout and "req/s" in done.stdout
