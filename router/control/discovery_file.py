"""`--discovery-file`: workers listed in a YAML or JSON file that the router polls.

    workers:
      - url: http://10.0.0.1:30000
        worker_type: prefill          # or role; absent: the server's live role
        bootstrap_port: 8998          # absent: the server's own; null: decode's default
      - url: http://10.0.0.2:30000
        worker_type: decode
      - http://10.0.0.3:30000         # a bare URL: role and port read from the server

An entry is the body of `POST /workers` (SMG's and sgl-router's worker API); a bare list of entries is read
the same. The file is looked at every `--discovery-interval-secs` (its size, modification time and inode:
no inotify) and read again when they change; a rename over it (an atomic write, a Kubernetes ConfigMap
update) is seen the same way. A file that cannot be read or parsed, an empty one, or one with any bad entry
changes nothing: the workers of its last good version stay, and the error is logged and shown by
`GET /admin/discovery` until a good version is read. `workers: []` lists none (every worker it registered
is removed). SMG's manifest, `{"version": 1, "workers": [...]}` (entries may name themselves: `id`), is
read the same; another version is refused.

YAML needs PyYAML (`pip install 'pd-router[yaml]'`); a `.json` file, or JSON in any file, needs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Awaitable, Callable

import orjson

from router.control.worker_sources import Listing, ListingError, SourceReconciler, listing_of

logger = logging.getLogger(__name__)

try:
    import yaml
except ImportError:  # YAML is optional; JSON always works
    yaml = None


def load_document(raw: bytes, path: str) -> object:
    if path.endswith(".json") or yaml is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            hint = "" if path.endswith(".json") else " (YAML needs PyYAML: pip install 'pd-router[yaml]')"
            raise ListingError([f"not valid JSON{hint}: {exc}"]) from None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ListingError([f"not valid YAML: {' '.join(str(exc).split())}"]) from None


# SMG 1.13's manifest (`--discovery-provider file`): `{"version": 1, "workers": [...]}`, each entry one of its
# `ManifestWorker`s (id, url, worker_type, bootstrap_port, model_id, kv_connector, kv_role, kv_engine_id); SMG
# refuses any other version ("this gateway reads version 1")
MANIFEST_VERSION = 1


def parse_worker_file(raw: bytes, path: str) -> dict[str, Listing]:
    if not raw.strip():
        raise ListingError(["the file is empty (`workers: []` lists no worker)"])
    document = load_document(raw, path)
    if isinstance(document, dict):
        extra = sorted(str(key) for key in document if key not in ("workers", "version"))
        if extra:
            raise ListingError([f"unknown top-level key(s) {', '.join(extra)}: the file holds `workers:` (and "
                                f"SMG's manifest `version: {MANIFEST_VERSION}`) only"])
        if "version" in document:
            version = document["version"]
            if type(version) is not int or version != MANIFEST_VERSION:
                raise ListingError([f"unsupported manifest version {version!r}: pd-router reads SMG's manifest "
                                    f"version {MANIFEST_VERSION}"])
        document = document.get("workers")
    if not isinstance(document, list):
        raise ListingError([f"expected `workers:` with a list of workers, or a list, got {type(document).__name__}"
                            " (`workers: []` lists no worker)"])
    return listing_of([_without_manifest_id(entry) for entry in document], "workers")


def _without_manifest_id(entry: object) -> object:
    """An SMG manifest entry names itself (`id`, a string); the registry's worker ids are its own, so the name
    is checked and dropped (a non-string id is left for the entry's parse to refuse, naming it)."""
    if isinstance(entry, dict) and isinstance(entry.get("id"), str):
        return {key: value for key, value in entry.items() if key != "id"}
    return entry


def stamp_of(path: str) -> tuple[int, int, int, int]:
    """What changes when the file is written or replaced (follows symlinks, as a ConfigMap mount needs)."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size, stat.st_ino, stat.st_dev


class WorkerFile:
    kind = "file"

    def __init__(self, path: str, reconciler: SourceReconciler, *, interval_secs: float, retry_secs: float) -> None:
        self.path = path
        self.reconciler = reconciler
        self.interval_secs = interval_secs
        self.retry_secs = retry_secs
        self._stamp: tuple | None = None
        self._raw: bytes | None = None  # the content last parsed (good or bad)
        self._task: asyncio.Task | None = None

    def _read_if_changed(self) -> bytes | None:
        stamp = stamp_of(self.path)
        if stamp == self._stamp:
            return None
        with open(self.path, "rb") as f:
            raw = f.read()
        self._stamp = stamp
        return raw

    async def check(self, *, read: bool = True) -> None:
        """Look at the file once; apply a new good version."""
        try:
            raw = await asyncio.to_thread(self._read_if_changed)
        except OSError as exc:
            self._stamp = self._raw = None  # read it whole when it is back
            self.reconciler.refuse(f"cannot read {self.path}: {exc.strerror or exc}")
            return
        if raw is None or raw == self._raw:
            return
        self._raw = raw
        try:
            listing = parse_worker_file(raw, self.path)
        except ListingError as exc:
            self.reconciler.refuse(f"{self.path} refused: {'; '.join(exc.problems)}")
            return
        await self.reconciler.apply(listing, read=read)

    async def load(self) -> None:
        """The first reading, before the router serves: its workers are read with the command line's."""
        await self.check(read=False)

    def start(self, spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self._task = spawn(self._watch())

    async def _watch(self) -> None:
        retry_at = time.monotonic() + self.retry_secs
        while True:
            await asyncio.sleep(self.interval_secs)
            try:
                await self.check()
                if time.monotonic() >= retry_at:
                    retry_at = time.monotonic() + self.retry_secs
                    await self.reconciler.retry()
            except Exception:  # keep watching: a bug here must not leave the fleet unwatched
                logger.exception("%s: looking at the file failed", self.reconciler.name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": self.path, "interval_secs": self.interval_secs,
                **self.reconciler.to_dict()}
