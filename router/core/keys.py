"""The application keys of core's own types.

Every key is typed (`web.AppKey(name, Type)`) and declared beside its type: the keys below hold core's
objects; a key of an upper layer's object is declared in the module that defines its class (`PROXY` in
`dataplane/proxy.py`, `UPSTREAM` in `control/upstream.py`, `FLEET_CONTROL` in `flows/fleet_control.py`, ...), so one
import gives a handler the key and the type, and core names no layer above it. Only the composition root
(`server/composition.py`) stores objects under them.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from policies import Policy
from router.core.allowlists import WorkerAllowList
from router.core.config import RouterConfig
from router.core.coordination import Coordinator
from router.core.lifecycle import Lifecycle
from router.core.local_resources import DescriptorBudget, LocalResourceErrors
from router.core.registry import Registry
from router.core.states import Role
from router.core.tasks import BackgroundTasks
from router.core.traffic import RequestPathControl

CONFIG = web.AppKey("config", RouterConfig)
REGISTRY = web.AppKey("registry", Registry)
SESSION = web.AppKey("session", aiohttp.ClientSession)  # the control plane's one client session
TASKS = web.AppKey("tasks", BackgroundTasks)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)  # serving, or shutting down
TRAFFIC = web.AppKey("traffic", RequestPathControl)  # the request path as the flows see it
COORDINATOR = web.AppKey("coordinator", Coordinator)  # the other router replicas of the fleet, every role at once
# Each pool's policy (the request path's own: admin views and upkeep read the same objects).
POLICIES: web.AppKey[dict[Role, Policy]] = web.AppKey("policies", dict)
WORKER_ALLOW = web.AppKey("worker_allow", WorkerAllowList)  # --worker-allow
# The router's own resources (core/local_resources.py): what its open-files limit allows, and running out.
DESCRIPTORS = web.AppKey("descriptors", DescriptorBudget)
LOCAL_RESOURCES = web.AppKey("local_resources", LocalResourceErrors)
