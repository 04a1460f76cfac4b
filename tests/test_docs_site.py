"""The docs site builds strictly and renders in a real browser: the home page and a guide, opened in headless
Chromium (Debian's `chromium` package) over the DevTools protocol, show their title and navigation, and every
request they make (stylesheets, scripts, images, the search index) is answered by the site itself, none failing.

Needs the `docs` extra (scripts/setup.sh installs it) and /usr/bin/chromium; without Chromium the test is
skipped, unless PDR_REQUIRE_BROWSER=1 (set by .ci/run, which installs it), where a missing browser fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from harness import processes

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("PDR_CHROMIUM", "/usr/bin/chromium")
REQUIRED = os.environ.get("PDR_REQUIRE_BROWSER") == "1"
# The flags a closed network needs: without the background-networking ones Chromium waits on services it
# cannot reach.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0")
PAGE_DEADLINE_S = 60


def _missing() -> str | None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        return "the docs extra is not installed (pip install -e '.[docs]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    return None


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    missing = _missing()
    if missing:
        if REQUIRED:
            pytest.fail(f"PDR_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return site


class SiteServer:
    """The built site on 127.0.0.1, recording every request it answers (path, status)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.served: list[tuple[str, int]] = []

    def app(self) -> web.Application:
        @web.middleware
        async def record(request: web.Request, handler):
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                self.served.append((request.path, exc.status))
                raise
            self.served.append((request.path, response.status))
            return response

        async def index(request: web.Request) -> web.StreamResponse:
            # a directory URL is its index.html, as any static web server answers it
            return web.FileResponse(self.root / request.match_info["dir"] / "index.html")

        app = web.Application(middlewares=[record])
        app.router.add_get(r"/{dir:(.*/)?}", index)
        app.router.add_static("/", self.root)
        return app


