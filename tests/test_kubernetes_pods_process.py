"""--service-discovery on a real pd-router process: killed (SIGKILL) and started again, it finds the same pods'
workers in the same pools from the API server alone (it keeps no state of its own), a converted pod in the pool
of its server's live role rather than its labels', and what changed while it was down."""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp

from .helpers import wait_for
from .router_process import RouterProcess, generate
from .test_kubernetes_pods import cluster  # noqa: F401: the stand-in and the pods' servers (a fixture)


async def test_a_restarted_router_serves_the_same_pods_in_their_live_pools(cluster, tmp_path):  # noqa: F811
    p0 = await cluster.add("p0", "prefill", 1)
    p1 = await cluster.add("p1", "prefill", 2)
    d0 = await cluster.add("d0", "decode", 3)
    no_workers = SimpleNamespace(prefill=[], decode=[])  # every worker comes from the pods
    flags = ["--service-discovery", "--prefill-selector", "app=sglang-prefill", "--decode-selector",
             "app=sglang-decode", "--service-discovery-port", str(cluster.port), "--service-discovery-namespace",
             "llm", "--health-check-interval-secs", "0.2"]
    async with RouterProcess(no_workers, *flags, log_path=tmp_path / "router.log") as router, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def pools() -> dict[str, set[str]]:
            async with http.get(router.url + "/workers") as resp:
                found = (await resp.json())["workers"]
            return {role: {w["url"] for w in found if w["role"] == role and w["routable"]}
                    for role in ("prefill", "decode")}

        async def serving(expected: dict[str, set[str]]) -> bool:
            return await pools() == expected

        async def a_request_goes_through() -> None:
            seen = await generate(http, router.url, "r", 2, stream=False)
            assert seen["status"] == 200 and seen["finish"] == "length", seen

        await wait_for(lambda: serving({"prefill": {p0, p1}, "decode": {d0}}), timeout=20, message="the pods")
        async with http.get(router.url + "/workers") as resp:
            worker = next(w for w in (await resp.json())["workers"] if w["url"] == p1)
        async with http.post(router.url + f"/admin/workers/{worker['id']}/convert", json={"timeout_s": 30}) as resp:
            assert resp.status == 200, await resp.text()
        after = {"prefill": {p0}, "decode": {d0, p1}}  # p1's labels still say prefill
        await wait_for(lambda: serving(after), timeout=20, message="p1 converted to decode")
        await a_request_goes_through()

        await router.kill()
        d1 = await cluster.add("d1", "decode", 4)  # while no router runs
        await router.start()
        after["decode"].add(d1)
        await wait_for(lambda: serving(after), timeout=20, message="the same pods, p1 in its live pool, and d1")
        await a_request_goes_through()
