"""The peers' command lines as data (tests/fixtures/peers/), pd-router's handling of every flag, and
docs/PEERS.md kept true to both (issue 23)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from router.server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "peers"
PEERS = ("sglang_router-0.3.2", "smg-1.13.0")
CLASSES = {"same", "alias", "build", "ignored", "refuse"}

sys.path.insert(0, str(ROOT / "scripts"))
import peer_flags  # noqa: E402
import peers_doc  # noqa: E402


def _actions(peer: str) -> list[dict]:
    return json.loads((FIXTURES / f"{peer}.json").read_text())["actions"]


def _peer_flags() -> set[str]:
    return {flag for peer in PEERS for action in _actions(peer) for flag in action["flags"]}


HANDLING = json.loads((FIXTURES / "pd_router.json").read_text())
OURS = {s for a in build_parser()._actions for s in a.option_strings}


def test_fixtures_hold_the_peers_whole_command_lines():
    # the counts issue 23 measured: sgl-router 0.3.2 has 98 option strings, SMG 1.13 221
    counts = {peer: sum(len(a["flags"]) for a in _actions(peer)) for peer in PEERS}
    assert counts == {"sglang_router-0.3.2": 98, "smg-1.13.0": 221}
    for peer in PEERS:
        for action in _actions(peer):
            assert action["flags"] and all(f.startswith("--") for f in action["flags"])
            assert action["action"] in {"Store", "StoreTrue", "Append", "Extend", "BooleanOptional"}


def test_every_peer_flag_is_handled_and_nothing_else():
    assert set(HANDLING) == _peer_flags()
    assert {h["class"] for h in HANDLING.values()} <= CLASSES


def test_what_pd_router_has_is_on_its_command_line():
    missing = sorted(f for f, h in HANDLING.items() if h["class"] == "same" and f not in OURS)
    assert not missing, f"said to be supported but not parsed: {missing}"
    for flag, h in HANDLING.items():
        if h["class"] == "alias":
            assert h["pd_router"] in OURS, f"{flag} is an alias of {h['pd_router']}, which pd-router lacks"


def test_refusals_and_no_ops_say_what_pd_router_does_instead():
    for flag, h in HANDLING.items():
        if h["class"] in ("refuse", "ignored"):
            assert len(h["note"]) > 20, flag


@pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason="smg is not installed")
def test_the_smg_fixture_is_what_smgs_own_parser_says():
    # smg==1.13.0 is in the test venv (scripts/setup.sh): its parser is the reference, the fixture its copy
    live = peer_flags.dump("smg")
    assert live["version"] == "1.13.0"
    assert live == json.loads((FIXTURES / "smg-1.13.0.json").read_text())


def test_peers_doc_is_current():
    assert peers_doc.render(peers_doc.DOC.read_text()) == peers_doc.DOC.read_text(), \
        "docs/PEERS.md is out of date: run python scripts/peers_doc.py"


def test_peers_doc_rows_cover_every_flag_once():
    table = peers_doc.table()
    for flag in _peer_flags():
        assert table.count(f"`{flag}`") >= 1, flag
    assert len([line for line in table.splitlines() if line.startswith("| `--")]) == len(peers_doc.rows())


def test_worker_api_reference_lists_the_peers_bodies():
    api = json.loads((FIXTURES / "worker_api.json").read_text())
    sglr, smg = api["sglang_router-0.3.2"], api["smg-1.13.0"]
    # field counts as the serde structs in the wheels say ('struct WorkerConfigRequest with 20 elements', ...)
    assert len(sglr["POST /workers"]["fields"]) == 20
    assert len(sglr["PUT /workers/{worker_id}"]["fields"]) == 9
    assert len(smg["POST /workers"]["fields"]) == 29
    assert len(smg["PATCH /workers/{worker_id}"]["fields"]) == 5
    for peer in (sglr, smg):
        assert {"GET /liveness", "GET /readiness", "GET /get_loads", "GET /engine_metrics"} <= set(peer["routes"])
