"""`--service-discovery` (SMG: `--discovery-provider kubernetes`): the pods that match a label selector are workers.

sgl-router's and SMG's flags, with their meanings: `--prefill-selector` / `--decode-selector` (PD pools; or
`--selector`, whose pods join the pool of their server's live role), `--service-discovery-port` (each pod's
worker port, 80), `--service-discovery-namespace` (absent: every namespace), `--bootstrap-port-annotation`
(`sglang.ai/bootstrap-port`: a prefill's bootstrap port; absent, read from the server as for any worker).

A pod is a worker while it matches a selector, is `Running` with condition `Ready` true, has a pod IP and is not
being deleted: `http://{podIP}:{port}`. It is listed under the pool of the selector it matched; one that matches
both, or neither, is left out (one warning naming it, and a `skipped` entry in `GET /admin/discovery`). What the
listing says goes through the same `SourceReconciler` as `--discovery-file` and etcd discovery (registration as
`POST /workers`, removal as `DELETE /workers`: requests in flight finish; removed through the API stays removed).

The live role wins over the labels: a listed pool is the registration's hint, and the server's own role decides
(as for any registration). A pod whose server pd-router converted keeps its listing (its labels did not change), so
the reconciler leaves the converted worker where it is across watch events and re-lists, and a restarted router
reads the live role again at registration: no flap back. pd-router writes nothing to the pods (it needs list
and watch on pods only; docs/KUBERNETES.md).

Faults: each selector is listed, then watched from the list's resourceVersion (with bookmarks); a watch that
ends is resumed from the last version seen, one that expired (410 Gone) is replaced by a fresh list. While the
API server cannot be read (unreachable, slow, 5xx) the last listing stands, the error is logged and shown by
`GET /admin/discovery`, and the list is tried again with a capped backoff: an API server outage never empties a
pool. A 403 names the permission the service account lacks. Events are applied in batches by one task, so a
churn of pods costs the request path nothing.

The client is kubernetes_asyncio (`pip install 'pd-router[k8s]'`): it speaks aiohttp, the router's own HTTP
stack (lightkube and kr8s bring httpx and its own pool), loads in-cluster (service account) and kubeconfig
configuration, and its watch keeps resourceVersions and raises 410 as `ApiException`. Imported only here, only
when pod discovery is asked for (about 1 s of import).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import orjson

from router.control.worker_sources import Listing, SourceReconciler
from router.core.config import DISCOVER, WorkerSourcesConfig, selector_labels
from router.core.registry import Role

logger = logging.getLogger(__name__)

try:
    from kubernetes_asyncio import client as k8s_client
    from kubernetes_asyncio import config as k8s_config
    from kubernetes_asyncio import watch as k8s_watch
    from kubernetes_asyncio.client.exceptions import ApiException
except ImportError:  # optional: refused with one line at start-up (server/source_builder.py)
    k8s_client = None

MISSING_CLIENT = ("--service-discovery needs the Kubernetes client: pip install 'pd-router[k8s]' "
                  "(kubernetes_asyncio)")
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this long; it is resumed from its resourceVersion
BACKOFF_S = (0.5, 10.0)  # a failed list is tried again after 0.5 s, doubling up to 10 s (client-go: 30)
REQUEST_TIMEOUT_S = 10.0  # one list call


@dataclass(frozen=True, slots=True)
class PodDiscovery:
    """The flags' settings as the watch reads them (selectors as label maps)."""

    selector: dict[str, str]
    prefill_selector: dict[str, str]
    decode_selector: dict[str, str]
    port: int = 80
    namespace: str | None = None  # None: every namespace
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"

    @classmethod
    def of(cls, sources: WorkerSourcesConfig) -> "PodDiscovery":
        return cls(selector_labels(sources.selector)[0], selector_labels(sources.prefill_selector)[0],
                   selector_labels(sources.decode_selector)[0], sources.service_discovery_port,
                   sources.service_discovery_namespace or None, sources.bootstrap_port_annotation)


