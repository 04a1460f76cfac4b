"""The simulated fleet (`python -m simulator.fleet`), started in its own process for the sim setup."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench import procs
from bench.ceiling import MODEL_PATH
from bench.contenders import REPO_ROOT
from bench.fleet import Fleet


def parse_fleet_line(line: str) -> Fleet | None:
    """The fleet's JSON announcement, if this line is one.

    Accepts {"prefill": [{"url", "bootstrap_port"} | [url, port] | url, ...], "decode": [{"url"} | url, ...]}
    with the lists possibly nested under "fleet" or "servers".
    """
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    for key in ("fleet", "servers"):
        if isinstance(doc.get(key), dict):
            doc = doc[key]
    if not isinstance(doc.get("prefill"), list) or not isinstance(doc.get("decode"), list):
        return None

    def prefill_item(item) -> tuple[str, int | None]:
        if isinstance(item, dict):
            return item["url"], item.get("bootstrap_port")
        if isinstance(item, (list, tuple)):
            return item[0], item[1] if len(item) > 1 else None
        return item, None

    def decode_item(item) -> str:
        return item["url"] if isinstance(item, dict) else item

    return Fleet(prefill=[prefill_item(i) for i in doc["prefill"]], decode=[decode_item(i) for i in doc["decode"]])


# A short generation on a lightly loaded GPU server, roughly: 5 ms of prefill, then 10 ms per decode step
# (16 tokens: ~0.17 s a request). Replace with --sim-args.
DEFAULT_TIMING_ARGS = ["--prefill-overhead-s", "0.005", "--decode-step-s", "0.01"]


@dataclass
class SimFleet:
    """Start `python -m simulator.fleet --prefill N --decode M [extra]`; a context manager that stops it."""

    workdir: Path
    prefills: int = 2
    decodes: int = 2
    extra_args: list[str] = field(default_factory=lambda: list(DEFAULT_TIMING_ARGS))
    python: str = sys.executable
    checkout: Path = REPO_ROOT
    start_timeout: float = 60.0
    processes: bool = True  # one process per worker; False: the whole fleet in one (lighter, for many fleets)
    child: procs.Child | None = None

    def __enter__(self) -> Fleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # One process per worker (so the fleet is not one event loop), and a local model path as a real
        # deployment has (sgl-router then looks for a tokenizer on disk, not on a model hub).
        Path(MODEL_PATH).mkdir(parents=True, exist_ok=True)
        argv = [self.python, "-m", "simulator.fleet", "--prefill", str(self.prefills),
                "--decode", str(self.decodes), *(["--processes"] if self.processes else []),
                "--model-path", MODEL_PATH, *self.extra_args]
        self.child = procs.start("simfleet", argv, self.workdir, cwd=str(self.checkout))
        found: list[Fleet] = []

        def announced() -> bool:
            for line in self.child.log_tail(1_000_000).splitlines():
                fleet = parse_fleet_line(line)
                if fleet is not None:
                    found.append(fleet)
                    return True
            return False

        try:
            procs.wait_until(announced, timeout=self.start_timeout, what="the simulated fleet's JSON line",
                             child=self.child, interval=0.2)
            fleet = found[0]
            fleet.pids = [self.child.pid]
            for url in fleet.all_urls():
                procs.wait_until(lambda: procs.http_status(f"{url}/health") == 200, timeout=self.start_timeout,
                                 what=f"simulated server {url} healthy", child=self.child)
        except BaseException:
            procs.stop(self.child)
            raise
        return fleet

    def __exit__(self, *exc) -> None:
        if self.child is not None:
            procs.stop(self.child)
