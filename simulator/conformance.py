"""Conformance scenarios: drive one prefill + one decode server and record every answer.

Run against real SGLang servers to produce the fixtures in ``tests/fixtures/real_sglang/``;
run against simulated workers (``tests/test_simulator_fidelity.py``) and compare the two
field by field with :func:`shape_diff`. A scenario (conformance_scenarios.py) is a coroutine that takes a ``Pair``
and returns a list of recorded steps; it must leave both servers idle and unpaused.

    python -m simulator.conformance --prefill http://127.0.0.1:P --decode http://127.0.0.1:D \
        --prefill-bootstrap-port PB --decode-bootstrap-port DB --out tests/fixtures/real_sglang
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp

from .conformance_pair import Pair  # what callers drive the scenarios with
from .conformance_scenarios import SCENARIOS


# ---------------------------------------------------------------- comparing two recordings

_HEX_ID = re.compile(r"\b[0-9a-f]{32}\b")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def normalize_message(text: str) -> str:
    """A message with ids, rooms, ports and timings replaced, and pydantic details cut to their first line."""
    if "validation error" in text:
        text = text.split("\n", 1)[0]
    return _NUMBER.sub("N", _HEX_ID.sub("ID", text))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def shape_diff(real: Any, sim: Any, path: str) -> list[str]:
    """Differences of structure: keys, kinds of values, and (normalised) messages."""
    diffs: list[str] = []
    if _kind(real) != _kind(sim):
        return [f"{path}: {_kind(real)} on real, {_kind(sim)} on sim"]
    if isinstance(real, dict) and path.endswith("]") and ".top_logprobs[" in path:
        return []  # {token text: logprob}: the keys are the generated tokens themselves
    if isinstance(real, dict):
        for key in real:
            if key not in sim:
                diffs.append(f"{path}.{key}: missing on sim")
        for key in sim:
            if key not in real:
                diffs.append(f"{path}.{key}: extra on sim")
        for key in real:
            if key in sim:
                if key == "message" and isinstance(real[key], str) and isinstance(sim[key], str):
                    if normalize_message(real[key]) != normalize_message(sim[key]):
                        diffs.append(f"{path}.message: {normalize_message(real[key])!r} on real, "
                                     f"{normalize_message(sim[key])!r} on sim")
                else:
                    diffs.extend(shape_diff(real[key], sim[key], f"{path}.{key}"))
    elif isinstance(real, list) and real and sim:
        # lengths differ by nature (tokens, chunks): compare the ends (first, last, the one before the last)
        diffs.extend(shape_diff(real[0], sim[0], f"{path}[0]"))
        for i in (-2, -1):
            if len(real) >= 1 - i and len(sim) >= 1 - i:
                diffs.extend(shape_diff(real[i], sim[i], f"{path}[{i}]"))
    return diffs


def compare_steps(scenario: str, real_steps: list[dict], sim_steps: list[dict]) -> list[str]:
    """Step-by-step differences between a real recording and a simulated one of the same scenario."""
    diffs: list[str] = []

    def keyed(steps: list[dict]) -> dict[tuple, dict]:
        # concurrent calls finish in any order: match steps by label, server and occurrence
        seen: dict[tuple, int] = {}
        out = {}
        for step in steps:
            key = (step.get("label"), step.get("server"))
            seen[key] = seen.get(key, 0) + 1
            out[key + (seen[key],)] = step
        return out

    real_by, sim_by = keyed(real_steps), keyed(sim_steps)
    if set(real_by) != set(sim_by):
        return [f"{scenario}: steps differ: {sorted(map(str, set(real_by) - set(sim_by)))} only on real, "
                f"{sorted(map(str, set(sim_by) - set(real_by)))} only on sim"]
    pairs = [(real_by[k], sim_by[k]) for k in real_by]
    for real, sim in pairs:
        where = f"{scenario}[{real.get('label')}@{real.get('server')}]"
        for key in ("status", "content_type", "exception", "value"):
            if real.get(key) != sim.get(key):
                diffs.append(f"{where}.{key}: {real.get(key)!r} on real, {sim.get(key)!r} on sim")
        if "text" in real or "text" in sim:
            rt, st = real.get("text"), sim.get("text")
            if rt is None or st is None or normalize_message(rt) != normalize_message(st):
                diffs.append(f"{where}.text: {rt!r} on real, {st!r} on sim")
        if "json" in real and "json" in sim:
            diffs.extend(shape_diff(real["json"], sim["json"], f"{where}.json"))
        elif ("json" in real) != ("json" in sim):
            diffs.append(f"{where}.json: {'json' in real} on real, {'json' in sim} on sim")
        if "events" in real and "events" in sim:
            diffs.extend(shape_diff(real["events"], sim["events"], f"{where}.events"))
    return diffs


async def run_scenario(name: str, pair: Pair) -> list[dict]:
    pair.steps = []
    await SCENARIOS[name](pair)
    return pair.steps


async def _main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SCENARIOS)
    async with aiohttp.ClientSession() as session:
        pair = Pair(args.prefill, args.decode, args.prefill_bootstrap_port, args.decode_bootstrap_port,
                    session=session)
        for name in names:
            started = time.monotonic()
            steps = await run_scenario(name, pair)
            record = {"scenario": name, "server": args.server_label, "steps": steps}
            (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
            print(f"{name}: {len(steps)} steps in {time.monotonic() - started:.1f}s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--prefill-bootstrap-port", type=int, required=True)
    parser.add_argument("--decode-bootstrap-port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--server-label", default="sglang 0.5.23 (CPU, tiny random Llama)")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
