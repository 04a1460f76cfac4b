"""Kubernetes pod discovery (--service-discovery) through the real client (kubernetes_asyncio) against an API
server stand-in speaking the protocol it uses (tests/k8s_apiserver.py, with its known differences), the pods'
servers being simulated SGLang servers on distinct loopback addresses (127.0.0.x) sharing one port."""

from __future__ import annotations

import asyncio
import socket

import pytest
from kubernetes_asyncio.config import kube_config

from router.control import kubernetes_pods
from router.control.kubernetes_pods import PodDiscovery, judge_pod
from router.core.config import DISCOVER, HealthConfig, RouterConfig, WorkerSourcesConfig
from router.core.keys import REGISTRY
from router.core.registry import Role, WorkerState
from router.server.app import create_app
from router.server.cli import config_from_args
from simulator.fleet import Fleet

from .helpers import wait_for
from .k8s_apiserver import FakeApiServer, pod
from .sim_support import FAST

PREFILL = {"app": "sglang-prefill"}
DECODE = {"app": "sglang-decode"}
SETTINGS = PodDiscovery({}, PREFILL, DECODE, 30000, "llm")


def shared_port() -> int:
    """A port free on the loopback addresses the pods' servers use."""
    for _ in range(50):
        probe = socket.socket()
        probe.bind(("127.0.0.10", 0))
        port = probe.getsockname()[1]
        probe.close()
        try:
            for last in range(11, 20):
                with socket.socket() as other:
                    other.bind((f"127.0.0.{last}", port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on 127.0.0.10-19")


# ---- what a pod is (pure) -------------------------------------------------------------------------------
@pytest.mark.parametrize("item, listed", [
    (pod("p0", "10.0.0.1", PREFILL), ("http://10.0.0.1:30000", Role.PREFILL, DISCOVER)),
    (pod("d0", "10.0.0.2", DECODE), ("http://10.0.0.2:30000", Role.DECODE, DISCOVER)),
    (pod("p1", "10.0.0.3", PREFILL, annotations={"sglang.ai/bootstrap-port": "8998"}),
     ("http://10.0.0.3:30000", Role.PREFILL, 8998)),
    (pod("p6", "fd00::1", PREFILL), ("http://[fd00::1]:30000", Role.PREFILL, DISCOVER)),
    (pod("p2", "10.0.0.4", PREFILL, ready=False), None),
    (pod("p3", "10.0.0.5", PREFILL, phase="Pending"), None),
    (pod("p4", None, PREFILL), None),
    ({**pod("p5", "10.0.0.6", PREFILL), "metadata": {**pod("p5", "10.0.0.6", PREFILL)["metadata"],
                                                     "deletionTimestamp": "2026-12-02T00:00:00Z"}}, None),
])
def test_a_pod_is_a_worker_while_running_ready_addressed_and_not_deleted(item, listed):
    verdict = judge_pod(item, SETTINGS)
    assert verdict.skipped is None
    got = verdict.listing
    assert (None if got is None else (got.url, got.role, got.bootstrap_port)) == listed


@pytest.mark.parametrize("labels, annotations, says", [
    ({**PREFILL, "x": "1"} | {"app": "sglang-prefill"}, {"sglang.ai/bootstrap-port": "http"}, "is not a port"),
    ({"app": "other"}, {}, "match no selector"),
])
def test_a_pod_that_cannot_be_placed_is_skipped_saying_why(labels, annotations, says):
    verdict = judge_pod(pod("x", "10.0.0.9", labels, annotations=annotations), SETTINGS)
    assert verdict.listing is None and says in verdict.skipped


def test_a_pod_matching_both_pools_is_skipped():
    both = PodDiscovery({}, {"tier": "sglang"}, {"tier": "sglang"}, 30000, None)
    assert "both" in judge_pod(pod("x", "10.0.0.9", {"tier": "sglang"}), both).skipped


def test_with_one_selector_the_servers_live_role_names_the_pool():
    any_role = PodDiscovery({"app": "sglang"}, {}, {}, 30000, None)
    listing = judge_pod(pod("x", "10.0.0.9", {"app": "sglang"}), any_role).listing
    assert (listing.role, listing.bootstrap_port) == (None, DISCOVER)


# ---- a router in front of the stand-in --------------------------------------------------------------------
class Cluster:
    """The API server stand-in, the pods' servers, and a router watching them."""

    def __init__(self, api: FakeApiServer, port: int) -> None:
        self.api = api
        self.port = port
        self.servers: dict[str, Fleet] = {}  # pod name -> its server
        self.client = None

    async def server(self, name: str, role: str, index: int) -> str:
        """Start pod `name`'s server on 127.0.0.<10+index>:port; return its IP."""
        ip = f"127.0.0.{10 + index}"
        overrides = {"port": self.port}
        fleet = Fleet(1 if role == "prefill" else 0, 0 if role == "prefill" else 1, host=ip,
                      prefill_overrides=overrides, decode_overrides=overrides, **FAST)
        self.servers[name] = await fleet.start()
        return ip

    async def add(self, name: str, role: str, index: int, **kw) -> str:
        ip = await self.server(name, role, index)
        await self.api.apply(pod(name, ip, PREFILL if role == "prefill" else DECODE, **kw))
        return f"http://{ip}:{self.port}"

    def workers(self, role: Role | None = None) -> set[str]:
        return {w.url for w in self.client.registry.workers(role) if w.routable}

    async def discovery(self) -> dict:
        resp = await self.client.get("/admin/discovery")
        assert resp.status == 200
        (source,) = (await resp.json())["sources"]
        return source

    async def generate(self) -> dict:
        resp = await self.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status == 200, await resp.text()
        return await resp.json()


@pytest.fixture
async def cluster(aiohttp_client, tmp_path, monkeypatch):
    api = await FakeApiServer().start()
    kubeconfig = str(api.kubeconfig(tmp_path / "kubeconfig"))
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    # the client reads $KUBECONFIG once, when imported (this module imported it already)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    # watches end every 2 s (the API server's timeoutSeconds): each is resumed from its resourceVersion, so every
    # test also runs through many resumed watches, and no watch waits long on a connection that broke
    monkeypatch.setattr(kubernetes_pods, "WATCH_TIMEOUT_S", 2)
    state = Cluster(api, shared_port())

    async def start_router(**sources):
        settings = {**dict(service_discovery=True, prefill_selector=("app=sglang-prefill",),
                           decode_selector=("app=sglang-decode",), service_discovery_port=state.port,
                           service_discovery_namespace="llm"), **sources}
        config = RouterConfig(worker_sources=WorkerSourcesConfig(**settings),
                              health=HealthConfig(interval_secs=0.2)).validated()
        state.client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        state.client.registry = state.client.app[REGISTRY]
        return state.client

    state.start_router = start_router
    yield state
    for fleet in state.servers.values():
        await fleet.stop()
    await api.stop()


async def test_pods_are_workers_through_ready_unready_label_change_and_delete(cluster):
    p0 = await cluster.add("p0", "prefill", 1)
    d0 = await cluster.add("d0", "decode", 2)
    await cluster.start_router()
    assert cluster.workers(Role.PREFILL) == {p0} and cluster.workers(Role.DECODE) == {d0}  # read before serving
    await cluster.generate()
    source = await cluster.discovery()
    assert source["kind"] == "kubernetes" and source["error"] is None
    assert {(w["pod"], w["status"]) for w in source["workers"]} == {("llm/p0", "registered"),
                                                                   ("llm/d0", "registered")}

    p1 = await cluster.add("p1", "prefill", 3)  # a new pod
    await wait_for(lambda: cluster.workers(Role.PREFILL) == {p0, p1}, message="p1 added")
    await cluster.api.change("p1", ready=False)  # unready: out of routing
    await wait_for(lambda: cluster.workers(Role.PREFILL) == {p0}, message="p1 unready, removed")
    await cluster.api.change("p1", ready=True)  # back: read again, then routed
    await wait_for(lambda: cluster.workers(Role.PREFILL) == {p0, p1}, message="p1 ready again")
    await cluster.api.change("p1", labels={"app": "something-else"})  # stops matching
    await wait_for(lambda: cluster.workers(Role.PREFILL) == {p0}, message="p1 relabelled away")
    await cluster.api.change("p0", deleting=True)  # being deleted: out at once
    await wait_for(lambda: cluster.workers(Role.PREFILL) == set(), message="p0 terminating")
    await cluster.api.delete("p0")
    await cluster.api.change("p1", labels=PREFILL)
    await wait_for(lambda: cluster.workers(Role.PREFILL) == {p1}, message="p1 matches again")
    await cluster.generate()
    assert {w.url for w in cluster.client.registry.workers()} == {p1, d0}


async def test_a_prefills_bootstrap_port_comes_from_its_annotation_and_odd_pods_are_skipped(cluster):
    ip = await cluster.server("p0", "prefill", 1)
    live_port = cluster.servers["p0"].prefill[0].bootstrap_port
    await cluster.api.apply(pod("p0", ip, PREFILL, annotations={"sglang.ai/bootstrap-port": str(live_port)}))
    await cluster.add("d0", "decode", 2)
    await cluster.api.apply(pod("both", "127.0.0.30", {**PREFILL, "role": "x"}, annotations={
        "sglang.ai/bootstrap-port": "nope"}))
    await cluster.start_router()
    (prefill,) = cluster.client.registry.workers(Role.PREFILL)
    assert prefill.bootstrap_port == live_port
    await cluster.generate()
    skipped = (await cluster.discovery())["skipped"]
    assert skipped == [{"pod": "llm/both", "problem": "annotation sglang.ai/bootstrap-port='nope' is not a port"}]


async def test_an_api_server_outage_keeps_the_workers_and_says_so(cluster):
    p0 = await cluster.add("p0", "prefill", 1)
    d0 = await cluster.add("d0", "decode", 2)
    await cluster.start_router()
    cluster.api.down = True
    await cluster.api.cut_watches()

    async def said() -> bool:
        return "503" in ((await cluster.discovery())["error"] or "")

    await wait_for(said, timeout=10, message="the outage shown")
    assert cluster.workers() == {p0, d0}  # never emptied by the outage
    await cluster.generate()  # served meanwhile


async def test_rbac_forbidden_names_the_missing_permission(cluster):
    cluster.api.forbidden = True
    await cluster.start_router()
    source = await cluster.discovery()
    assert "forbidden (RBAC)" in source["error"] and "list/watch pods in namespace llm" in source["error"]
    assert "grant list and watch on pods" in source["error"]
    assert cluster.client.registry.workers() == []


async def test_a_converted_pod_keeps_its_live_pool_across_events_and_re_lists(cluster):
    """Its labels still name the old pool: the live role wins, no flap back on the watch's events."""
    p0 = await cluster.add("p0", "prefill", 1)
    p1 = await cluster.add("p1", "prefill", 2)
    d0 = await cluster.add("d0", "decode", 3)
    await cluster.start_router()
    worker = cluster.client.registry.get(p1)
    resp = await cluster.client.post(f"/admin/workers/{worker.id}/convert", json={"timeout_s": 30})
    assert resp.status == 200, await resp.text()
    await wait_for(lambda: cluster.workers(Role.DECODE) == {d0, p1}, timeout=20, message="p1 converted to decode")
    await cluster.api.change("p1", annotations={"note": "touched"})  # a watch event about it
    await cluster.add("d1", "decode", 4)  # and a later one, applied after it
    await wait_for(lambda: len(cluster.workers(Role.DECODE)) == 3, message="the later event applied")
    assert cluster.workers(Role.PREFILL) == {p0} and p1 in cluster.workers(Role.DECODE)
    assert cluster.client.registry.get(p1) is worker and worker.state is WorkerState.ACTIVE
    await cluster.generate()


async def test_an_expired_watch_is_listed_again_keeping_the_workers(cluster):
    """410 Gone: the router lists again (it cannot resume), sees what changed meanwhile, and no worker is
    dropped and registered again on the way."""
    p0 = await cluster.add("p0", "prefill", 1)
    d0 = await cluster.add("d0", "decode", 2)
    await cluster.start_router()
    kept = {url: cluster.client.registry.get(url) for url in (p0, d0)}
    await wait_for(lambda: cluster.api.watches_open() == 2, message="both selectors watched")
    lists = sum(r.startswith("list") for r in cluster.api.requests)
    cluster.api.delivering.clear()  # the open watches see nothing of what follows ...
    p1 = await cluster.add("p1", "prefill", 3)
    await cluster.api.change("d0", annotations={"note": "touched"})
    cluster.api.compact()  # ... and it is forgotten: resuming from their versions is 410 Gone
    cluster.api.delivering.set()
    await wait_for(lambda: cluster.workers(Role.PREFILL) == {p0, p1}, message="p1 seen by a new list")
    assert cluster.api.expired >= 1 and sum(r.startswith("list") for r in cluster.api.requests) > lists
    assert all(cluster.client.registry.get(url) is worker for url, worker in kept.items())
    assert (await cluster.discovery())["error"] is None
    await cluster.generate()


async def test_after_an_api_server_outage_the_router_catches_up(cluster):
    """What changed while the API server was down is applied once it answers again; the error is cleared."""
    p0 = await cluster.add("p0", "prefill", 1)
    d0 = await cluster.add("d0", "decode", 2)
    await cluster.start_router()
    cluster.api.down = True
    await cluster.api.cut_watches()

    async def error() -> str | None:
        return (await cluster.discovery())["error"]

    await wait_for(error, timeout=10, message="the outage shown")
    p1 = await cluster.add("p1", "prefill", 3)  # while it is down
    await cluster.api.delete("d0")
    d1 = await cluster.add("d1", "decode", 4)
    assert cluster.workers() == {p0, d0}
    cluster.api.down = False
    await wait_for(lambda: cluster.workers() == {p0, p1, d1}, timeout=15, message="the changes applied")
    assert await error() is None
    await cluster.generate()


@pytest.mark.timeout(30)  # the bug this guards against holds the event loop: only the timeout's signal ends it
async def test_one_selector_listing_again_does_not_hold_the_router(cluster):
    """While one selector's list is under way the others' changes wait for it (the listing is applied whole),
    and the router serves meanwhile: the applier, woken by a change it may not apply yet, must not spin."""
    p0 = await cluster.add("p0", "prefill", 1)
    d0 = await cluster.add("d0", "decode", 2)
    await cluster.start_router()
    await wait_for(lambda: cluster.api.watches_open() == 2, message="both selectors watched")
    cluster.api.held = "app=sglang-decode"
    lists = len(cluster.api.requests)
    await cluster.api.cut_watches()  # both selectors listed again; the decode one's list waits
    await wait_for(lambda: any(r.startswith("list") and "sglang-decode" in r for r in cluster.api.requests[lists:]),
                   message="the decode selector listed again")
    p1 = await cluster.add("p1", "prefill", 3)
    seen = str(cluster.api.version)

    async def prefill_selector_saw_p1() -> bool:
        return (await cluster.discovery())["resource_versions"]["app=sglang-prefill"] == seen

    await wait_for(prefill_selector_saw_p1, message="the prefill selector's list or watch saw p1")
    await cluster.generate()  # served while the list is held
    assert cluster.workers() == {p0, d0}
    cluster.api.release.set()
    await wait_for(lambda: cluster.workers() == {p0, p1, d0}, message="p1 applied once every selector listed")


async def test_every_call_to_the_api_server_has_a_deadline(cluster, monkeypatch):
    """A list that never answers and a watch that goes silent (a half-open connection: no data, no end) are
    given up at their deadline, the workers kept; what changed meanwhile is then listed."""
    monkeypatch.setattr(kubernetes_pods, "REQUEST_TIMEOUT_S", 1)
    monkeypatch.setattr(kubernetes_pods, "WATCH_TIMEOUT_S", 1)  # a watch's deadline: 2 s
    monkeypatch.setattr(kubernetes_pods, "BACKOFF_S", (0.1, 0.5))  # the deadlines under test, not the backoff
    p0 = await cluster.add("p0", "prefill", 1)
    d0 = await cluster.add("d0", "decode", 2)
    await cluster.start_router()
    await wait_for(lambda: cluster.api.watches_open() == 2, message="both selectors watched")
    cluster.api.silent = True
    await cluster.api.cut_watches()  # listed again, then watched through silent connections
    await wait_for(lambda: cluster.api.silenced == 2, message="both selectors listed, then watched silently")
    p1 = await cluster.add("p1", "prefill", 3)  # no watch will tell: only a list after a watch's deadline
    await wait_for(lambda: cluster.workers(Role.PREFILL) == {p0, p1}, timeout=10, message="p1 listed")
    cluster.api.silent = False

    cluster.api.held = "app=sglang-decode"  # a list that never answers
    await cluster.api.cut_watches()

    async def said() -> str:
        return (await cluster.discovery())["error"] or ""

    await wait_for(said, timeout=10, message="the list's deadline said")
    assert "did not answer in time" in await said()
    assert cluster.workers() == {p0, p1, d0}
    cluster.api.release.set()

    async def cleared() -> bool:
        return await said() == ""

    await wait_for(cleared, timeout=15, message="listed again once it answers")
    await cluster.generate()


def test_a_selector_written_as_kubectl_writes_it_is_the_same_selector():
    """`app=sglang,role=prefill` (kubectl's -l form) is two labels, as `app=sglang role=prefill` is: read as one,
    the value `sglang,role=prefill` matches no pod (no label value holds a comma) and every pod is skipped."""
    sources = config_from_args(["--pd-disaggregation", "--service-discovery", "--prefill-selector",
                                "app=sglang,role=prefill", "--decode-selector", "app=sglang", "role=decode"],
                               env={}).worker_sources
    settings = PodDiscovery.of(sources)
    assert settings.prefill_selector == {"app": "sglang", "role": "prefill"}
    assert settings.decode_selector == {"app": "sglang", "role": "decode"}
    listing = judge_pod(pod("p0", "10.0.0.1", {"app": "sglang", "role": "prefill"}), settings).listing
    assert listing is not None and listing.role is Role.PREFILL
