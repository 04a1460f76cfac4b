"""Worker registration: sgl-router's API, mini_lb's /register, bootstrap port discovery."""

from __future__ import annotations

import pytest

from router.core.registry import Role, WorkerState

from .helpers import wait_for


async def test_prefill_bootstrap_port_learnt_from_server_info(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    p.bootstrap_port = 12345
    client = await make_router([p], [d], discover=True)
    (worker,) = client.registry.workers(Role.PREFILL)
    assert worker.bootstrap_port == 12345 and worker.state is WorkerState.ACTIVE
    await client.post("/generate", json={"text": "x"})
    assert p.bodies()[0]["bootstrap_port"] == 12345


async def test_prefill_without_reported_port_falls_back_to_null(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    p.bootstrap_port = None
    client = await make_router([p], [d], discover=True)
    (worker,) = client.registry.workers(Role.PREFILL)
    assert worker.bootstrap_port is None and worker.state is WorkerState.ACTIVE
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 200 and p.bodies()[0]["bootstrap_port"] is None


async def test_unreachable_prefill_stays_pending_until_it_answers(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    await p.stop()
    from router.core.config import HealthConfig
    client = await make_router([p], [d], discover=True, worker_startup_timeout_secs=0.2,
                               health=HealthConfig(interval_secs=0.05))
    (worker,) = client.registry.workers(Role.PREFILL)
    assert worker.state is WorkerState.PENDING
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 503


async def test_workers_crud(sim_workers, make_router):
    p, p2, d = await sim_workers(2, 1)
    client = await make_router([p], [d])
    resp = await client.post("/workers", json={"url": p2.url, "worker_type": "prefill", "bootstrap_port": 7001})
    assert resp.status == 200, await resp.text()
    added = await resp.json()
    listing = await (await client.get("/workers")).json()
    assert listing["total"] == 3 and listing["stats"]["prefill_count"] == 2
    entry = next(w for w in listing["workers"] if w["url"] == p2.url)
    for key in ("id", "url", "worker_type", "is_healthy", "load", "bootstrap_port", "state", "inflight"):
        assert key in entry
    assert entry["bootstrap_port"] == 7001 and entry["worker_type"] == "prefill" and entry["state"] == "active"
    resp = await client.post("/workers", json={"url": p2.url, "worker_type": "prefill", "bootstrap_port": 7001})
    assert resp.status == 409
    resp = await client.delete(f"/workers/{added['worker_id']}")
    assert resp.status == 200
    assert (await (await client.get("/workers")).json())["total"] == 2
    assert (await client.delete(f"/workers/{added['worker_id']}")).status == 404


async def test_worker_role_asked_from_server_when_not_given(sim_workers, make_router):
    p, d, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d])
    resp = await client.post("/workers", json={"url": d2.url})
    assert resp.status == 200
    assert client.registry.get(d2.url).role is Role.DECODE


async def test_legacy_add_remove_list(sim_workers, make_router):
    p, d, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d])
    assert (await client.post(f"/add_worker?url={d2.url}&worker_type=decode")).status == 200
    urls = (await (await client.get("/list_workers")).json())["urls"]
    assert d2.url in urls
    assert (await client.post(f"/remove_worker?url={d2.url}")).status == 200
    assert d2.url not in (await (await client.get("/list_workers")).json())["urls"]


