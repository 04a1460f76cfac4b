#!/usr/bin/env python3
"""Container probe for pd-router, standard library only (the slim image has no curl).

    pd-router-probe            alive: the router answers GET /health at all, 200 (ready) or 503 (a pool has
                               no routable worker). A fleet outage must not get the router restarted: it
                               would lose its state and come back to the same empty fleet.
    pd-router-probe --ready    ready: GET /health answers 200.

The URL is --url, else $PD_ROUTER_PROBE_URL, else http://127.0.0.1:30000/health (the router's default port).
Exit status 0 when the condition holds, 1 when it does not (the reason goes to stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:30000/health"
ALIVE_STATUSES = (200, 503)  # 503 is the router's own answer for "no routable worker": it is alive


def health_status(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:  # a non-2xx answer: the router did answer
        exc.close()
        return exc.code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-router-probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ready", action="store_true", help="require 200 (default: 200 or 503 count as alive)")
    parser.add_argument("--url", default=os.environ.get("PD_ROUTER_PROBE_URL", DEFAULT_URL))
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)
    try:
        status = health_status(args.url, args.timeout)
    except (OSError, ValueError) as exc:  # refused, reset, timed out, bad URL
        print(f"pd-router-probe: {args.url}: no answer: {exc}", file=sys.stderr)
        return 1
    wanted = (200,) if args.ready else ALIVE_STATUSES
    if status not in wanted:
        print(f"pd-router-probe: {args.url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
