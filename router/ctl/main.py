"""`pd-router ctl`: flags, subcommands, and the exit code of each outcome."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from router.ctl import actions, follow_operations, views
from router.ctl.client import AdminClient, CtlError
from router.ctl.render import Console

DEFAULT_URL = "http://127.0.0.1:30000"  # the router's default --port
QUICK_TIMEOUT_S = 30.0

EPILOG = """\
The router's URL comes from --url, else PD_ROUTER_URL, else http://127.0.0.1:30000. The admin key comes
from --admin-key, else PD_ROUTER_ADMIN_API_KEY, else PD_ROUTER_API_KEY (a router started with --api-key
alone takes that key on its admin routes).

Exit codes: 0 ok; 1 the operation failed or the router refused it (its message is printed);
2 usage error; 3 the router is unreachable or did not answer in time; 4 the router refused the key.

There is no drain-only command: the router has no operation that drains a worker without converting it.
`convert WORKER --to ROLE --mode drain` drains first; `remove WORKER` takes a worker out of the fleet.
"""

Command = Callable[[AdminClient, argparse.Namespace, Console], int]


def _common_flags(suppress: bool) -> argparse.ArgumentParser:
    """The connection flags, accepted before or after the subcommand."""
    default = argparse.SUPPRESS if suppress else None
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=default, help="the router's URL (env PD_ROUTER_URL)")
    common.add_argument("--admin-key", default=default, metavar="KEY",
                        help="admin API key (env PD_ROUTER_ADMIN_API_KEY, else PD_ROUTER_API_KEY)")
    common.add_argument("--json", action="store_true", default=default,
                        help="print the router's answer as JSON (for scripts) instead of tables")
    common.add_argument("--http-timeout", type=float, default=default, metavar="S",
                        help="how long to wait for each answer (default: 30 s; long operations wait as long as "
                             "the router's own deadlines)")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-router ctl", parents=[_common_flags(suppress=False)], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="See and act on a running pd-router's fleet through its admin API.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = _common_flags(suppress=True)

    def command(name: str, run: Command, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(run=run)
        return p

    p = command("workers", views.workers, "the workers: role, state, health, breaker, load, version")
    p.add_argument("--wide", action="store_true", help="also request counts and the state/health reasons")
    command("health", views.health, "router readiness, pools, each worker's probes and breaker (exit 1 if not ready)")

    p = command("convert", follow_operations.convert, "convert a worker to the other role, showing each step")
    p.add_argument("worker", metavar="WORKER", help="worker URL or id")
    p.add_argument("--to", required=True, choices=("prefill", "decode"), help="the new role")
    p.add_argument("--mode", default="drain", choices=("drain", "shed", "abort"),
                   help="drain: let its requests finish (default); shed: re-send elsewhere those still waiting on "
                        "their prefill, let the rest finish; abort: abort them (re-sent elsewhere)")
    p.add_argument("--timeout", type=float, metavar="S", help="deadline of the drain/abort step")
    p.add_argument("--switch-timeout", type=float, metavar="S", help="deadline of the server's switch")
    p.add_argument("--verify-timeout", type=float, metavar="S", help="deadline of reading the role back")

    p = command("reinstate", actions.reinstate, "put a failed worker back in the role its server reports")
    p.add_argument("worker", metavar="WORKER", help="worker URL or id")
    p = command("add", actions.add, "register a worker")
    p.add_argument("worker_url", metavar="URL", help="the server's URL")
    p.add_argument("--role", choices=("prefill", "decode"), help="default: the role the server reports")
    p.add_argument("--bootstrap-port", type=int, metavar="N",
                   help="a prefill's bootstrap port (default: learnt from its /server_info)")
    p = command("remove", actions.remove, "remove a worker (refused while it is being converted)")
    p.add_argument("worker", metavar="WORKER", help="worker URL or id")

    p = command("update-weights", follow_operations.update_weights,
                "update every server's weights from disk: hold, quiesce, update, verify, release")
    p.add_argument("--path", required=True, help="model_path on the servers")
    p.add_argument("--version", help="the weight_version the fleet then serves")
    p.add_argument("--abort", action="store_true", help="abort running requests instead of draining them")
    p.add_argument("--retry-aborted", action="store_true",
                   help="re-send aborted requests (not yet seen by their client) after the update")
    p.add_argument("--load-format", help="load_format passed to the servers")
    p = command("update-version", follow_operations.update_version, "relabel the fleet's weight version")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--drain", action="store_true", help="drain running requests instead of aborting them")
    command("rejoin", actions.rejoin, "check now whether left-out servers serve the fleet's version again")

    p = command("pause", follow_operations.pause, "pause generation on every server; new requests wait in the router")
    p.add_argument("--mode", choices=("abort", "retract", "in_place"), help="SGLang's pause mode (default abort)")
    p.add_argument("--retry-aborted", action="store_true", help="re-send aborted requests after continue")
    command("continue", follow_operations.resume, "continue generation after pause")
    p = command("abort", actions.abort, "abort one request (by rid) or all; returns once they have ended")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--rid", help="the request id")
    which.add_argument("--all", action="store_true", help="every request")

    p = command("operations", follow_operations.operations,
                "weight updates, pauses and role conversions, newest first; or one of them with its steps")
    p.add_argument("id", nargs="?", metavar="ID", help="an operation (opN) or conversion (cN) id")
    p.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    command("policies", views.policies, "each pool's policy and the load it sees per worker")
    p = command("rebalancer", views.rebalancer, "the rebalancer's mode, counters and last decisions; or change them")
    p.add_argument("--mode", choices=("off", "advisory", "enabled"), help="set the mode")
    p.add_argument("--set", action="append", metavar="NAME=VALUE", help="set a knob, e.g. horizon_secs=300")
    p.add_argument("--limit", type=int, default=10, help="decisions shown (default 10)")
    command("cluster", views.cluster, "the router replicas of a cluster (a single router: 'not a cluster')")
    return parser


def main(argv: list[str] | None = None, env: dict | None = None) -> int:
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    console = Console(as_json=bool(args.json))
    url = args.url or env.get("PD_ROUTER_URL") or DEFAULT_URL
    if "://" not in url:
        url = "http://" + url
    key = args.admin_key or env.get("PD_ROUTER_ADMIN_API_KEY") or env.get("PD_ROUTER_API_KEY") or None
    client = AdminClient(url, key, timeout=args.http_timeout or QUICK_TIMEOUT_S, long_timeout=args.http_timeout)
    try:
        return args.run(client, args, console)
    except CtlError as error:
        if console.as_json and error.body is not None:
            console.document(error.body)
        status = f" (HTTP {error.status})" if error.status and not error.message.startswith("HTTP ") else ""
        console.warn(f"error: {error.message}{status}")
        return error.exit_code
    except KeyboardInterrupt:
        console.warn("interrupted: an operation already started goes on in the router (`pd-router ctl operations`)")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
