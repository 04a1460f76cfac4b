"""``python -m simulator``: one simulated SGLang worker.

    python -m simulator --role prefill --host 127.0.0.1 --port 30001 --bootstrap-port 8998
    python -m simulator --role decode --port 30002 --enable-pd-role-switch --decode-step-s 0.01

``--announce`` prints one JSON line (url, ports, pid) once the worker listens: fleets started
with ``processes=True`` read it. SIGTERM/SIGINT stop the worker cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal

from .config import add_worker_flags, config_from_args
from .faults import Faults, add_fault_flags, faults_from_args
from .worker import Worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m simulator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(parser)
    add_fault_flags(parser)
    parser.add_argument("--faults-json", help="faults as a JSON object (overrides the --fault-* flags)")
    parser.add_argument("--announce", action="store_true", help="print a JSON line once listening")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    faults = Faults(**json.loads(args.faults_json)) if args.faults_json else faults_from_args(args)
    try:
        import uvloop  # noqa: PLC0415

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(config, faults, args.announce))


async def _serve(config, faults, announce: bool) -> None:
    worker = Worker(config, faults, standalone=True)
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if announce:
        print(json.dumps({"role": config.role, "url": worker.url, "port": worker.port,
                          "bootstrap_port": worker.bootstrap_port, "pid": os.getpid()}), flush=True)
    try:
        await stop.wait()
    finally:
        await worker.stop()


if __name__ == "__main__":
    main()
