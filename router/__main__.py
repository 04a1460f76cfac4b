"""`pd-router` / `python -m router`: parse flags (every mini_lb form), build the app, serve it on uvloop.

`pd-router ctl ...` is the control command line (`router.ctl`) instead: every launch form starts with a flag,
so `ctl` as the first argument is unambiguous. The server's modules are imported only to serve, so the
control command starts fast.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("router")
# A burst of new clients (a load test's ramp, clients reconnecting after a restart) must not overflow the
# accept queue: with aiohttp's default of 128, 256 connections at once cost seconds of SYN retries.
BACKLOG = 2048


def _event_loop():
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        import asyncio

        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve(argv: list[str] | None = None) -> int:
    from router.core.config import ConfigError
    from router.obs.logs import setup_logging
    from router.server import serving, shutdown, supervisor
    from router.server.app import create_app
    from router.server.cli import config_from_args
    from router.server.replica_info import ReplicaInfo

    try:
        config = config_from_args(argv)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"pd-router: error: {problem}", file=sys.stderr)
        return 2
    place = supervisor.replica_place()
    supervising = place is None and config.replicas > 1
    setup_logging(config.log_level, config.log_json,
                  process="supervisor" if supervising else f"replica {place.index}" if place else None)
    if supervising:
        return supervise(sys.argv[1:] if argv is None else argv, config)
    if place is not None and not supervisor.die_with_supervisor(place):
        logger.error("replica %d: its supervisor (pid %d) is gone; not serving", place.index, place.supervisor_pid)
        return 1
    replica = ReplicaInfo(place=place)
    app = create_app(config, replica=replica)
    logger.info("pd-router on %s:%d%s: %d prefill, %d decode; policies %s/%s", config.host, config.port,
                f" (replica {place.index} of {place.count}, pid {replica.pid})" if place else "",
                len(config.prefill), len(config.decode), config.prefill_policy, config.decode_policy)
    for warning in config.warnings():
        logger.warning("%s", warning)
    serving.run(app, host=config.host, port=config.port, loop=_event_loop(), backlog=BACKLOG,
                shutdown_timeout=shutdown.close_timeout(config.shutdown_grace_secs),
                announce=lambda message: logger.info("%s", message), wind_down=shutdown.wind_down(app),
                reuse_port=place is not None, on_listening=lambda site: setattr(replica, "site", site))
    logger.info("pd-router stopped")
    return 0


def supervise(argv: list[str], config) -> int:
    """`--replicas N`: start N routers on one port and keep them running (router/server/supervisor.py)."""
    import asyncio
    import os

    from router.server.supervisor import Supervisor, reserve_port

    try:
        reserved = reserve_port(config.host, config.port)
    except OSError as exc:
        logger.error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        return 1
    logger.info("pd-router supervisor (pid %d): %d replicas on %s:%d", os.getpid(), config.replicas,
                config.host, config.port)
    if not config.cluster.enabled:
        logger.warning("the replicas do not share the fleet's state (no --etcd-endpoints): a conversion, a weight "
                       "update or a worker added at one of them is not seen by the others")
    try:
        return asyncio.run(Supervisor(argv, config.replicas, metrics_port=config.prometheus_port).run())
    finally:
        for sock in reserved:
            sock.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["ctl"]:
        from router.ctl.main import main as ctl_main

        return ctl_main(args[1:])
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
