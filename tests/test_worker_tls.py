"""--client-cert-path, --client-key-path, --ca-cert-paths (sgl-router's and SMG's): TLS toward https:// workers.

A simulated 1P+1D fleet behind real TLS servers on loopback that demand a client certificate signed by their CA
(certificates made per test run by openssl): the router reads the servers and runs both legs through them with
its client certificate; without the certificate, or without the CA that signed the servers', nothing is read and
nothing is routed; a file that does not load ends the process with status 2 and one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router.__main__ import serve
from router.core.keys import REGISTRY
from router.server.app import create_app
from router.server.cli import config_from_args
from simulator.fleet import Fleet

from .conftest import RUNNER_KWARGS
from .sim_support import FAST

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _signed(name: str, cn: str, ca: str, cwd: Path, san: str | None = None) -> None:
    _openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=cwd)
    ext = cwd / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", ext.name, cwd=cwd)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed; another CA's client."""
    where = tmp_path_factory.mktemp("worker-tls")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *EC, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj",
                 f"/CN={ca}", cwd=where)
    _signed("server", "127.0.0.1", "ca", where, san="IP:127.0.0.1")
    _signed("client", "pd-router-client", "ca", where)
    _signed("stranger", "stranger", "other-ca", where)
    return where


class TlsFront:
    """A TLS server on loopback in front of one simulated worker: it demands a client certificate signed by the
    CA and pipes the bytes to the worker; it keeps the client certificates' names it saw."""

    def __init__(self, backend_port: int, certs: Path) -> None:
        self.backend_port = backend_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certs / "server.crt", certs / "server.key")
        self.context.load_verify_locations(certs / "ca.crt")
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.clients: list[str] = []
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> "TlsFront":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peercert") or {}
        self.clients.append(dict(pair[0] for pair in peer.get("subject", ())).get("commonName", ""))
        back_reader, back_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        pipes = [asyncio.ensure_future(_pipe(reader, back_writer)), asyncio.ensure_future(_pipe(back_reader, writer))]
        self._pipes.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._pipes.difference_update(pipes)
            for w in (writer, back_writer):
                w.close()

    async def stop(self) -> None:
        self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        await self._server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


@pytest.fixture
async def tls_fleet(certs):
    async with Fleet(1, 1, **FAST) as fleet:
        fronts = [await TlsFront(h.port, certs).start() for h in (fleet.prefill[0], fleet.decode[0])]
        try:
            yield fleet, fronts
        finally:
            for front in fronts:
                await front.stop()


@contextlib.asynccontextmanager
async def _router(fleet: Fleet, fronts: list[TlsFront], *flags: str):
    prefill, decode = fronts
    config = config_from_args(["--prefill", prefill.url, str(fleet.prefill[0].bootstrap_port), "--decode",
                               decode.url, "--worker-startup-timeout-secs", "1", "--host", "127.0.0.1",
                               *flags], env={})
    server = TestServer(create_app(config))
    await server.start_server(**RUNNER_KWARGS)
    client = TestClient(server)
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def _generate(client: TestClient, stream: bool) -> tuple[int, bytes]:
    resp = await client.post("/generate", json={"text": "hi", "stream": stream,
                                                "sampling_params": {"max_new_tokens": 3}})
    return resp.status, await resp.read()


async def test_the_router_presents_its_certificate_and_both_legs_run_over_tls(tls_fleet, certs):
    fleet, fronts = tls_fleet
    async with _router(fleet, fronts, "--client-cert-path", str(certs / "client.crt"), "--client-key-path",
                       str(certs / "client.key"), "--ca-cert-paths", str(certs / "ca.crt")) as client:
        assert (await client.get("/readiness")).status == 200
        status, body = await _generate(client, stream=False)
        assert status == 200 and b'"completion_tokens":3' in body.replace(b" ", b"")
        status, body = await _generate(client, stream=True)
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        workers = client.app[REGISTRY].workers()
        assert {w.url for w in workers} == {f.url for f in fronts} and all(w.routable for w in workers)
    for front in fronts:  # the control plane's reads and the legs, every one with the router's certificate
        assert front.clients and set(front.clients) == {"pd-router-client"}
    states = await asyncio.gather(*(fleet.state(h) for h in fleet.workers))
    assert all(state["counters"]["items_finished"] == 2 for state in states), states  # both legs of both


@pytest.mark.parametrize("flags", [
    pytest.param(("--ca-cert-paths", "ca.crt"), id="no client certificate"),
    pytest.param(("--ca-cert-paths", "ca.crt", "--client-cert-path", "stranger.crt", "--client-key-path",
                  "stranger.key"), id="a certificate the workers' CA did not sign"),
    pytest.param(("--client-cert-path", "client.crt", "--client-key-path", "client.key"),
                 id="the workers' CA not trusted"),
])
async def test_without_the_right_certificates_no_worker_is_read_or_routed(tls_fleet, certs, flags):
    fleet, fronts = tls_fleet
    flags = tuple(str(certs / f) if f.endswith((".crt", ".key")) else f for f in flags)
    async with _router(fleet, fronts, *flags) as client:
        assert (await client.get("/readiness")).status == 503
        status, body = await _generate(client, stream=False)
        assert status == 503 and b'"error"' in body
        assert not any(w.routable for w in client.app[REGISTRY].workers())
    assert "pd-router-client" not in fronts[0].clients + fronts[1].clients


def test_a_certificate_that_does_not_load_exits_2_with_one_line(certs, tmp_path, capsys):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    base = ["--prefill", "https://127.0.0.1:1", "--decode", "https://127.0.0.1:2"]
    assert serve([*base, "--client-cert-path", str(bad), "--client-key-path", str(certs / "client.key")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pd-router: error: --client-cert-path {bad} / --client-key-path {certs / 'client.key'}: ")
    assert "PEM lib" in line
    assert serve([*base, "--ca-cert-paths", str(certs / "ca.crt"), str(tmp_path / "missing.crt")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pd-router: error: --ca-cert-paths {tmp_path / 'missing.crt'}: No such file or directory"]
    assert serve([*base, "--client-cert-path", str(certs / "client.crt")]) == 2  # the key is missing
    assert "--client-cert-path and --client-key-path go together" in capsys.readouterr().err