@dataclass(frozen=True, slots=True)
class PodVerdict:
    """What one pod is to pd-router: a listing, or why it is not one."""

    name: str  # namespace/name
    listing: Listing | None = None
    skipped: str | None = None  # why a pod that matched a selector is not a worker (shown; warned once)


def selector_text(selector: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(selector.items()))


def _matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def judge_pod(pod: dict, settings: PodDiscovery) -> PodVerdict:
    """Pure: whether `pod` (the API's JSON object) is a worker now, with what role hint and bootstrap port."""
    meta = pod.get("metadata") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    labels = meta.get("labels") or {}
    pools = [role for role, selector in ((Role.PREFILL, settings.prefill_selector),
                                         (Role.DECODE, settings.decode_selector)) if _matches(labels, selector)]
    general = _matches(labels, settings.selector)
    if len(pools) == 2:
        return PodVerdict(name, skipped="its labels match both --prefill-selector and --decode-selector")
    if not pools and not general:
        return PodVerdict(name, skipped="its labels match no selector")
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return PodVerdict(name)  # being deleted: out of routing
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ready or not ip:
        return PodVerdict(name)  # not serving (yet): not listed
    role = pools[0] if pools else None
    port: Any = DISCOVER
    annotation = (meta.get("annotations") or {}).get(settings.bootstrap_port_annotation)
    if annotation is not None and role is not Role.DECODE:
        if not (annotation.isdigit() and 1 <= int(annotation) <= 65535):
            return PodVerdict(name, skipped=f"annotation {settings.bootstrap_port_annotation}={annotation!r} is "
                                            f"not a port")
        port = int(annotation)
    host = f"[{ip}]" if ":" in ip else ip
    return PodVerdict(name, Listing(f"http://{host}:{settings.port}", role, port))


class SelectorWatch:
    """One label selector's pods, listed then watched (resourceVersion, bookmarks, 410: listed again)."""

    def __init__(self, api: Any, namespace: str | None, selector: dict[str, str],
                 changed: Callable[[], None]) -> None:
        self.api = api
        self.namespace = namespace
        self.selector = selector_text(selector)
        self.pods: dict[str, dict] = {}  # uid -> pod, as last seen
        self.version: str | None = None  # resourceVersion to watch from
        self.listed = False
        self._changed = changed

    def _call(self, **kwargs: Any):
        if self.namespace:
            return self.api.list_namespaced_pod, (self.namespace,), kwargs
        return self.api.list_pod_for_all_namespaces, (), kwargs

    async def list(self) -> None:
        func, args, kwargs = self._call(label_selector=self.selector, _preload_content=False,
                                        _request_timeout=REQUEST_TIMEOUT_S)
        async with asyncio.timeout(REQUEST_TIMEOUT_S):  # the client's own bound does not cover its connect
            resp = await func(*args, **kwargs)  # the raw answer: no model objects built for a list
            try:
                raw = await resp.read()
            finally:
                resp.release()
        if not 200 <= resp.status <= 299:  # (the client raises only for answers it reads itself)
            status = orjson.loads(raw) if raw.startswith(b"{") else {}
            raise ApiException(status=resp.status, reason=f"{status.get('reason', '')}: {status.get('message', '')}")
        body = orjson.loads(raw)
        self.pods = {_uid(p): p for p in body.get("items") or ()}
        self.version = (body.get("metadata") or {}).get("resourceVersion")
        self.listed = True
        self._changed()

    async def watch(self) -> None:
        """Follow the changes from `version` until the stream ends (returns) or fails (raises; 410: ApiException
        with status 410)."""
        stream = k8s_watch.Watch(return_type="object")  # raw JSON objects: no models built per event
        func, args, kwargs = self._call(label_selector=self.selector, resource_version=self.version,
                                        allow_watch_bookmarks=True, timeout_seconds=WATCH_TIMEOUT_S,
                                        _request_timeout=WATCH_TIMEOUT_S + REQUEST_TIMEOUT_S)
        # a watch never outlives its own deadline, whatever its connection does (then resumed or listed again)
        async with asyncio.timeout(WATCH_TIMEOUT_S + REQUEST_TIMEOUT_S), stream:
            async for event in stream.stream(func, *args, **kwargs):
                kind, pod = event["type"], event["raw_object"]
                self.version = (pod.get("metadata") or {}).get("resourceVersion") or self.version
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self.pods.pop(_uid(pod), None)
                else:  # ADDED, MODIFIED
                    self.pods[_uid(pod)] = pod
                self._changed()


