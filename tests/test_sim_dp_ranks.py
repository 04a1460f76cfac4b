"""The simulator's data-parallel ranks follow SGLang 0.5.23's rules (docs/DP_RANKS.md): a prefill follows the
bootstrap room, a decode goes round robin, `routed_dp_rank` (or its alias) overrides both and is range-checked
(400), a prefill moved off the room's rank without `disagg_prefill_dp_rank` fails the conflict check (500), the
KV is kept per prefill rank and a decode pulls from the rank `disagg_prefill_dp_rank` names (else the room's),
`/v1/loads` has a row per rank and `/server_info` says what 0.5.23 resolves attention DP to."""

from __future__ import annotations

import asyncio

import pytest

from simulator import dp_ranks
from simulator.fleet import Fleet
from tests.sim_support import FAST, get, pd_body, post

PROMPT = {"input_ids": [1, 393, 390, 15], "sampling_params": {"max_new_tokens": 3}}
SHORT = dict(FAST, bootstrap_timeout_s=0.5, kv_wait_timeout_s=0.5)


async def rows(session, handle) -> list[dict]:
    status, body = await get(session, handle.url + "/v1/loads")
    assert status == 200
    return body["loads"]


async def run_pair(session, fleet, body: dict, *, prefill_extra: dict, decode_extra: dict):
    p, d = fleet.prefill[0], fleet.decode[0]
    full = pd_body(body, p, room=body.pop("room"))
    return await asyncio.gather(post(session, p.url + "/generate", {**full, **prefill_extra}),
                                post(session, d.url + "/generate", {**full, **decode_extra}))


def test_rules_as_pure_functions():
    chooser = dp_ranks.RankChooser(4)
    assert [chooser.choose("prefill", room, None) for room in (5, 6, 7, 8)] == [1, 2, 3, 0]
    assert [chooser.choose("decode", 5, None) for _ in range(5)] == [0, 1, 2, 3, 0]  # not by room
    assert chooser.choose("prefill", 5, 2) == 2 and chooser.choose("decode", 5, 3) == 3
    assert dp_ranks.RankChooser(1).choose("prefill", 5, None) == 0
    assert dp_ranks.prefill_conflict(1, 5, 4, None) is None  # 5 % 4 == 1
    message = dp_ranks.prefill_conflict(2, 5, 4, None)
    assert message.startswith("follow_bootstrap_room conflict: dispatched to dp_rank 2 but bootstrap_room 5 "
                              "implies dp_rank 1.")
    assert dp_ranks.prefill_conflict(2, 5, 4, 2) is None  # the request says where its KV is
    assert dp_ranks.prefill_conflict(0, 5, 1, None) is None
    assert dp_ranks.pulled_rank(5, 4, None) == 1 and dp_ranks.pulled_rank(5, 4, 3) == 3
    assert dp_ranks.rank_fields({"data_parallel_rank": 1}) == (1, None, [])
    assert dp_ranks.rank_fields({"data_parallel_rank": 1, "routed_dp_rank": 0})[0] == 0
    assert dp_ranks.rank_fields({"routed_dp_rank": "x"})[2][0]["loc"] == ["body", "routed_dp_rank"]
    dp_ranks.check_routed(0, 1)  # ignored with one rank
    for rank, ranks in ((1, 1), (2, 2), (-1, 2)):
        with pytest.raises(ValueError, match=rf"routed_dp_rank={rank} out of range \[0, {ranks}\)"):
            dp_ranks.check_routed(rank, ranks)


async def test_server_info_reports_attention_dp_as_0_5_23_resolves_it(session):
    async with Fleet(1, 1, dp_size=2, enable_dp_attention=True, **FAST) as fleet:
        _, info = await get(session, fleet.prefill[0].url + "/server_info")
        assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 2, True)
        assert len(info["internal_states"]) == 2
        assert info["load_balance_method"] == "follow_bootstrap_room"
        _, dinfo = await get(session, fleet.decode[0].url + "/server_info")
        assert dinfo["load_balance_method"] == "round_robin"
    async with Fleet(1, 1, dp_size=3, **FAST) as fleet:
        _, info = await get(session, fleet.prefill[0].url + "/server_info")
        assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (3, 1, False)


