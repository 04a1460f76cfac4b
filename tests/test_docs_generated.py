"""The site's references are generated from the code (scripts/gen_docs.py): each page's block must be what the
code writes now, and a change in the code (a flag, a route, a metric, a guard) must show as drift."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import Counter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402

BLOCKS = {block.name: block for block in gen_docs.blocks()}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_generated_block_is_up_to_date(name):
    block = BLOCKS[name]
    assert block.current() == block.render(), \
        f"{block.page.relative_to(ROOT)}: the {name} block is out of date: run python scripts/gen_docs.py"


def test_the_blocks_cover_the_five_references():
    assert set(BLOCKS) == {"cli", "http-api", "metrics", "guards", "peers"}


def test_a_new_flag_shows_as_drift():
    from router.server.cli import build_parser

    parser = build_parser()
    section = next(group for group in parser._action_groups if group.title == "security: keys")
    section.add_argument("--planted-flag", "--planted-alias", default=7, help="a flag the page lacks")
    planted = gen_docs.cli_reference(parser)
    assert planted != BLOCKS["cli"].current()
    row = next(line for line in planted.splitlines() if "--planted-flag" in line)
    assert "`7`" in row and "`--planted-alias`" in row and "a flag the page lacks" in row


def test_a_new_route_shows_as_drift():
    from router.api.openapi import build_document

    async def planted_route(request: web.Request) -> web.Response:
        """A route the page lacks."""
        return web.Response()

    app = gen_docs.reference_app()
    app.router.add_post("/admin/planted", planted_route)
    planted = gen_docs.http_reference(build_document(app))
    assert planted != BLOCKS["http-api"].current()
    assert "| `POST` | `/admin/planted` | A route the page lacks. |" in planted


def test_a_new_metric_shows_as_drift():
    registry = gen_docs.router_metrics_registry()
    Counter("pd_router_planted", "a metric the page lacks", ["worker"], registry=registry)
    planted = gen_docs.metrics_reference(registry)
    assert planted != BLOCKS["metrics"].current()
    assert "| `pd_router_planted_total` | counter | worker | a metric the page lacks |" in planted


def test_a_new_guard_shows_as_drift(monkeypatch):
    from policies import rebalance_guards

    def planted_guard(*args):
        """A guard the page lacks."""

    monkeypatch.setattr(rebalance_guards, "GUARDS", (*rebalance_guards.GUARDS, ("planted", planted_guard)))
    planted = gen_docs.guards_block()
    assert planted != BLOCKS["guards"].current()
    assert "| `planted` (planted_guard) | A guard the page lacks. |" in planted


def test_check_mode_names_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "metrics.md"
    block = BLOCKS["metrics"]
    page.write_text(block.rewritten(block.page.read_text(), body="| stale |"))
    stale = gen_docs.Block(block.name, page, block.begin, block.end, block.render)
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    monkeypatch.setattr(gen_docs, "blocks", lambda: [stale])
    assert gen_docs.main(["--check"]) == 1
    assert "metrics.md (metrics)" in capsys.readouterr().err
    assert gen_docs.main([]) == 0 and gen_docs.main(["--check"]) == 0
    assert stale.current() == block.render()


def undocumented_routes(app) -> list[str]:
    """Routes whose summary in the document is only their handler's name."""
    from router.api.openapi import build_document, openapi_path

    document = build_document(app)
    bare = []
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path = openapi_path(route.resource.canonical)
        if document["paths"][path][route.method.lower()]["summary"] == route.handler.__name__.replace("_", " "):
            bare.append(f"{route.method} {path}")
    return bare


def test_every_route_says_what_it_does():
    bare = undocumented_routes(gen_docs.reference_app())
    assert not bare, ("give these routes' handlers a docstring, or a line in router/api/openapi.py's SUMMARIES: "
                      f"{bare}")


def test_a_route_without_a_word_is_caught():
    async def planted_route(request: web.Request) -> web.Response:
        return web.Response()

    app = gen_docs.reference_app()
    app.router.add_get("/admin/planted", planted_route)
    assert undocumented_routes(app) == ["GET /admin/planted"]