def _uid(pod: dict) -> str:
    meta = pod.get("metadata") or {}
    return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"


class PodWorkerSource:
    """The worker source of `--service-discovery`: the pods of its selectors, kept in the registry."""

    kind = "kubernetes"

    def __init__(self, settings: PodDiscovery, reconciler: SourceReconciler, *,
                 retry_secs: float, startup_timeout: float) -> None:
        self.settings = settings
        self.reconciler = reconciler
        self.retry_secs = retry_secs
        self.startup_timeout = startup_timeout
        self._api_client: Any = None
        self.watches: list[SelectorWatch] = []
        self.verdicts: dict[str, PodVerdict] = {}  # namespace/name -> verdict, at the last apply
        self._warned: set[tuple[str, str]] = set()
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.connected_since: float | None = None

    # ---- the client --------------------------------------------------------------------------------
    async def _connect(self) -> None:
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)  # a pod's service account
        except k8s_config.ConfigException:
            await k8s_config.load_kube_config(client_configuration=configuration)  # $KUBECONFIG, ~/.kube/config
        self._api_client = k8s_client.ApiClient(configuration)
        api = k8s_client.CoreV1Api(self._api_client)
        selectors = [s for s in (self.settings.prefill_selector, self.settings.decode_selector,
                                 self.settings.selector) if s]
        self.watches = [SelectorWatch(api, self.settings.namespace, s, self._dirty.set) for s in selectors]

    # ---- the listing -------------------------------------------------------------------------------
    def listing(self) -> dict[str, Listing]:
        """Every selector's pods as one listing (a pod seen by two selectors is judged once, on all its labels)."""
        pods: dict[str, dict] = {}
        for watch in self.watches:
            pods.update(watch.pods)
        verdicts = [judge_pod(pod, self.settings) for pod in pods.values()]
        self.verdicts = {v.name: v for v in verdicts}
        listing: dict[str, Listing] = {}
        for verdict in verdicts:
            if verdict.skipped is not None:
                if (verdict.name, verdict.skipped) not in self._warned:
                    self._warned.add((verdict.name, verdict.skipped))
                    logger.warning("%s: pod %s skipped: %s", self.reconciler.name, verdict.name, verdict.skipped)
            elif verdict.listing is not None:
                listing[verdict.listing.url] = verdict.listing
        return listing

    async def _apply(self, read: bool) -> None:
        self._dirty.clear()
        await self.reconciler.apply(self.listing(), read=read)

    # ---- WorkerSource --------------------------------------------------------------------------------
    async def load(self) -> None:
        """The first listing, before the router serves (its pods are read with the command line's workers).
        An API server that cannot be read now leaves the pools empty until it can (said in the log)."""
        if k8s_client is None:
            raise RuntimeError(MISSING_CLIENT)
        try:
            await self._connect()
            async with asyncio.timeout(self.startup_timeout):
                await asyncio.gather(*(watch.list() for watch in self.watches))
        except Exception as exc:  # listed again by the watch loops
            self.reconciler.refuse(describe_failure(exc, self.settings))
            return
        self.connected_since = time.time()
        await self._apply(read=False)

    def start(self, spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self._tasks = [spawn(self._follow(watch)) for watch in self.watches]
        self._tasks.append(spawn(self._applier()))

    async def _follow(self, watch: SelectorWatch) -> None:
        """List, then watch from the list's version; resume a watch that ends, list again one that expired or
        broke (the pods as last listed stand meanwhile), with a capped backoff while the API server fails."""
        backoff = BACKOFF_S[0]
        while True:
            try:
                if not watch.listed:
                    await watch.list()  # applied by the applier, which clears the source's error
                    self.connected_since = self.connected_since or time.time()
                await watch.watch()  # returns when the API server ends it: resumed from its version
                backoff = BACKOFF_S[0]
                continue
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:  # expired: list again at once, the pods kept until then
                    logger.info("%s: watch of %s expired (410 Gone): listing again", self.reconciler.name,
                                watch.selector)
                    watch.listed = False
                    continue
                self.reconciler.refuse(describe_failure(exc, self.settings))
            except Exception as exc:
                if watch.listed:  # the watch broke (a cut connection): listed again after the backoff
                    logger.info("%s: watch of %s broke (%s: %s): listing again", self.reconciler.name,
                                watch.selector, type(exc).__name__, exc)
                else:
                    self.reconciler.refuse(describe_failure(exc, self.settings))
            watch.listed = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_S[1])

    async def _applier(self) -> None:
        """Applies the pods' changes, a batch at a time; retries entries that waited (a busy worker)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.retry_secs):
                    await self._dirty.wait()
            try:
                if self._dirty.is_set() and all(w.listed for w in self.watches):
                    await self._apply(read=True)
                else:
                    # a selector being listed again: its list sets the flag when done. Left set, the wait above
                    # would return at once, and retry() awaits nothing when nothing waits: this loop would hold
                    # the event loop for ever, the router's requests and that very list with it
                    self._dirty.clear()
                    await self.reconciler.retry()
            except Exception:  # keep applying: a bug here must not leave the fleet unwatched
                logger.exception("%s: applying the pods failed", self.reconciler.name)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._api_client is not None:
            await self._api_client.close()

    def to_dict(self) -> dict:
        state = self.reconciler.to_dict()
        skipped = [{"pod": v.name, "problem": v.skipped} for v in self.verdicts.values() if v.skipped]
        by_url = {v.listing.url: v.name for v in self.verdicts.values() if v.listing is not None}
        for entry in state["workers"]:
            entry["pod"] = by_url.get(entry["url"])
        return {"kind": self.kind, "namespace": self.settings.namespace or "(all namespaces)",
                "selectors": {"prefill": selector_text(self.settings.prefill_selector),
                              "decode": selector_text(self.settings.decode_selector),
                              "any": selector_text(self.settings.selector)},
                "port": self.settings.port, "bootstrap_port_annotation": self.settings.bootstrap_port_annotation,
                "resource_versions": {w.selector: w.version for w in self.watches},
                "skipped": skipped, **state}


def describe_failure(exc: BaseException, settings: PodDiscovery) -> str:
    """One line for the log and /admin/discovery: a 403 names the permission the service account lacks."""
    where = f"in namespace {settings.namespace}" if settings.namespace else "in all namespaces (a ClusterRole)"
    if k8s_client is not None and isinstance(exc, ApiException):
        if exc.status == 403:
            return (f"forbidden (RBAC): the service account may not list/watch pods {where}: grant list and "
                    f"watch on pods (deploy/kubernetes/pod-discovery/rbac.yaml)")
        if exc.status == 401:
            return "unauthorized: the API server refused the credentials"
        return f"the API server answered {exc.status} ({(exc.reason or '').strip()[:200]}); trying again"
    if isinstance(exc, TimeoutError):
        return "the API server did not answer in time; trying again"
    return f"the API server cannot be reached ({type(exc).__name__}: {str(exc)[:200]}); trying again"