async def test_routed_ranks_on_both_legs_with_the_prefill_rank_named_serve_on_those_ranks(session):
    async with Fleet(1, 1, dp_size=2, enable_dp_attention=True, **SHORT) as fleet:
        p, d = fleet.prefill[0], fleet.decode[0]
        # room 4 implies prefill rank 0; the router moves it to rank 1 and says so on both legs
        body = {**PROMPT, "rid": "moved", "room": 4}
        leg_p = run_pair(session, fleet, body, prefill_extra={"routed_dp_rank": 1, "disagg_prefill_dp_rank": 1},
                         decode_extra={"routed_dp_rank": 0, "disagg_prefill_dp_rank": 1})
        (ps, _), (ds, dbody) = await leg_p
        assert (ps, ds) == (200, 200), dbody
        assert len(dbody["output_ids"]) == 3
        p_rows, d_rows = await rows(session, p), await rows(session, d)
        assert [r["dp_rank"] for r in p_rows] == [0, 1]
        assert [r["total_prefill_uncached_tokens"] for r in p_rows] == [0, 4]  # rank 1 computed it
        steps = [(r["decode_moments"] or [0])[0] for r in d_rows]
        assert steps[0] > 0 and steps[1] == 0  # decode rank 0 decoded it


async def test_a_routed_prefill_rank_without_disagg_prefill_dp_rank_fails_the_conflict_check(session):
    async with Fleet(1, 1, dp_size=2, **SHORT) as fleet:
        body = {**PROMPT, "rid": "conflict", "room": 4}
        (ps, pbody), (ds, _) = await run_pair(session, fleet, body, prefill_extra={"routed_dp_rank": 1},
                                              decode_extra={"routed_dp_rank": 1, "disagg_prefill_dp_rank": 1})
        assert ps == 500
        message = pbody["error"]["message"] if "error" in pbody else str(pbody)
        assert "follow_bootstrap_room conflict: dispatched to dp_rank 1 but bootstrap_room 4 implies dp_rank 0" \
            in message
        assert "KVTransferError(bootstrap_room=4)" in message
        assert ds == 500  # its KV never comes: the decode leg times out
        # the room's own rank passes without any field: rank 0 for room 4
        body = {**PROMPT, "rid": "aligned", "room": 4}
        (ps, _), (ds, _) = await run_pair(session, fleet, body, prefill_extra={"routed_dp_rank": 0},
                                          decode_extra={})
        assert (ps, ds) == (200, 200)


async def test_without_rank_fields_the_prefill_follows_the_room_and_the_decode_pulls_from_it(session):
    async with Fleet(1, 1, dp_size=2, **SHORT) as fleet:
        p = fleet.prefill[0]
        for room in (7, 9, 10):
            (ps, _), (ds, _) = await run_pair(session, fleet, {**PROMPT, "room": room}, prefill_extra={},
                                              decode_extra={})
            assert (ps, ds) == (200, 200)
        assert [r["total_prefill_uncached_tokens"] for r in await rows(session, p)] == [4, 8]


async def test_a_decode_told_the_wrong_prefill_rank_never_gets_the_kv(session):
    async with Fleet(1, 1, dp_size=2, **SHORT) as fleet:
        body = {**PROMPT, "rid": "astray", "room": 4}  # prefill rank 0 (the room's); decode pulls from rank 1
        (ps, _), (ds, dbody) = await run_pair(session, fleet, body, prefill_extra={},
                                              decode_extra={"disagg_prefill_dp_rank": 1})
        assert ps == 500 and ds == 500
        # a rank the prefill does not have: the bootstrap lookup fails at once
        body = {**PROMPT, "rid": "nowhere", "room": 4}
        (ps, _), (ds, dbody) = await run_pair(session, fleet, body, prefill_extra={},
                                              decode_extra={"disagg_prefill_dp_rank": 5})
        assert ds == 500 and "Bootstrap info not found for dp_rank=5" in str(dbody)


async def test_a_routed_rank_out_of_range_is_a_400_and_one_rank_ignores_zero(session):
    async with Fleet(1, 1, dp_size=2, **SHORT) as fleet:
        p = fleet.prefill[0]
        status, body = await post(session, p.url + "/generate", pd_body({**PROMPT, "routed_dp_rank": 2}, p))
        assert status == 400 and "routed_dp_rank=2 out of range [0, 2)" in str(body)
        status, body = await post(session, p.url + "/generate", pd_body({**PROMPT, "data_parallel_rank": -1}, p))
        assert status == 400 and "routed_dp_rank=-1 out of range [0, 2)" in str(body)
        status, body = await post(session, p.url + "/generate", pd_body({**PROMPT, "routed_dp_rank": "one"}, p))
        assert status == 400
        status, body = await post(session, p.url + "/v1/completions",
                                  pd_body({"prompt": "hi", "max_tokens": 2, "routed_dp_rank": 9}, p))
        assert status == 400 and "routed_dp_rank=9 out of range" in str(body)
    async with Fleet(1, 1, **SHORT) as fleet:
        body = {**PROMPT, "rid": "single", "room": 5}
        (ps, _), (ds, _) = await run_pair(session, fleet, body, prefill_extra={"routed_dp_rank": 0},
                                          decode_extra={"routed_dp_rank": 0})
        assert (ps, ds) == (200, 200)
