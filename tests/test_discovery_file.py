"""--discovery-file: a real file changing under a running router (the in-process app) in front of fake servers.

Every change is written the way operators and Kubernetes write it (a new file renamed over the old one),
except where a test says otherwise; the router is waited on (its registry, GET /admin/discovery), never slept.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import pytest

from router.control.discovery_file import parse_worker_file
from router.control.worker_sources import Listing, ListingError
from router.core.config import DISCOVER, HealthConfig, RouterConfig, WorkerSourcesConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.core.registry import Role, WorkerState
from router.server.app import create_app

from .helpers import wait_for

POLL = 0.05


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def yaml_of(*entries: str) -> str:
    return "workers:\n" + "".join(f"  - {entry}\n" for entry in entries) if entries else "workers: []\n"


def prefill(worker, port: int | None = None) -> str:
    return f"{{url: {worker.url}, worker_type: prefill, bootstrap_port: {port or worker.bootstrap_port}}}"


def decode(worker) -> str:
    return f"{{url: {worker.url}, worker_type: decode}}"


@pytest.fixture
async def router_with_file(aiohttp_client, tmp_path):
    path = tmp_path / "workers.yaml"

    async def build(text: str | None, prefills=(), decodes=(), **overrides):
        if text is not None:
            write_atomically(path, text)
        config = RouterConfig(
            prefill=tuple(WorkerSpec(w.url, w.bootstrap_port) for w in prefills),
            decode=tuple(WorkerSpec(w.url) for w in decodes),
            worker_sources=WorkerSourcesConfig(file=str(path), file_interval_secs=POLL),
            health=HealthConfig(interval_secs=0.2),
            **overrides,
        ).validated()
        client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        client.registry = client.app[REGISTRY]
        client.path = path
        return client

    return build


async def discovery_of(client) -> dict:
    resp = await client.get("/admin/discovery")
    assert resp.status == 200
    (source,) = (await resp.json())["sources"]
    return source


def urls(client, role: Role | None = None) -> set[str]:
    return {w.url for w in client.registry.workers(role)}


async def generate(client) -> dict:
    resp = await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status == 200, await resp.text()
    return await resp.json()


# ---- the file's format ----------------------------------------------------------------------------------
def test_an_entry_is_the_worker_api_body_or_a_bare_url():
    listing = parse_worker_file(b"""
workers:
  - {url: "http://p1:30000/", worker_type: prefill, bootstrap_port: 8998}
  - {url: "http://p2:30000", role: prefill, bootstrap_port: null}
  - {url: "http://d1:30000", worker_type: decode}
  - http://x:30000
