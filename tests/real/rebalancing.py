"""What the real tier's rebalancer tests share: a router with the rebalancer's clock shortened to a test's pace,
the expected answers from the reference server, and the rebalancer's record of its conversions."""

from __future__ import annotations

import json
import random
from pathlib import Path

from .conftest import restore_launch_roles
from .real_client import get_json, is_idle, post_json, wait_until
from .router_process import RouterProcess

# The rebalancer at a test's pace: a decision a second, no warm-up, a failure cooldown of seconds. SLOs for the
# tiny model on CPU: a first token within 2 s, a token a second (CPU decode steps of 0.3-0.6 s meet it).
REBALANCE_ARGS = ("--health-check-interval-secs", "10", "--load-poll-interval-secs", "0.5",
                  "--rebalance-interval-secs", "1", "--rebalance-warmup-secs", "0",
                  "--rebalance-failure-cooldown-secs", "5",
                  "--rebalance-ttft-target-secs", "2", "--rebalance-itl-target-secs", "1")


def start_router(fleet, log_path, *rebalance: str) -> RouterProcess:
    """pd-router in front of the fleet's prefill, decode and spare (1P+2D) in their launch roles, idle, with the
    rebalancer's flags."""
    restore_launch_roles(((fleet.prefill, "prefill"), (fleet.decode, "decode"), (fleet.spare, "decode")))
    for server in fleet.pd_servers:
        wait_until(lambda: is_idle(server.url), timeout=60, what=f"{server.url} is idle")
    return RouterProcess.start(prefill=[(fleet.prefill.url, fleet.prefill.bootstrap_port)],
                               decode=[fleet.decode.url, fleet.spare.url], log_path=log_path,
                               extra_args=(*REBALANCE_ARGS, *rebalance))


def long_prompts(count: int, tokens: int, seed: int = 20) -> tuple[tuple[int, ...], ...]:
    """Token-id prompts (long ones: their prefill is the work), the same every run."""
    rng = random.Random(seed)
    return tuple(tuple(rng.randrange(5, 900) for _ in range(tokens)) for _ in range(count))


def expected_outputs(reference, prompts, sampling: dict) -> dict:
    """What the regular (non-disaggregated) server answers: PD must answer the same tokens."""
    expected = {}
    for prompt in prompts:
        body = {"input_ids": list(prompt)} if isinstance(prompt, tuple) else {"text": prompt}
        status, answer = post_json(reference.url + "/generate", {**body, "sampling_params": sampling})
        assert status == 200, answer
        expected[prompt] = answer["output_ids"]
    return expected


def rebalancer_conversions(router) -> list[dict]:
    return get_json(f"{router.url}/admin/rebalancer?limit=500")["conversions"]


def rebalancer_decisions(router) -> list[dict]:
    return get_json(f"{router.url}/admin/rebalancer?limit=500")["decisions"]


def roles(router) -> dict[str, str]:
    return {w["url"]: w["role"] for w in router.workers()}


def keep_record(router, path: Path) -> None:
    """The rebalancer's whole record (decisions with their signals, conversions) beside the router's log, for
    a failure to be read afterwards; nothing when the router no longer answers."""
    try:
        record = get_json(f"{router.url}/admin/rebalancer?limit=500")
    except Exception:  # the router died: its log says why
        return
    path.write_text(json.dumps(record, indent=1))


def convert_decisions(router, since: int = 0) -> list[tuple]:
    """The conversions the rebalancer decided (from the `since`-th on): when, why, and what it read."""
    converts = [d for d in rebalancer_decisions(router) if d["action"] == "convert"][since:]
    return [(d["at"], d["reason"], (d.get("model") or {}).get("mix")) for d in converts]
