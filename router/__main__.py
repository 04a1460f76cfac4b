"""`pd-router` / `python -m router`: parse flags (every mini_lb form), build the app, serve it on uvloop."""

from __future__ import annotations

import logging
import sys

from router.core.config import ConfigError
from router.obs.logs import setup_logging
from router.server import serving
from router.server.app import create_app
from router.server.cli import config_from_args

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


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"pd-router: error: {problem}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_json)
    app = create_app(config)
    logger.info("pd-router on %s:%d: %d prefill, %d decode; policies %s/%s", config.host, config.port,
                len(config.prefill), len(config.decode), config.prefill_policy, config.decode_policy)
    serving.run(app, host=config.host, port=config.port, loop=_event_loop(), backlog=BACKLOG, shutdown_timeout=10,
                announce=lambda message: logger.info("%s", message))
    return 0


if __name__ == "__main__":
    sys.exit(main())
