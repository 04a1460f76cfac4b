"""Worker URLs: one canonical form, checked once, that is the worker's identity (one server is one worker
however its URL is written), and credentials in it are never shown while the control plane still uses them."""

from __future__ import annotations

import base64
import logging

import orjson
import pytest

from router.control.worker_sources import parse_listing
from router.core.config import ConfigError
from router.core.worker_url import BadWorkerUrl, parse_worker_url
from router.server.cli import config_from_args

from ..helpers import wait_for

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize("written, canonical", [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
    ("  HTTP://LocalHost:30000/  ", "http://localhost:30000"),
    ("http://[0:0::1]:8000", "http://[::1]:8000"),
    ("http://[::ffff:10.0.0.1]:8000", "http://10.0.0.1:8000"),
    ("https://Gpu-0.lab.:443/", "https://gpu-0.lab.:443"),
    ("http://user:pw@h:1", "http://h:1"),
    ("http://h:0080", "http://h:80"),
    ("http://h:1\n", "http://h:1"),  # surrounding whitespace, as a file or a form leaves it
])
def test_one_canonical_form(written, canonical):
    assert parse_worker_url(written).url == canonical


@pytest.mark.parametrize("written, why", [
    ("http://h:0", "port must be in 1..65535"),
    ("http://h:65536", "out of range"),
    ("http://h:-1", ""),
    ("http://h :1", "whitespace"),
    ("\thttp://h:1/\x00", "control"),
    ("ftp://h:1", "scheme"),
    ("http://:1", "no host"),
    ("http://h", "no port"),
    ("http://h:1/generate", "scheme://host:port only"),
    ("http://h:1?x=1", "scheme://host:port only"),
    ("http://h:1#f", "scheme://host:port only"),
    ("http://h!:1", "not a host name"),
    ("http://exa%6dple:1", "not a host name"),
    ("", "non-empty"),
    (5, "non-empty"),
    (None, "non-empty"),
])
def test_what_cannot_be_a_worker_address_is_refused_with_the_reason(written, why):
    with pytest.raises(BadWorkerUrl) as refused:
        parse_worker_url(written)
    assert why in str(refused.value)


def test_a_refused_url_is_quoted_without_its_password():
    with pytest.raises(BadWorkerUrl) as refused:
        parse_worker_url(f"http://admin:{SECRET}@h:0")
    assert SECRET not in str(refused.value)


def test_the_command_line_refuses_bad_ports_and_one_server_given_twice():
    with pytest.raises(ConfigError) as refused:
        config_from_args(["--prefill", "http://127.0.0.1:0", "--decode", "http://127.0.0.1:9", "--decode",
                          " HTTP://127.0.0.1:9/"], env={})
    problems = " | ".join(refused.value.problems)
    assert "port must be in 1..65535" in problems and "http://127.0.0.1:9 given twice" in problems


def test_a_listing_shows_no_credentials_but_registers_with_them():
    listing = parse_listing({"url": f" http://svc:{SECRET}@W-1:30000/", "worker_type": "decode"}, "file[0]")
    assert listing.url == "http://w-1:30000" and SECRET not in orjson.dumps(listing.to_dict()).decode()
    assert parse_worker_url(listing.address).userinfo == f"svc:{SECRET}"


async def test_one_server_written_another_way_is_the_same_worker(sim_workers, make_router):
    p, d, spare = await sim_workers(1, 2)
    client = await make_router([p], [d])
    host_port = d.url.split("://")[1]
    for written in (f" {d.url}", f"HTTP://{host_port}/", f"http://someone:pw@{host_port}"):
        for path, kw in (("/workers", {"json": {"url": written, "worker_type": "decode"}}),
                         ("/add_worker", {"params": {"url": written, "worker_type": "decode"}}),
                         ("/register", {"json": {"mode": "decode", "registry_url": written,
                                                 "bootstrap_port": None}})):
            async with client.post(path, **kw) as resp:
                if path == "/register":  # mini_lb's: a known server registering again (its checks pass)
                    assert resp.status == 200, await resp.text()
                else:
                    assert resp.status == 409, (path, written, await resp.text())
    assert len(client.registry) == 2
    for written, status in ((f"http://127.0.0.1:0", 400), (f"http://127.0.0.1:{10**6}", 400),
                            (f"http://127.0.0.1:{spare.url.rsplit(':', 1)[1]} x", 400)):
        async with client.post("/workers", json={"url": written, "worker_type": "decode"}) as resp:
            assert resp.status == status and (await resp.json())["error"]["param"] == "url"
    assert len(client.registry) == 2


async def test_credentials_are_used_to_reach_the_server_and_shown_nowhere(sim_workers, make_router, caplog):
    caplog.set_level(logging.DEBUG)
    p, d, spare = await sim_workers(1, 2)
    client = await make_router([p], [d])
    host_port = spare.url.split("://")[1]
    async with client.post("/workers", json={"url": f"http://svc:{SECRET}@{host_port}/",
                                             "worker_type": "decode"}) as resp:
        assert resp.status == 200
        answer = await resp.text()
    worker = client.registry.find(spare.url)
    assert worker is not None and worker.url == spare.url
    expected = "Basic " + base64.b64encode(f"svc:{SECRET}".encode()).decode()
    await wait_for(lambda: any(path in ("/model_info", "/server_info") for path, _ in spare.authorizations))
    assert all(auth == expected for _, auth in spare.authorizations), spare.authorizations
    shown = [answer]
    for path in ("/workers", f"/workers/{worker.id}", "/list_workers", "/admin/health", "/metrics",
                 "/v1/rl/workers", "/admin/discovery"):
        async with client.get(path) as resp:
            assert resp.status == 200, path
            shown.append(await resp.text())
    shown.append(caplog.text)
    leaks = [text[:300] for text in shown if SECRET in text]
    assert not leaks, leaks
    assert spare.url in shown[1]  # listed, under its own URL