class Browser:
    """Headless Chromium driven over the DevTools protocol (one page target, one websocket)."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.session, self.ws = session, ws
        self.ids = itertools.count(1)
        self.events: list[dict] = []
        self.answers: dict[int, dict] = {}

    async def _read(self, until) -> None:
        while not until():
            message = await self.ws.receive_json()
            if "id" in message:
                self.answers[message["id"]] = message
            else:
                self.events.append(message)

    async def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        await self._read(lambda: call_id in self.answers)
        answer = self.answers.pop(call_id)
        assert "error" not in answer, f"{method}: {answer['error']}"
        return answer["result"]

    async def wait_for_event(self, method: str) -> dict:
        seen = len(self.events)
        await self._read(lambda: any(e["method"] == method for e in self.events[seen:]))
        return next(e for e in self.events[seen:] if e["method"] == method)

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")


async def _devtools_url(profile: Path, child: processes.Child) -> str:
    """The browser's DevTools port, from the file Chromium writes once it listens (--remote-debugging-port=0)."""
    active = profile / "DevToolsActivePort"
    await child.await_until(lambda: active.exists() and len(active.read_text().splitlines()) >= 2,
                            timeout=PAGE_DEADLINE_S, what="Chromium's DevTools port")
    port = int(active.read_text().splitlines()[0])
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def chromium(tmp: Path):
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp))
    log = tmp / "chromium.log"
    child = processes.start("chromium", [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            log)
    try:
        base = await _devtools_url(profile, child)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/json/list") as response:
                targets = await response.json(content_type=None)
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Browser(session, ws)
    finally:
        await asyncio.to_thread(child.stop)
        shutil.rmtree(profile, ignore_errors=True)


def requests_seen(browser: Browser) -> dict[str, str]:
    return {e["params"]["requestId"]: e["params"]["request"]["url"] for e in browser.events
            if e["method"] == "Network.requestWillBeSent"}


async def open_page(browser: Browser, url: str) -> dict:
    """Load `url`, wait until it has loaded and no request is pending, and say what the page shows and what
    every request it made came to."""
    browser.events.clear()
    await browser.call("Network.enable")
    await browser.call("Page.enable")
    await browser.call("Page.navigate", url=url)
    await browser.wait_for_event("Page.loadEventFired")

    def pending() -> set[str]:
        started = {e["params"]["requestId"]: e["params"] for e in browser.events
                   if e["method"] == "Network.requestWillBeSent"}
        ended = {e["params"]["requestId"] for e in browser.events
                 if e["method"] in ("Network.loadingFinished", "Network.loadingFailed")}
        # a worker's own script (the search's) ends in the worker's target: the page sees only its answer's head
        headed = {e["params"]["requestId"] for e in browser.events if e["method"] == "Network.responseReceivedExtraInfo"}
        workers = {rid for rid, params in started.items() if params.get("documentURL") == params["request"]["url"]
                   and params.get("type") == "Script"}
        # the tab's icon is fetched by the browser for the tab, not by the page: Chromium reports its answer's
        # head to the page's target but not always its end (the suite under load waited 60 s for it); its status
        # is checked below like every other request's
        answered = headed | {e["params"]["requestId"] for e in browser.events
                             if e["method"] == "Network.responseReceived"}
        icons = {rid for rid, params in started.items() if "/favicon." in params["request"]["url"]}
        return set(started) - ended - (workers & headed) - (icons & answered)

    # scripts may ask for more after the load event (the search index): wait until each request has ended
    try:
        await asyncio.wait_for(browser._read(lambda: not pending()), PAGE_DEADLINE_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"requests still pending after {PAGE_DEADLINE_S} s: "
                             f"{[requests_seen(browser)[rid] for rid in pending()]}") from None
    requests = requests_seen(browser)
    statuses = {e["params"]["requestId"]: e["params"]["response"]["status"] for e in browser.events
                if e["method"] == "Network.responseReceived"}
    statuses.update({e["params"]["requestId"]: e["params"]["statusCode"] for e in browser.events
                     if e["method"] == "Network.responseReceivedExtraInfo"})
    failed = [(requests.get(e["params"]["requestId"]), e["params"].get("errorText")) for e in browser.events
              if e["method"] == "Network.loadingFailed"]
    shown = await browser.evaluate("""({
        title: document.title,
        h1: (document.querySelector('article h1') || {}).textContent || '',
        nav_links: document.querySelectorAll('nav.md-nav a.md-nav__link').length,
        tabs: [...document.querySelectorAll('.md-tabs__link')].map(a => a.textContent.trim()),
        images: [...document.images].map(i => ({src: i.currentSrc, loaded: i.complete && i.naturalWidth > 0})),
        stylesheets: document.styleSheets.length,
        material_styled: getComputedStyle(document.querySelector('.md-header')).position,
    })""")
    return {"requests": requests, "statuses": statuses, "failed": failed, **shown}


def assert_rendered(page: dict, base: str, *, title: str, images_at_least: int) -> None:
    assert title in page["title"], page["title"]
    assert page["nav_links"] > 10 and {"Guides", "Reference", "Benchmarks"} <= set(page["tabs"]), page["tabs"]
    assert page["stylesheets"] >= 1 and page["material_styled"] in ("sticky", "fixed"), "the theme's CSS is not applied"
    assert len(page["images"]) >= images_at_least and all(i["loaded"] for i in page["images"]), page["images"]
    assert not page["failed"], f"failed requests: {page['failed']}"
    assert all(status < 400 for status in page["statuses"].values()), page["statuses"]
    outside = [url for url in page["requests"].values() if not url.startswith(base) and not url.startswith("data:")]
    assert not outside, f"requests outside the site: {outside}"


async def test_the_home_page_and_a_guide_render_in_chromium(built_site, tmp_path, aiohttp_server):
    site = SiteServer(built_site)
    server = await aiohttp_server(site.app(), host="127.0.0.1")
    base = f"http://127.0.0.1:{server.port}/"
    async with chromium(tmp_path) as browser:
        home = await asyncio.wait_for(open_page(browser, base), PAGE_DEADLINE_S * 2)
        guide = await asyncio.wait_for(open_page(browser, base + "AUTOPILOT/"), PAGE_DEADLINE_S * 2)
    assert_rendered(home, base, title="pd-router", images_at_least=1)
    assert any("architecture.svg" in i["src"] for i in home["images"])
    assert_rendered(guide, base, title="autopilot", images_at_least=2)
    assert "autopilot" in guide["h1"].lower()
    # the site itself answered every one of them: its pages, the theme's assets, the images
    assert {path for path, status in site.served if status >= 400} == set(), site.served
    served = {path for path, _ in site.served}
    assert {"/", "/AUTOPILOT/", "/img/architecture.svg", "/img/workload_suite.svg"} <= served, served
    assert any(path.endswith(".css") for path in served) and any(path.endswith(".js") for path in served)


def test_a_missing_image_is_caught(tmp_path):
    """assert_rendered fails on a page whose image did not load, or whose request failed or left the site."""
    base = "http://127.0.0.1:1/"
    page = {"title": "pd-router", "h1": "", "nav_links": 40, "tabs": ["Home", "Guides", "Reference", "Benchmarks"],
            "stylesheets": 2, "material_styled": "sticky", "statuses": {"1": 200}, "failed": [],
            "requests": {"1": base}, "images": [{"src": base + "img/a.svg", "loaded": True}]}
    assert_rendered(page, base, title="pd-router", images_at_least=1)
    for broken in ({"images": [{"src": base + "img/a.svg", "loaded": False}]},
                   {"failed": [(base + "x.js", "net::ERR_FAILED")]},
                   {"statuses": {"1": 404}},
                   {"requests": {"1": base, "2": "https://fonts.googleapis.com/css"}}):
        with pytest.raises(AssertionError):
            assert_rendered({**page, **broken}, base, title="pd-router", images_at_least=1)


def test_the_site_config_loads_nothing_from_outside():
    """Material's default pulls web fonts from Google: the site turns them off (it must render offline)."""
    text = (ROOT / "mkdocs.yml").read_text()
    assert "font: false" in text and "strict: true" in text
    assert json.dumps(text).count("googleapis") == 0
