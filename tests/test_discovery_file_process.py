"""--discovery-file on a real pd-router process in front of a simulated 2P+2D fleet: the file changes (atomic
renames, a malformed version) while requests run, and none of them fails."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import orjson

from simulator.fleet import Fleet

from .helpers import wait_for
from .router_process import RouterProcess, generate
from .sim_support import FAST


def write_atomically(path: Path, workers: list) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(orjson.dumps({"workers": workers}))
    os.replace(tmp, path)


def entries(fleet: Fleet, p: list[int], d: list[int]) -> list:
    return ([{"url": fleet.prefill[i].url, "worker_type": "prefill", "bootstrap_port": fleet.prefill[i].bootstrap_port}
             for i in p] + [{"url": fleet.decode[i].url, "worker_type": "decode"} for i in d])


async def test_a_file_changing_under_load_moves_the_fleet_without_failing_a_request(tmp_path):
    path = tmp_path / "workers.json"
    async with Fleet(2, 2, **FAST) as fleet:
        write_atomically(path, entries(fleet, [0], [0]))
        no_flags = SimpleNamespace(prefill=[], decode=[])  # every worker comes from the file
        async with RouterProcess(no_flags, "--discovery-file", str(path), "--discovery-file-interval-secs", "0.1",
                                 log_path=tmp_path / "router.log") as router, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as clients:

            async def workers() -> dict[str, dict]:
                async with clients.get(router.url + "/workers") as resp:
                    return {w["url"]: w for w in (await resp.json())["workers"]}

            async def routable(urls: set[str]) -> bool:
                found = await workers()
                return set(found) == urls and all(w["routable"] for w in found.values())

            async def discovery() -> dict:
                async with clients.get(router.url + "/admin/discovery") as resp:
                    return (await resp.json())["sources"][0]

            assert set(await workers()) == {fleet.prefill[0].url, fleet.decode[0].url}
            stop = asyncio.Event()
            seen: list[dict] = []

            async def client_loop(n: int) -> None:
                i = 0
                while not stop.is_set():
                    seen.append(await generate(clients, router.url, f"c{n}-{i}", 4, stream=bool(i % 2)))
                    i += 1

            loops = [asyncio.ensure_future(client_loop(n)) for n in range(4)]
            await wait_for(lambda: len(seen) >= 10, timeout=10)

            everyone = {h.url for h in fleet.workers}
            write_atomically(path, entries(fleet, [0, 1], [0, 1]))
            await wait_for(lambda: routable(everyone), timeout=10, message="p1 and d1 added")

            path.write_text('{"workers": [{"url": "http://127.0.0.1:1", "worker_type": "mixed"}]}')
            await wait_for(lambda: discovery(), timeout=10)  # the router answers while refusing it

            async def refused() -> bool:
                return (await discovery())["error"] is not None

            await wait_for(refused, timeout=10, message="the malformed version refused")
            assert await routable(everyone)

            write_atomically(path, entries(fleet, [1], [1]))
            await wait_for(lambda: routable({fleet.prefill[1].url, fleet.decode[1].url}), timeout=10,
                           message="p0 and d0 removed")
            moved_at = len(seen)
            await wait_for(lambda: len(seen) >= moved_at + 10, timeout=10)
            stop.set()
            await asyncio.gather(*loops)

            failed = [s for s in seen if s["status"] != 200 or "error" in s]
            assert not failed, failed[:5]
            assert (await discovery())["error"] is None
            served = {url: w["requests_total"] for url, w in (await workers()).items()}
            assert all(count > 0 for count in served.values()), served
        assert "refused" in router.log()


async def test_smgs_command_line_and_manifest_serve(tmp_path):
    """SMG users' file discovery as they run it: `--discovery-provider file --discovery-file F` and nothing
    else naming a worker, F the manifest SMG 1.13 reads (`version: 1`, entries with `id`)."""
    path = tmp_path / "manifest.json"
    async with Fleet(1, 1, **FAST) as fleet:
        manifest = {"version": 1, "workers": [
            {"id": f"w{i}", **entry} for i, entry in enumerate(entries(fleet, [0], [0]))]}
        path.write_bytes(orjson.dumps(manifest))
        no_flags = SimpleNamespace(prefill=[], decode=[])
        async with RouterProcess(no_flags, "--discovery-provider", "file", "--discovery-file", str(path),
                                 "--discovery-check-interval-secs", "1", log_path=tmp_path / "router.log") as router, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as clients:
            answer = await generate(clients, router.url, "smg", 4, stream=False)
            assert answer["status"] == 200 and "error" not in answer, answer
            async with clients.get(router.url + "/admin/discovery") as resp:
                (source,) = (await resp.json())["sources"]
            assert source["error"] is None and source["registered"] == 2
