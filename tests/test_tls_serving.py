"""--tls-cert-path/--tls-key-path (the peers'): the router serves HTTPS with the given certificate (a test
certificate for 127.0.0.1, tests/fixtures/tls/, valid to 2126); a certificate that does not load exits 2."""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
from pathlib import Path

import aiohttp

from .helpers import free_port, wait_for
from .router_process import REPO

TLS = Path(__file__).resolve().parent / "fixtures" / "tls"


async def test_https_is_served_with_the_certificate_and_plain_http_is_not(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port),
            "--tls-cert-path", str(TLS / "router.crt"), "--tls-key-path", str(TLS / "router.key")]
    trusted = ssl.create_default_context(cafile=str(TLS / "router.crt"))
    with open(tmp_path / "router.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                                    stdout=log, stderr=asyncio.subprocess.STDOUT)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                async def answers() -> bool:
                    assert proc.returncode is None, (tmp_path / "router.log").read_text()
                    try:
                        async with session.get(f"https://127.0.0.1:{port}/liveness", ssl=trusted) as resp:
                            return resp.status == 200 and await resp.text() == "OK"
                    except aiohttp.ClientConnectorError:
                        return False

                await wait_for(answers, timeout=30, interval=0.1, message="the router to serve HTTPS")
                served = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port), timeout=10)
                peer = ssl.PEM_cert_to_DER_cert(served)
                expected = ssl.PEM_cert_to_DER_cert((TLS / "router.crt").read_text())
                assert peer == expected  # the given certificate is the one served
                try:
                    async with session.get(f"http://127.0.0.1:{port}/liveness") as resp:
                        assert resp.status != 200
                except aiohttp.ClientError:
                    pass  # plain HTTP on the TLS port: the handshake fails, nothing is served
        finally:
            proc.terminate()
            await proc.wait()
    assert "serving on https://127.0.0.1:" in (tmp_path / "router.log").read_text()


async def test_a_certificate_that_does_not_load_exits_2(tmp_path):
    bad = tmp_path / "bad.crt"
    bad.write_text("not a certificate")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "--tls-cert-path", str(bad), "--tls-key-path", str(TLS / "router.key"),
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and f"--tls-cert-path {bad}" in out.decode()
