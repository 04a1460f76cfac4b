"""POST /convert_pd_role (seed design) on real servers: both directions, refusals, the idle rules."""

import threading

from .real_client import (
    convert, get_json, is_idle, live_role, output_ids, pd_generate, request_json, running_requests, wait_until,
)

PROMPTS = ("Hello world, this is", "The quick brown fox", "Numbers 0 1 2 3 and")
# Long enough to still be decoding while the conversions below are tried, on a fast machine too (~3 ms a token
# seen in CI; ~20 ms here, so ~20 s).
LONG_TOKENS = 1000


def _generate_all(prefill, decode):
    return [output_ids(pd_generate(prefill.url, decode.url, prefill.bootstrap_port, p)) for p in PROMPTS]


def _convert_ok(server, expected_role, body=None):
    status, answer = convert(server.url, body)
    assert status == 200, answer
    assert answer["success"] is True and answer["new_role"] == expected_role, answer
    assert answer["bootstrap_port"] == server.bootstrap_port
    assert live_role(server.url) == expected_role
    return answer


def test_bad_requests_are_refused_and_change_nothing(pd_pair):
    p = pd_pair.prefill
    cases = [
        (b"{not json", "not valid JSON"),
        ({"new_role": "decode"}, "unknown field 'new_role'"),
        ({"check_idle": "yes"}, "check_idle must be a boolean"),
        ({"bootstrap_port": p.bootstrap_port + 1}, "cannot move it"),
        ({"disable_radix_cache": False}, "prefix cache disabled"),  # as decode it will be off
    ]
    for body, fragment in cases:
        status, answer = request_json("POST", f"{p.url}/convert_pd_role", body)
        assert status == 400, (body, answer)
        assert answer["success"] is False and fragment in answer["error"]["message"], (body, answer)
        assert answer["bootstrap_port"] == p.bootstrap_port
    assert live_role(p.url) == "prefill"


def test_convert_both_ways_and_back_with_identical_generation(pd_pair):
    p, d = pd_pair.prefill, pd_pair.decode
    before = _generate_all(p, d)

    to_decode = _convert_ok(p, "decode", {"server_url": p.url, "check_idle": True,
                                          "bootstrap_port": p.bootstrap_port})
    assert to_decode["old_role"] == "prefill"
    to_prefill = _convert_ok(d, "prefill", {"disable_radix_cache": True, "disable_cuda_graph": True})
    assert to_prefill["old_role"] == "decode"

    # The new pairing: the former decode prefills (with its own bootstrap port), the former prefill decodes.
    swapped = [output_ids(pd_generate(d.url, p.url, d.bootstrap_port, prompt)) for prompt in PROMPTS]
    assert swapped == before

    _convert_ok(p, "prefill")
    _convert_ok(d, "decode")
    assert _generate_all(p, d) == before
    # Back as prefill, the launched-prefill server has its prefix cache again (released while it decoded).
    again = pd_generate(p.url, d.url, p.bootstrap_port, PROMPTS[0])
    assert output_ids(again) == before[0] and again["prefill"]["meta_info"]["cached_tokens"] > 0


def test_busy_server_refused_or_waited_for_and_one_conversion_at_a_time(pd_pair):
    p, d = pd_pair.prefill, pd_pair.decode
    result, first = {}, {}
    long_request = threading.Thread(target=lambda: result.update(
        pd_generate(p.url, d.url, p.bootstrap_port, "Numbers 0 1 2 3", max_new_tokens=LONG_TOKENS, timeout=180)))
    long_request.start()
    try:
        wait_until(lambda: running_requests(d.url) > 0, timeout=30, what="decode runs the long request")
        status, answer = convert(d.url, {"check_idle": True})
        assert status == 400 and "not idle" in answer["message"], answer
        assert answer["safe_to_restore"] is True and live_role(d.url) == "decode"

        # check_idle=false: the server itself waits (bounded) for the drain, visibly, then converts.
        waiter = threading.Thread(target=lambda: first.update(
            zip(("status", "answer"), convert(d.url, {"check_idle": False, "idle_timeout_s": 150}))))
        waiter.start()
        wait_until(lambda: get_json(f"{d.url}/convert_pd_role")["waiting_for_idle"], timeout=30,
                   what="the conversion waits for the drain")
        state = get_json(f"{d.url}/convert_pd_role")
        assert (state["in_progress"], state["old_role"], state["new_role"]) == (True, "decode", "prefill")
        # A second conversion is refused, not queued behind the first (it would flip the role back). Its body
        # is one the server refuses anyway once idle, so this probe can never convert it.
        status, answer = convert(d.url, {"disable_radix_cache": False})
        assert status == 409 and "in progress" in answer["error"]["message"], answer
        waiter.join(timeout=180)
    finally:
        long_request.join(timeout=180)
    assert result["decode_status"] == 200 and len(result["decode"]["output_ids"]) == LONG_TOKENS
    assert first["status"] == 200 and first["answer"]["new_role"] == "prefill", first
    assert live_role(d.url) == "prefill" and is_idle(d.url)
    assert get_json(f"{d.url}/convert_pd_role")["in_progress"] is False
    _convert_ok(d, "decode")


def test_decode_reaches_a_server_back_in_prefill_after_a_round_trip(pd_pair):
    """The decode server keeps serving the same prefill server through prefill -> decode -> prefill (it stays a
    decode itself). Upstream it would wait on the prefill's former KV endpoint until a deadline; with the
    prefill_endpoint_on_role_switch patch the former endpoint and the decode's registration carry over."""
    p, d = pd_pair.prefill, pd_pair.decode
    before = output_ids(pd_generate(p.url, d.url, p.bootstrap_port, PROMPTS[0]))  # the decode caches p's endpoint
    _convert_ok(p, "decode")
    _convert_ok(p, "prefill")
    after = pd_generate(p.url, d.url, p.bootstrap_port, PROMPTS[0], timeout=30)
    assert output_ids(after) == before


def test_a_prepare_only_switch_answers_without_changing_anything(pd_pair):
    """What a taker-over relies on (router/cluster/takeover.py): `prepare_only` runs a switch's checks and
    stops; "ready" means no switch is running and the server is idle; a refused check changes nothing."""
    p = pd_pair.prefill
    status, answer = request_json("POST", f"{p.url}/pd_role_switch",
                                  {"new_role": "decode", "prepare_only": True, "decode_cuda_graph_memory_gb": 0})
    assert status == 200 and answer["success"] is True and answer["message"] == "ready", answer
    status, answer = request_json("POST", f"{p.url}/pd_role_switch", {"new_role": "decode", "prepare_only": True})
    assert status == 400 and answer["safe_to_restore"] is True, answer
    assert "in progress" not in answer["message"]
    assert live_role(p.url) == "prefill"
    assert output_ids(pd_generate(p.url, pd_pair.decode.url, p.bootstrap_port, PROMPTS[0]))
