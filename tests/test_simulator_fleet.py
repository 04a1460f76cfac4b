"""Starting fleets: in-process, one process per worker, the CLIs."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from harness.processes import below_ephemeral
from simulator.fleet import Fleet, SimulatorStartError, config_to_argv, router_args
from simulator.config import WorkerConfig
from simulator.tokens import expected_generation
from tests.sim_support import FAST, get, pd_generate

PROMPT = "Hello world, this is"


async def test_in_process_fleet_2p2d(session):
    async with Fleet(2, 2, **FAST) as f:
        assert len(f.prefill_urls) == 2 and len(f.decode_urls) == 2
        assert len(set(f.bootstrap_ports)) == 2 and None not in f.bootstrap_ports
        for p in range(2):
            for d in range(2):
                (ps, _), (ds, out) = await pd_generate(session, f, {"text": PROMPT, "sampling_params": {
                    "max_new_tokens": 3}}, p=p, d=d)
                assert (ps, ds) == (200, 200)
                assert out["output_ids"] == expected_generation(PROMPT, max_new_tokens=3).output_ids
        doc = f.as_dict()
        assert [w["url"] for w in doc["prefill"]] == f.prefill_urls and doc["started_in_s"] < 30
        assert f.mini_lb_args()[:1] == ["--prefill"]


def free_block(n: int) -> int:
    """A base port with ``n`` free ports after it, below the ephemeral range (others share this machine)."""
    import random
    import socket
    for _ in range(50):
        base = random.randrange(20000, 30000)
        try:
            socks = []
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free block of ports")


async def test_base_port_layout(session):
    base = free_block(4)
    async with Fleet(1, 1, base_port=base, **FAST) as f:
        assert f.prefill[0].port == base and f.decode[0].port == base + 1
        assert f.prefill[0].bootstrap_port == base + 2 and f.decode[0].bootstrap_port == base + 3
        (ps, _), (ds, _) = await pd_generate(session, f, {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})
        assert (ps, ds) == (200, 200)


async def test_process_fleet_and_a_real_kill(session):
    async with Fleet(1, 1, processes=True, **FAST) as f:
        assert f.decode[0].pid and f.prefill[0].pid
        (ps, _), (ds, out) = await pd_generate(session, f, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert (ps, ds) == (200, 200)
        f.kill(f.decode[0])
        with pytest.raises(aiohttp.ClientConnectorError):
            await get(session, f.decode[0].url + "/health")
        assert (await get(session, f.prefill[0].url + "/health"))[0] == 200


async def test_a_restart_on_a_port_taken_meanwhile_says_so(session):
    """restart() reuses the killed worker's ports: taken meanwhile, the simulator exits before announcing itself,
    and the error says which worker and how it ended (it was a bare JSONDecodeError of an empty line)."""
    async with Fleet(1, 1, processes=True, **FAST) as f:
        # below the range a client connection's own end is taken from, so that nothing takes them while down
        below = below_ephemeral()
        assert all(p in below for h in f.workers for p in (h.port, h.bootstrap_port)), f.as_dict()
        handle = f.decode[0]
        f.kill(handle)
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", handle.port))
            squatter.listen()
            with pytest.raises(SimulatorStartError, match=rf"decode on port {handle.port} ended \(exit status [1-9]"):
                await f.restart(handle)
        await f.restart(handle)  # free again: it comes back
        assert (await get(session, handle.url + "/health"))[0] == 200


def test_config_round_trips_through_argv():
    cfg = WorkerConfig(role="decode", port=1234, bootstrap_port=None, api="convert", enable_pd_role_switch=True,
                       max_running_requests=7).with_(decode_step_s=0.01)
    argv = config_to_argv(cfg)
    from simulator.config import add_worker_flags, config_from_args
    import argparse
    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    assert config_from_args(parser.parse_args(argv)) == cfg


def test_fleet_cli_prints_json_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "simulator.fleet", "--prefill", "2", "--decode", "2",
                             "--health-check-s", "0"], stdout=subprocess.PIPE, text=True)
    try:
        doc = json.loads(proc.stdout.readline())
        assert len(doc["prefill"]) == 2 and len(doc["decode"]) == 2
        assert all(p["bootstrap_port"] for p in doc["prefill"])
        args = router_args(doc)
        assert args[0] == "--pd-disaggregation" and args.count("--prefill") == 2 and args.count("--decode") == 2
        out = subprocess.run([sys.executable, "-m", "simulator.fleet", "--router-args"], input=json.dumps(doc),
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == args
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()


def test_worker_cli_announces_and_serves():
    proc = subprocess.Popen([sys.executable, "-m", "simulator", "--role", "decode", "--port", "0",
                             "--bootstrap-port", "none", "--announce", "--health-check-s", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["role"] == "decode" and ready["bootstrap_port"] is None and ready["pid"] == proc.pid

        async def probe():
            async with aiohttp.ClientSession() as s:
                return await get(s, ready["url"] + "/model_info")

        status, info = asyncio.run(probe())
        assert status == 200 and info["disaggregation_mode"] == "decode"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()