async def test_legacy_remove_of_a_url_that_is_no_worker_is_404_naming_it(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    for url in ("http://10.9.9.9:30000", p.url + "1", "w99"):
        resp = await client.post("/remove_worker", params={"url": url})
        assert resp.status == 404
        assert url in (await resp.json())["error"]["message"]
    assert {w.url for w in client.registry.workers()} == {p.url, d.url}


async def test_register_mini_lb(sim_workers, make_router):
    p, p2, d, d2 = await sim_workers(2, 2)
    client = await make_router([p], [d])
    resp = await client.post("/register", json={"mode": "prefill", "registry_url": p2.url, "bootstrap_port": 8100})
    assert resp.status == 200
    assert client.registry.get(p2.url).bootstrap_port == 8100
    resp = await client.post("/register", json={"mode": "decode", "registry_url": d2.url, "bootstrap_port": None})
    assert resp.status == 200 and client.registry.get(d2.url).role is Role.DECODE


@pytest.mark.parametrize("path,body,fragment", [
    ("/workers", {"url": "ftp://x:1", "worker_type": "prefill"}, "scheme"),
    ("/workers", {"url": "http://127.0.0.1:9", "worker_type": "regular"}, "pairs only"),
    ("/workers", {"url": "http://127.0.0.1:9", "worker_type": "bogus"}, "worker_type"),
    ("/workers", {"url": "http://127.0.0.1:9", "worker_type": "prefill", "bootstrap_port": "x"}, "bootstrap_port"),
    ("/workers", {"worker_type": "decode"}, "url"),
    ("/register", {"mode": "prefill", "registry_url": "http://127.0.0.1:9", "bootstrap_port": None}, "required"),
    ("/register", {"mode": "decode", "registry_url": "http://127.0.0.1:9", "bootstrap_port": 1}, "should not"),
    ("/register", {"mode": "both", "registry_url": "http://127.0.0.1:9"}, "Invalid mode"),
])
async def test_bad_registrations_are_400(sim_workers, make_router, path, body, fragment):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert fragment in (await resp.json())["error"]["message"]
    assert len(client.registry) == 2


async def test_malformed_json_to_admin_is_400(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/workers", data=b"{oops", headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]


async def test_unknown_route_is_json_404(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.get("/nope")
    assert resp.status == 404 and "error" in await resp.json()


async def test_facts_learnt_for_workers_given_with_ports(sim_workers, make_router):
    p, d = await sim_workers(1, 1, weight_version="v7")
    client = await make_router([p], [d])
    from .helpers import wait_for
    await wait_for(lambda: all(w.weight_version == "v7" for w in client.registry.workers()),
                   message="weight version learnt from /server_info")


# ---- one worker-entry body, one set of rules (router/core/worker_entry.py) ---------------------------------
BAD_ENTRIES = [
    ({"url": "http://127.0.0.1:9", "worker_type": "decode", "boostrap_port": 1}, "boostrap_port"),  # misspelt
    ({"url": "http://127.0.0.1:9", "worker_type": "decode", "priority": "high"}, "priority"),  # a peer field, mistyped
    ({"url": "http://127.0.0.1:9", "worker_type": "prefill", "role": "decode"}, "disagree"),
    ({"url": "http://127.0.0.1:9", "worker_type": "prefill", "bootstrap_port": 0}, "bootstrap_port"),
    ({"url": "http://127.0.0.1", "worker_type": "decode"}, "no port"),
]


@pytest.mark.parametrize("entry,says", BAD_ENTRIES)
async def test_an_entry_refused_by_the_discovery_file_is_refused_by_every_way_in(sim_workers, make_router, entry,
                                                                                   says):
    """The discovery file, an etcd key's value, POST /workers and POST /add_worker read one model: what one
    refuses (an unknown field among them: never silently dropped), every one refuses, saying why; nothing is
    registered."""
    from router.control.worker_sources import ListingError, parse_listing

    with pytest.raises(ListingError) as refused:
        parse_listing(entry, "workers[0]")
    assert says in str(refused.value)
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    for path, kw in (("/workers", {"json": entry}), ("/add_worker", {"params": {k: str(v) for k, v in entry.items()}})):
        resp = await client.post(path, **kw)
        error = (await resp.json())["error"]
        assert resp.status == 400 and says in error["message"], (path, error)
        if says in entry:  # an unknown field is the error's param
            assert error["param"] == says, (path, error)
    assert len(client.registry) == 2


async def test_register_refuses_fields_mini_lb_does_not_send(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/register", json={"mode": "decode", "registry_url": "http://127.0.0.1:9",
                                                "bootstrap_port": None, "worker_type": "decode"})
    error = (await resp.json())["error"]
    assert resp.status == 400 and "unknown field 'worker_type'" in error["message"] and error["param"] == "worker_type"
    assert "known: bootstrap_port, mode, registry_url" in error["message"]
    assert len(client.registry) == 2
