"""`pd-router` / `python -m router`: parse flags (every mini_lb form), build the app, serve it on uvloop."""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from .app import create_app
from .cli import config_from_args
from .config import ConfigError
from .logs import setup_logging

logger = logging.getLogger("router")


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
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        loop=_event_loop(),
        handler_cancellation=True,  # a client that disconnects cancels its handler: both legs get aborted
        access_log=None,
        print=lambda message: logger.info("%s", message.strip()),
        shutdown_timeout=10,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
