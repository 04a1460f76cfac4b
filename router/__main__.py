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
    from router.core.errors import ListenError
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
    try:
        setup_logging(config.log_level, config.log_json,
                      process="supervisor" if supervising else f"replica {place.index}" if place else None,
                      log_dir=config.log_dir)
    except OSError as exc:
        print(f"pd-router: error: --log-dir {config.log_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    from router.core.worker_tls import WorkerTlsError, worker_ssl_context

    try:  # made again by the app: this is the check, with one line and exit 2 for a file that does not load
        worker_ssl_context(config.client_cert_path, config.client_key_path, config.ca_cert_paths)
    except WorkerTlsError as exc:
        print(f"pd-router: error: {exc}", file=sys.stderr)
        return 2
    if config.worker_sources.pod_discovery:
        import importlib.util

        if importlib.util.find_spec("kubernetes_asyncio") is None:  # the optional extra
            from router.control.kubernetes_pods import MISSING_CLIENT

            print(f"pd-router: error: {MISSING_CLIENT}", file=sys.stderr)
            return 2
    if supervising:
        return supervise(sys.argv[1:] if argv is None else argv, config)
    if place is not None and not supervisor.die_with_supervisor(place):
        logger.error("replica %d: its supervisor (pid %d) is gone; not serving", place.index, place.supervisor_pid)
        return 1
    if place is not None and config.prometheus_port is not None:  # one metrics port per replica of the host
        config = config.with_(prometheus_port=config.prometheus_port + place.index)
    ssl_context = None
    if config.tls_cert_path is not None:
        import ssl

        try:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(config.tls_cert_path, config.tls_key_path)
        except (OSError, ssl.SSLError) as exc:
            logger.error("--tls-cert-path %s / --tls-key-path %s: %s", config.tls_cert_path, config.tls_key_path,
                         getattr(exc, "strerror", None) or exc)
            return 2
    from router.core.local_resources import raise_open_files_limit

    budget = raise_open_files_limit(config.max_connections)  # before anything opens: the app sizes itself to it
    replica = ReplicaInfo(place=place)
    app = create_app(config, replica=replica)
    logger.info("pd-router on %s:%d%s: %d prefill, %d decode; policies %s/%s", config.host, config.port,
                f" (replica {place.index} of {place.count}, pid {replica.pid})" if place else "",
                len(config.prefill), len(config.decode), config.prefill_policy, config.decode_policy)
    for warning in config.warnings():
        logger.warning("%s", warning)
    try:
        serving.run(app, host=config.host, port=config.port, loop=_event_loop(), backlog=BACKLOG,
                    shutdown_timeout=shutdown.close_timeout(config.shutdown_grace_secs),
                    announce=lambda message: logger.info("%s", message), wind_down=shutdown.wind_down(app),
                    reuse_port=place is not None, on_listening=lambda site: setattr(replica, "site", site),
                    ssl_context=ssl_context, header_read_timeout=config.connections.header_read_timeout_secs,
                    idle_connection_timeout=config.connections.idle_connection_timeout_secs,
                    max_clients=budget.clients)
    except ListenError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("pd-router stopped")
    return 0


def supervise(argv: list[str], config) -> int:
    """`--replicas N`: start N routers on one port and keep them running (router/server/supervisor.py), with a
    private etcd for them when no --etcd-endpoints is given (router/server/private_etcd.py)."""
    import asyncio
    import os

    from router.server.supervisor import Supervisor, reserve_port

    etcd, etcd_errors = None, ()
    if config.cluster.enabled and config.etcd_data_dir is not None:
        print("pd-router: error: --etcd-data-dir is for the private etcd of --replicas N; with --etcd-endpoints "
              "the replicas use that etcd", file=sys.stderr)
        return 2
    if not config.cluster.enabled:
        from router.cluster.etcd_process import EtcdStartError
        from router.server.private_etcd import PrivateEtcd, PrivateEtcdMissing

        etcd_errors = (EtcdStartError,)
        try:
            etcd = PrivateEtcd(config.etcd_data_dir, config.replicas)
        except PrivateEtcdMissing as exc:
            print(f"pd-router: error: {exc}", file=sys.stderr)
            return 2
    try:
        reserved = reserve_port(config.host, config.port)
    except OSError as exc:
        logger.error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        return 1
    logger.info("pd-router supervisor (pid %d): %d replicas on %s:%d, cluster %r (%s)", os.getpid(),
                config.replicas, config.host, config.port, config.cluster.name,
                "a private etcd" if etcd is not None else "etcd at " + " ".join(config.cluster.etcd_endpoints))
    try:
        return asyncio.run(Supervisor(argv, config.replicas, etcd=etcd).run())
    except etcd_errors as exc:
        logger.error("supervisor: the private etcd did not start: %s", exc)
        return 1
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
