"""Write the site's generated references from the code itself, so that they cannot drift from it.

    python scripts/gen_docs.py          # rewrite every generated block (between its markers) in docs/
    python scripts/gen_docs.py --check  # exit 1, naming the pages, if any block is not what this would write

Each block lives between two HTML comments in a page whose prose is written by hand:
- docs/reference/cli.md: the command line, from the parser `pd-router` runs (its --help sections, each flag's
  default and the other names it answers to);
- docs/reference/http-api.md: the HTTP API, from the document the router serves as `GET /openapi.json`, built
  from an app made in this process;
- docs/reference/metrics.md: the metrics, from the Prometheus registry of a router started in this process
  (its clean-up context run, no worker, nothing listening);
- docs/AUTOPILOT.md: the rebalancer's guards, from the guards (`policies.rebalance_guards.guard_table()`);
- docs/PEERS.md: the peers' flags, from their parsers' dumps (`scripts/peers_doc.py`).
tests/test_docs_generated.py fails when a block is out of date.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Block:
    name: str
    page: Path
    begin: str
    end: str
    render: Callable[[], str]

    def current(self) -> str:
        """The block as the page has it now (without its markers)."""
        text = self.page.read_text()
        if self.begin not in text or self.end not in text:
            raise ValueError(f"{self.page}: the markers of the {self.name} block are missing")
        return text.split(self.begin, 1)[1].split(self.end, 1)[0].strip("\n")

    def rewritten(self, text: str, body: str | None = None) -> str:
        head, _, rest = text.partition(self.begin)
        _, _, tail = rest.partition(self.end)
        return f"{head}{self.begin}\n{self.render() if body is None else body}\n{self.end}{tail}"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- generated: {name} (python scripts/gen_docs.py) -->", f"<!-- /generated: {name} -->"


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


# ---- the command line ------------------------------------------------------------------------------------------
def _default_shown(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    default = action.default
    if default is None or default == argparse.SUPPRESS or default == [] or default == ():
        return ""
    if isinstance(default, (list, tuple)):
        return "`" + " ".join(map(str, default)) + "`"
    return f"`{default}`"


def _help_without_default(help_text: str | None) -> str:
    if not help_text:
        return ""
    body, marker, _ = help_text.rpartition(" (default: ")
    if marker:
        return body
    return "" if help_text.startswith("(default: ") else help_text


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """One table per --help section: the flag, its value, its default, the other names it answers to, what it
    does. The peers' refused and ignored flags (hidden from --help) are on the peers' page."""
    from router.server.cli_groups import SECTIONS

    descriptions = dict(SECTIONS)
    out: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and "-h" not in a.option_strings]
        if not actions:
            continue
        out += [f"## {group.title[0].upper()}{group.title[1:]}", ""]
        if descriptions.get(group.title):
            out += [descriptions[group.title][0].upper() + descriptions[group.title][1:] + ".", ""]
        out += ["| flag | default | also accepted | what it does |", "|---|---|---|---|"]
        for action in actions:
            first = action.option_strings[0]
            if action.nargs != 0:
                value = action.metavar or (("{" + ",".join(action.choices) + "}") if action.choices else "")
                if action.nargs in ("+", "*"):
                    value = f"{value} ..."
                first = f"{first} {value}".rstrip()
            others = ", ".join(f"`{name}`" for name in action.option_strings[1:])
            out.append(f"| `{_cell(first)}` | {_cell(_default_shown(action))} | {others} | "
                       f"{_cell(_help_without_default(action.help))} |")
        out.append("")
    return "\n".join(out).rstrip()


def cli_block() -> str:
    from router.server.cli import build_parser

    return cli_reference(build_parser())


# ---- the HTTP API ------------------------------------------------------------------------------------------------
ACCESS_ORDER = ("public", "generation", "admin")
ACCESS_WORDS = {"public": "Public routes (no key)", "generation": "Generation routes (`--api-key`)",
                "admin": "Admin routes (`--admin-api-key`, else `--api-key`)"}


def _body_fields(document: dict, operation: dict) -> str:
    body = operation.get("requestBody")
    if not body:
        return ""
    ref = body["content"]["application/json"]["schema"].get("$ref", "")
    schema = document["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {})
    required = set(schema.get("required", ()))
    names = [f"`{name}`" + ("*" if name in required else "") for name in schema.get("properties", {})]
    if schema.get("additionalProperties") is not False and schema.get("type") == "object" and names:
        names.append("...")
    return ", ".join(names) if names else "JSON object"


def http_reference(document: dict) -> str:
    """The routes by access class: method, path, what it does (the handler's own summary), the body's fields
    (* required; ... other fields forwarded as sent)."""
    rows: dict[str, list[str]] = {access: [] for access in ACCESS_ORDER}
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            access = operation["tags"][0]
            rows.setdefault(access, []).append(
                f"| `{method.upper()}` | `{_cell(path)}` | {_cell(operation['summary'])} | "
                f"{_cell(_body_fields(document, operation))} |")
    out: list[str] = []
    for access, lines in rows.items():
        if not lines:
            continue
        out += [f"## {ACCESS_WORDS.get(access, access)}", "", "| method | path | what it does | body |",
                "|---|---|---|---|", *lines, ""]
    return "\n".join(out).rstrip()


def reference_app():
    """The app the reference documents: every route a router can serve (the cluster's included, which a router
    adds only with --etcd-endpoints: nothing is connected here)."""
    from router.core.config import RouterConfig
    from router.server.app import create_app

    config = RouterConfig()
    config = config.with_(cluster=config.cluster.with_(etcd_endpoints=("http://127.0.0.1:2379",)))
    return create_app(config)


def http_block() -> str:
    from router.api.openapi import build_document

    return http_reference(build_document(reference_app()))


# ---- the metrics -------------------------------------------------------------------------------------------------
def _metric_rows(registry) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(name as exposed, type, labels, help) of every metric the registry exposes, whether or not it has a sample."""
    rows = []
    for collector in list(registry._collector_to_names):
        declared = getattr(collector, "_labelnames", None)  # prometheus_client's own Counter, Histogram, ...
        for family in collector.collect():
            labels = declared if declared is not None else getattr(family, "_labelnames", ())
            name = family.name + "_total" if family.type == "counter" else family.name
            rows.append((name, family.type, tuple(labels), family.documentation))
    return sorted(set(rows))


def metrics_reference(registry) -> str:
    lines = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for name, kind, labels, help_text in _metric_rows(registry):
        lines.append(f"| `{name}` | {kind} | {', '.join(labels)} | {_cell(help_text)} |")
    return "\n".join(lines)


async def _started_router_registry():
    """A router app started in this process (its clean-up context run: every collector registered) with every
    optional collector on but the cluster's (which needs a live etcd); closed before returning."""
    from aiohttp import web

    from router.core.config import RouterConfig
    from router.obs.metrics import METRICS
    from router.server.app import create_app

    config = RouterConfig()
    config = config.with_(pd_admission=config.pd_admission.with_(prefill_max_inflight_requests_per_worker=1))
    app = create_app(config)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        return app[METRICS].prometheus
    finally:
        await runner.cleanup()


def router_metrics_registry():
    return asyncio.run(_started_router_registry())


def metrics_block() -> str:
    return metrics_reference(router_metrics_registry())


# ---- the rebalancer's guards and the peers' flags ---------------------------------------------------------------
def guards_block() -> str:
    from policies.rebalance_guards import guard_table

    return guard_table()


def peers_block() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    import peers_doc

    return peers_doc.table()


def blocks() -> list[Block]:
    import importlib

    sys.path.insert(0, str(ROOT / "scripts"))
    peers_doc = importlib.import_module("peers_doc")
    return [
        Block("cli", DOCS / "reference" / "cli.md", *_markers("cli"), cli_block),
        Block("http-api", DOCS / "reference" / "http-api.md", *_markers("http-api"), http_block),
        Block("metrics", DOCS / "reference" / "metrics.md", *_markers("metrics"), metrics_block),
        Block("guards", DOCS / "AUTOPILOT.md", "<!-- guards: generated by policies.rebalance_guards.guard_table() -->",
              "<!-- /guards -->", guards_block),
        Block("peers", peers_doc.DOC, peers_doc.BEGIN, peers_doc.END, peers_block),
    ]


def main(argv: list[str]) -> int:
    stale = []
    for block in blocks():
        text = block.page.read_text()
        wanted = block.rewritten(text)
        if wanted == text:
            continue
        if "--check" in argv:
            stale.append(f"{block.page.relative_to(ROOT)} ({block.name})")
        else:
            block.page.write_text(wanted)
            print(f"wrote {block.page.relative_to(ROOT)} ({block.name})")
    if stale:
        print("out of date: " + ", ".join(stale) + ": run python scripts/gen_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
