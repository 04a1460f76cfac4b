"""Dump a peer router's command line (its argparse actions) as JSON: the data of tests/fixtures/peers/.

Run it with a Python where the peer is installed (a throwaway venv: `pip install --no-deps` its wheel), e.g.
    python scripts/peer_flags.py sglang_router > tests/fixtures/peers/sglang_router-0.3.2.json
    python scripts/peer_flags.py smg > tests/fixtures/peers/smg-1.13.0.json
It builds the parser the way the peer's own `launch_router` does (`RouterArgs.add_cli_args(parser,
use_router_prefix=False)`) and writes one row per action: its option strings, dest, action kind, nargs,
choices, default, type and argument group, and its help text (the flag's meaning, as the peer states it).
Imports nothing of pd-router.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import sys


def _plain(value):
    """JSON for a default: SUPPRESS and other objects as text."""
    if value is argparse.SUPPRESS:
        return "SUPPRESS"
    try:
        json.dumps(value)
    except TypeError:
        return repr(value)
    return value


def dump(package: str) -> dict:
    module = importlib.import_module(f"{package}.router_args")
    # the distribution's version: smg 1.13.0's own version.py still says 1.1.0
    version = importlib.metadata.version(package.replace("_", "-"))
    parser = argparse.ArgumentParser(add_help=False)
    module.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    rows = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings:
                continue
            kind = type(action).__name__.lstrip("_").removesuffix("Action") or "Store"
            rows.append({
                "flags": list(action.option_strings),
                "dest": action.dest,
                "action": kind,
                "nargs": action.nargs,
                "choices": list(action.choices) if action.choices else None,
                "default": _plain(action.default),
                "type": getattr(action.type, "__name__", None) if action.type else None,
                "group": group.title,
                "help": (action.help or "").replace("%(default)s", str(action.default)),
            })
    return {"package": package, "version": version, "launcher": f"python -m {package}.launch_router",
            "actions": rows}


if __name__ == "__main__":
    json.dump(dump(sys.argv[1]), sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")