""", "w.yaml")
    assert listing == {
        "http://p1:30000": Listing("http://p1:30000", Role.PREFILL, 8998),
        "http://p2:30000": Listing("http://p2:30000", Role.PREFILL, None),
        "http://d1:30000": Listing("http://d1:30000", Role.DECODE, DISCOVER),
        "http://x:30000": Listing("http://x:30000", None, DISCOVER),
    }


def test_json_and_a_bare_list_read_the_same():
    entries = [{"url": "http://p1:30000", "worker_type": "prefill", "bootstrap_port": 8998}, "http://d1:30000"]
    as_json = parse_worker_file(orjson.dumps(entries), "w.json")
    assert as_json == parse_worker_file(orjson.dumps({"workers": entries}), "w.yaml")
    assert set(as_json) == {"http://p1:30000", "http://d1:30000"}
    assert parse_worker_file(b"workers: []", "w.yaml") == {}


def test_smgs_manifest_reads_as_the_same_workers():
    """SMG 1.13's `--discovery-provider file` manifest (what its own tests write): `version: 1` beside `workers`,
    entries naming themselves with `id`."""
    entries = [{"id": "p1", "url": "http://p1:30000", "worker_type": "prefill", "bootstrap_port": 8998,
                "model_id": "m", "kv_connector": "mooncake", "kv_role": "kv_producer", "kv_engine_id": "e1"},
               {"id": "d1", "url": "http://d1:30000", "worker_type": "decode"}]
    manifest = parse_worker_file(orjson.dumps({"version": 1, "workers": entries}), "w.json")
    assert manifest == {"http://p1:30000": Listing("http://p1:30000", Role.PREFILL, 8998),
                        "http://d1:30000": Listing("http://d1:30000", Role.DECODE, DISCOVER)}
    assert parse_worker_file(b"version: 1\nworkers: []\n", "w.yaml") == {}


@pytest.mark.parametrize("version", [2, 0, "1", True, None])
def test_another_manifest_version_is_refused_naming_it(version):
    with pytest.raises(ListingError) as caught:
        parse_worker_file(orjson.dumps({"version": version, "workers": []}), "w.json")
    assert f"unsupported manifest version {version!r}" in str(caught.value)
    assert "version 1" in str(caught.value)


@pytest.mark.parametrize("text, says", [
    ("", "empty"),
    ("   \n", "empty"),
    ("workers:\n", "expected `workers:` with a list"),
    ("workers: [http://a:1\n", "not valid YAML"),
    ('{"workers": [', "not valid JSON"),
    ("servers: []", "unknown top-level key(s) servers"),
    ("workers: [{url: 'http://a:1', worker_type: regular}]", "must be 'prefill' or 'decode'"),
    ("workers: [{url: 'http://a:1', worker_type: prefill, role: decode}]", "disagree"),
    ("workers: [{url: 'http://a:1', boostrap_port: 1}]", "unknown field 'boostrap_port'"),
    ("workers: [{url: 'http://a:1', bootstrap_port: 70000}]", "bootstrap_port must be an integer"),
    ("workers: [{url: 'http://a'}]", "no port"),
    ("workers: [ftp://a:1]", "scheme must be http"),
    ("workers: [7]", "expected a URL or an object"),
    ("workers: [http://a:1, 'http://a:1/']", "listed twice"),
    ('{"version": 1, "workers": [{"id": 5, "url": "http://a:1"}]}', "unknown field 'id'"),
    ('{"version": 1, "workers": [], "x": 1}', "unknown top-level key(s) x"),
])
def test_a_bad_file_is_refused_whole_saying_why(text, says):
    path = "w.json" if text.startswith("{") else "w.yaml"
    with pytest.raises(ListingError) as caught:
        parse_worker_file(text.encode(), path)
    assert says in str(caught.value)


def test_every_bad_entry_is_reported_at_once():
    with pytest.raises(ListingError) as caught:
        parse_worker_file(b"workers: [{url: 'http://a'}, {url: 'http://b:1', worker_type: x}]", "w.yaml")
    assert [p.split(":")[0] for p in caught.value.problems] == ["workers[0]", "workers[1]"]


# ---- a running router -----------------------------------------------------------------------------------
async def test_the_files_workers_are_read_before_the_router_serves(sim_workers, router_with_file):
    p1, d1 = await sim_workers(prefill=1, decode=1)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1)))
    source = f"file {client.path}"
    workers = {w.url: w for w in client.registry.workers()}
    assert set(workers) == {p1.url, d1.url}
    assert all(w.state is WorkerState.ACTIVE and w.routable and w.source == source for w in workers.values())
    assert (await client.get("/health")).status == 200
    await generate(client)
    assert len(p1.bodies()) == len(d1.bodies()) == 1
    status = await discovery_of(client)
    assert status["kind"] == "file" and status["error"] is None
    assert status["listed"] == status["registered"] == 2
    assert {(w["url"], w["status"]) for w in status["workers"]} == {(p1.url, "registered"), (d1.url, "registered")}


async def test_workers_added_to_and_removed_from_the_file_follow_it(sim_workers, router_with_file):
    p1, p2, d1, d2 = await sim_workers(prefill=2, decode=2)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1)))
    # p2 as a bare URL: its role and bootstrap port are read from the server
    write_atomically(client.path, yaml_of(prefill(p1), p2.url, decode(d2)))
    await wait_for(lambda: urls(client) == {p1.url, p2.url, d2.url}, message="the file's new version applied")
    workers = {w.url: w for w in client.registry.workers()}
    await wait_for(lambda: workers[p2.url].routable and workers[d2.url].routable)
    assert workers[p2.url].role is Role.PREFILL and workers[p2.url].bootstrap_port == p2.bootstrap_port
    for _ in range(4):
        await generate(client)
    assert len(d1.bodies()) == 0 and len(d2.bodies()) == 4
    write_atomically(client.path, yaml_of(decode(d2)))
    await wait_for(lambda: urls(client) == {d2.url})
    assert (await client.get("/health")).status == 503  # no prefill left
    write_atomically(client.path, yaml_of())
    await wait_for(lambda: urls(client) == set())
    assert (await discovery_of(client))["workers"] == []


async def test_a_bad_version_changes_nothing_and_is_shown_until_a_good_one(sim_workers, router_with_file):
    p1, p2, d1 = await sim_workers(prefill=2, decode=1)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1)))
    before = {w.url: w for w in client.registry.workers()}
    bad_versions = [
        ("workers:\n  - {url: http://127.0.0.1:1, worker_type: regular}\n", "must be 'prefill' or 'decode'"),
        ("workers: [" + prefill(p2), "not valid YAML"),
        ("", "empty"),
    ]
    for text, says in bad_versions:
        write_atomically(client.path, text)

        async def refused() -> bool:
            error = (await discovery_of(client))["error"]
            return error is not None and says in error

        await wait_for(refused, message=f"the router to refuse {text!r}")
        assert {w.url: w for w in client.registry.workers()} == before
        assert all(w.routable for w in before.values())
        await generate(client)
    client.path.unlink()  # a missing file is not an empty listing either
    await wait_for(lambda: discovery_of_error_says(client, "cannot read"))
    assert {w.url: w for w in client.registry.workers()} == before
    write_atomically(client.path, yaml_of(prefill(p1), prefill(p2), decode(d1)))
    await wait_for(lambda: urls(client) == {p1.url, p2.url, d1.url})
    status = await discovery_of(client)
    assert status["error"] is None and status["registered"] == 3


async def discovery_of_error_says(client, text: str) -> bool:
    error = (await discovery_of(client))["error"]
    return error is not None and text in error


async def test_a_file_missing_at_start_up_is_read_when_it_appears(sim_workers, router_with_file):
    p1, d1 = await sim_workers(prefill=1, decode=1)
    client = await router_with_file(None)
    assert urls(client) == set()
    assert "cannot read" in (await discovery_of(client))["error"]
    write_atomically(client.path, yaml_of(prefill(p1), decode(d1)))
    await wait_for(lambda: urls(client) == {p1.url, d1.url})
    await wait_for(lambda: all(w.routable for w in client.registry.workers()))
    await generate(client)


async def test_a_file_written_in_place_is_read_too(sim_workers, router_with_file):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1)))
    with open(client.path, "w") as f:  # same inode, truncated and rewritten
        f.write(yaml_of(prefill(p1), decode(d1), decode(d2)))
    await wait_for(lambda: urls(client) == {p1.url, d1.url, d2.url})


async def test_a_changed_entry_re_registers_the_worker(fake_fleet, router_with_file):
    p1, d1 = await fake_fleet(prefill=1, decode=1)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1)))
    old = client.registry.find(p1.url)
    write_atomically(client.path, yaml_of(prefill(p1, port=9100), decode(d1)))
    await wait_for(lambda: client.registry.find(p1.url) not in (None, old), message="p1 re-registered")
    new = client.registry.find(p1.url)
    await wait_for(lambda: new.routable)
    assert new.bootstrap_port == 9100  # a port given for the worker's role is kept, as on the command line
    await generate(client)
    assert p1.bodies()[-1]["bootstrap_port"] == d1.bodies()[-1]["bootstrap_port"] == 9100
    # listed as prefill, the server says decode: re-registered, and the live role wins as it does for flags
    old_d1 = client.registry.find(d1.url)
    write_atomically(client.path, yaml_of(prefill(p1, port=9100), prefill(d1, port=9200)))
    await wait_for(lambda: client.registry.find(d1.url) not in (None, old_d1))
    await wait_for(lambda: client.registry.find(d1.url).routable)
    assert client.registry.find(d1.url).role is Role.DECODE


async def test_a_removed_worker_finishes_the_requests_it_has(sim_workers, router_with_file):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1)))
    d1.set_faults(hang_after_tokens=1)  # the decode stalls after the prefill's token
    request = asyncio.ensure_future(generate(client))
    await wait_for(lambda: d1.in_handler == 1, message="the request on d1")
    write_atomically(client.path, yaml_of(prefill(p1), decode(d2)))
    await wait_for(lambda: urls(client) == {p1.url, d2.url})
    assert not request.done()
    d1.set_faults(hang_after_tokens=None)
    answer = await asyncio.wait_for(request, 10)
    assert answer["meta_info"]["completion_tokens"] >= 1
    assert d1.aborts == []
    await wait_for(lambda: client.registry.find(d2.url).routable)
    await generate(client)
    assert len(d2.bodies()) == 1 and len(d1.bodies()) == 1


async def test_a_busy_worker_is_removed_when_its_operation_ends(sim_workers, router_with_file):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1), decode(d2)))
    worker = client.registry.find(d2.url)
    client.registry.set_state(worker, WorkerState.DRAINING, "a conversion drains it")  # what the flow does
    write_atomically(client.path, yaml_of(prefill(p1), decode(d1)))

    async def waiting() -> bool:
        entries = {w["url"]: w for w in (await discovery_of(client))["workers"]}
        return d2.url in entries and entries[d2.url]["status"] == "removing" and entries[d2.url]["problem"]

    await wait_for(waiting, message="the removal to wait for the operation")
    assert client.registry.find(d2.url) is worker
    client.registry.set_state(worker, WorkerState.ACTIVE, "the conversion ended")
    await wait_for(lambda: client.registry.find(d2.url) is None, message="removed at the next retry")
    assert (await discovery_of(client))["workers"] == [
        {"url": p1.url, "role": "prefill", "bootstrap_port": p1.bootstrap_port, "bootstrap_port_from_server": False,
         "status": "registered", "problem": None, "worker_id": client.registry.find(p1.url).id},
        {"url": d1.url, "role": "decode", "bootstrap_port": None, "bootstrap_port_from_server": True,
         "status": "registered", "problem": None, "worker_id": client.registry.find(d1.url).id},
    ]


async def test_the_command_line_keeps_its_workers(sim_workers, router_with_file):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    client = await router_with_file(yaml_of(decode(d1), decode(d2)), prefills=[p1], decodes=[d1])
    assert client.registry.find(d1.url).source == "--decode"
    assert client.registry.find(d2.url).source == f"file {client.path}"
    entries = {w["url"]: w for w in (await discovery_of(client))["workers"]}
    assert entries[d1.url]["status"] == "waiting" and "already registered (--decode)" in entries[d1.url]["problem"]
    write_atomically(client.path, yaml_of())
    await wait_for(lambda: client.registry.find(d2.url) is None)
    assert urls(client) == {p1.url, d1.url}  # the file never removes what it did not register


async def test_worker_allow_applies_to_the_file(sim_workers, router_with_file):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    client = await router_with_file(yaml_of(decode(d2)), prefills=[p1], decodes=[d1], worker_allow=("10.0.0.0/8",))
    assert urls(client) == {p1.url, d1.url}
    (entry,) = (await discovery_of(client))["workers"]
    assert entry["status"] == "waiting" and "may not be registered" in entry["problem"]


async def test_a_worker_removed_through_the_api_stays_out_until_its_entry_changes(sim_workers, router_with_file):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    client = await router_with_file(yaml_of(prefill(p1), decode(d1), d2.url))
    worker = client.registry.find(d2.url)
    assert (await client.delete(f"/workers/{worker.id}")).status == 200
    write_atomically(client.path, yaml_of(prefill(p1), decode(d1), d2.url,
                                             "{url: 'http://127.0.0.1:1', worker_type: decode}"))  # another change
    await wait_for(lambda: client.registry.find("http://127.0.0.1:1") is not None)
    assert client.registry.find(d2.url) is None
    entries = {w["url"]: w for w in (await discovery_of(client))["workers"]}
    assert entries[d2.url]["status"] == "removed through the API"
    write_atomically(client.path, yaml_of(prefill(p1), decode(d1), decode(d2)))  # its entry changed
    await wait_for(lambda: client.registry.find(d2.url) is not None)
    assert client.registry.find(d2.url).source == f"file {client.path}"
