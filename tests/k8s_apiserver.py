"""A Kubernetes API server stand-in for pod discovery's tests: no kube-apiserver can be installed here, so this
aiohttp server speaks the part of the real protocol that kubernetes_asyncio (the router's client) uses on pods:

- `GET /api/v1/pods` and `GET /api/v1/namespaces/{ns}/pods` with `labelSelector` (equality terms, comma-joined):
  a `PodList` whose `metadata.resourceVersion` is the store's version;
- the same with `watch=true`: a chunked stream of JSON lines `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR,
  "object": ...}` from `resourceVersion` on (an event per change, as the real server sends), a `BOOKMARK` when
  `allowWatchBookmarks` is set and a stream has been quiet, the end of the stream after `timeoutSeconds`;
- a `resourceVersion` older than the compacted history: an `ERROR` event with a `Status` of code 410 (`Expired`,
  "too old resource version"), as the real server answers a watch;
- RBAC: 403 with a `Status` body (`Forbidden`, the verb and resource named) while `forbidden` is set, or
  for a verb that the rules in `roles` do not grant (a test loads them from deploy/'s Role);
- an outage: 503 `Status` bodies while `down` is set (open watches are cut);
- a slow list: the lists of the selector `held` names wait until `release` is set; a silent watch: while
  `silent` is set, a watch opened sends nothing and never ends (a half-open connection after a partition).

Known differences from a real API server: label selectors are equality terms only (no set-based `in`, `!=`);
one store version for every namespace and no field selectors; no authentication (any bearer token passes);
bookmarks are sent after one quiet second instead of the server's own cadence; a pod's status is what the
test writes (no kubelet), and deletion is immediate unless the test sets `deletionTimestamp` first.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from pathlib import Path

import orjson
from aiohttp import web

BOOKMARK_AFTER_S = 1.0


def pod(name: str, ip: str | None, labels: dict[str, str], *, namespace: str = "llm", ready: bool = True,
        phase: str = "Running", annotations: dict[str, str] | None = None) -> dict:
    """A pod object as the API serves it (the fields pod discovery reads, and a few others)."""
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}", "labels": dict(labels),
                     "annotations": dict(annotations or {}), "creationTimestamp": "2026-12-02T00:00:00Z"},
        "spec": {"containers": [{"name": "sglang", "image": "lmsysorg/sglang:v0.5.23"}]},
        "status": {"phase": phase, "podIP": ip, "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _selected(item: dict, selector: str | None) -> bool:
    labels = item["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value.lstrip("="):
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeApiServer:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict] = {}
        self.version = 1
        self.history: list[tuple[int, str, dict]] = []  # (version, type, object) of every change
        self.compacted = 0  # versions up to this one are gone: a watch from them gets 410
        self.forbidden = False
        # RBAC as the API server's authorizer applies it, while set: (namespace, rules) of each role bound to the
        # caller, namespace None for a ClusterRole (every namespace); a Role grants in its own namespace only
        self.roles: list[tuple[str | None, list[dict]]] | None = None
        self.down = False
        self.expired = 0  # 410 ERROR events sent
        self.held: str | None = None  # a label selector whose lists wait until `release` is set
        self.release = asyncio.Event()
        self.silent = False  # watches opened while set send nothing, ever (a connection gone quiet)
        self.silenced = 0  # watches that went silent so far
        self.requests: list[str] = []  # "list <path>?<query>" / "watch ..." as they came
        self._changed = asyncio.Event()  # set (and replaced) at each change: what open watches wait on
        self.delivering = asyncio.Event()  # cleared: open watches send nothing (changes wait in the history)
        self.delivering.set()
        self._watches: dict[int, web.Request] = {}  # the open watches' requests, by id
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ---- the server ------------------------------------------------------------------------------------
    async def start(self, port: int = 0) -> "FakeApiServer":
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            self.down = True  # a watcher still running gets 503s, not a server waiting on its open streams
            await self.cut_watches()
            await self._runner.cleanup()
            self._runner = None

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server, as `kubectl config` writes one."""
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
            f"clusters:\n- name: test\n  cluster:\n    server: {self.url}\n"
            "contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n"
            "users:\n- name: test\n  user:\n    token: not-checked\n")
        return path

    # ---- what the tests change ---------------------------------------------------------------------------
    async def _record(self, kind: str, item: dict) -> None:
        self.version += 1
        item["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, kind, copy.deepcopy(item)))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def apply(self, item: dict) -> None:
        """Create or replace a pod (ADDED or MODIFIED)."""
        key = (item["metadata"]["namespace"], item["metadata"]["name"])
        kind = "MODIFIED" if key in self.pods else "ADDED"
        self.pods[key] = copy.deepcopy(item)
        await self._record(kind, self.pods[key])

    async def change(self, name: str, namespace: str = "llm", **changes) -> dict:
        """Change a pod: `labels=`, `annotations=`, `ready=`, `ip=`, `deleting=True` (deletionTimestamp)."""
        item = self.pods[(namespace, name)]
        meta, status = item["metadata"], item["status"]
        if "labels" in changes:
            meta["labels"] = dict(changes["labels"])
        if "annotations" in changes:
            meta["annotations"] = dict(changes["annotations"])
        if "ready" in changes:
            for condition in status["conditions"]:
                if condition["type"] == "Ready":
                    condition["status"] = "True" if changes["ready"] else "False"
        if "ip" in changes:
            status["podIP"] = changes["ip"]
        if changes.get("deleting"):
            meta["deletionTimestamp"] = "2026-12-02T00:01:00Z"
        await self._record("MODIFIED", item)
        return item

    async def delete(self, name: str, namespace: str = "llm") -> None:
        item = self.pods.pop((namespace, name))
        await self._record("DELETED", item)

    def compact(self) -> None:
        """Forget the history so far: a watch resumed from an older version gets 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    async def cut_watches(self) -> None:
        """Close every open watch's connection (as an API server restart does)."""
        for request in list(self._watches.values()):
            if request.transport is not None:
                request.transport.close()

    def watches_open(self) -> int:
        return len(self._watches)

    def _granted(self, verb: str, namespace: str | None) -> bool:
        if self.roles is None:
            return True
        return any((scope is None or scope == namespace)
                   and any(set(rule.get("apiGroups") or ()) & {"", "*"} and set(rule.get("resources") or ()) &
                           {"pods", "*"} and set(rule.get("verbs") or ()) & {verb, "*"} for rule in rules)
                   for scope, rules in self.roles)

    def verbs(self) -> set[str]:
        """The verbs the requests so far asked for on pods (RBAC's names for them)."""
        return {r.split(" ", 1)[0] for r in self.requests}

    # ---- the handlers ------------------------------------------------------------------------------------
    async def _pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        query = request.query
        watching = query.get("watch") in ("true", "1", "True")
        self.requests.append(f"{'watch' if watching else 'list'} {request.path_qs}")
        if self.down:
            return web.json_response(_status(503, "ServiceUnavailable", "the API server is unavailable"),
                                     status=503)
        if self.forbidden or not self._granted("watch" if watching else "list", namespace):
            where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            verb = "watch" if watching else "list"
            return web.json_response(_status(403, "Forbidden", f'pods is forbidden: User "system:serviceaccount:'
                                                               f'llm:pd-router" cannot {verb} resource "pods" in API '
                                                               f'group "" {where}'), status=403)
        selector = query.get("labelSelector")

        def wanted(item: dict) -> bool:
            return (namespace is None or item["metadata"]["namespace"] == namespace) and _selected(item, selector)

        if not watching:
            if selector is not None and selector == self.held:
                await self.release.wait()
            items = [copy.deepcopy(p) for p in self.pods.values() if wanted(p)]
            for item in items:
                item.pop("kind", None)
                item.pop("apiVersion", None)
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items},
                                     dumps=lambda o: orjson.dumps(o).decode())
        return await self._watch(request, wanted)

    async def _watch(self, request: web.Request, wanted) -> web.StreamResponse:
        query = request.query
        since = int(query.get("resourceVersion") or self.version)
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1", "True")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        self._watches[id(request)] = request
        if self.silent:  # not even its timeoutSeconds ends it: only the client's own deadline does
            self.silenced += 1
            try:
                await asyncio.Event().wait()
            finally:
                self._watches.pop(id(request), None)

        async def send(kind: str, item: dict) -> None:
            await response.write(orjson.dumps({"type": kind, "object": item}) + b"\n")

        try:
            deadline = asyncio.get_running_loop().time() + timeout
            seen = since
            shown = {o["metadata"]["uid"] for o in self.pods.values() if wanted(o)}  # what the watcher knows
            for _ in itertools.count():
                await self.delivering.wait()
                if seen < self.compacted:  # what it has not seen yet is gone
                    self.expired += 1
                    await send("ERROR", _status(410, "Expired", f"too old resource version: {seen} "
                                                                f"({self.compacted})"))
                    break
                pending = [(v, k, o) for v, k, o in self.history if v > seen]
                for version, kind, item in pending:
                    seen = version
                    uid = item["metadata"]["uid"]
                    if wanted(item):
                        await send(kind, item)
                        (shown.discard if kind == "DELETED" else shown.add)(uid)
                    elif uid in shown:  # it stopped matching: a watch with a selector says DELETED
                        shown.discard(uid)
                        await send("DELETED", item)
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or self.down:
                    break
                if not any(v > seen for v, _, _ in self.history):
                    try:
                        await asyncio.wait_for(self._changed.wait(), min(left, BOOKMARK_AFTER_S))
                    except TimeoutError:
                        if bookmarks:
                            await send("BOOKMARK", {"kind": "Pod", "apiVersion": "v1",
                                                    "metadata": {"resourceVersion": str(seen)}})
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watches.pop(id(request), None)
        return response
