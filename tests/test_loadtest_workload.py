"""The load users' pure parts: lengths, routes, the judging of answers, the summary and its checks."""

from __future__ import annotations

import random

import orjson
import pytest

from loadtest.scenarios import failed_requests_in_router_log, version_checks
from loadtest.summary import Event, check_no_aborts, check_no_errors, percentile, phases, stats_of
from loadtest.workload import (ABORTED, ERROR, OK, ROUTES, ArrivalClock, Lengths, make_prompt, parse_route_weights)
from simulator.tokens import encode


def sse(*payloads) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else orjson.dumps(p)) + b"\n\n" for p in payloads)


def gen_event(tokens: int, finish=None, version="v1") -> dict:
    return {"text": " ba" * tokens, "meta_info": {"finish_reason": finish, "completion_tokens": tokens,
                                                   "weight_version": version}}


def chat_chunk(content=None, finish=None, usage=None) -> dict:
    delta = {"content": content} if content is not None else {}
    return {"choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": usage}


def read_stream(route: str, raw: bytes, max_tokens: int, piece: int = 7):
    """Feed the bytes in small pieces (events cut anywhere), one time unit apart."""
    reader = ROUTES[route].stream_reader(max_tokens)
    for i in range(0, len(raw), piece):
        reader.feed(raw[i:i + piece], float(i))
    return reader, reader.verdict()


# ---- lengths, routes, prompts ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("128", Lengths(128, 0.0)), ("128:32", Lengths(128, 32.0)), ("32:8:16:64", Lengths(32, 8.0, 16, 64)),
])
def test_lengths_parse(text, expected):
    assert Lengths.parse(text) == expected


@pytest.mark.parametrize("text", ["", "x", "0", "12:-1", "1:2:3", "32:8:16:8", "32:8:0:8"])
def test_lengths_parse_rejects(text):
    with pytest.raises(ValueError):
        Lengths.parse(text)


def test_lengths_sample_stays_in_bounds_and_follows_the_mean():
    rng = random.Random(1)
    draws = [Lengths(32, 16, 16, 40).sample(rng) for _ in range(2000)]
    assert min(draws) == 16 and max(draws) == 40
    fixed = [Lengths(7).sample(rng) for _ in range(10)]
    assert fixed == [7] * 10
    wide = [Lengths(100, 10).sample(rng) for _ in range(4000)]
    assert 98 < sum(wide) / len(wide) < 102


def test_route_weights():
    assert parse_route_weights("generate,chat") == {"generate": 1.0, "chat": 1.0}
    assert parse_route_weights("generate=2, completions=0.5") == {"generate": 2.0, "completions": 0.5}
    for bad in ("", "generate=0", "nope", "chat=x", "chat=-1"):
        with pytest.raises(ValueError):
            parse_route_weights(bad)


def test_prompt_has_the_asked_simulator_token_count():
    rng = random.Random(3)
    for tokens in (1, 2, 17, 128):
        assert len(encode(make_prompt(rng, tokens))) == max(tokens, 2)


def test_arrival_clock_hands_out_slots_at_the_rate():
    clock = ArrivalClock(rate=4.0)
    assert [clock.take(10.0), clock.take(10.0), clock.take(10.1)] == [10.0, 10.25, 10.5]
    assert clock.take(99.0) == 10.75  # late: the slot was due long ago (the caller records the lag)


def test_bodies_ask_for_exact_lengths():
    assert ROUTES["generate"].body("hi", 5, True, "m")["sampling_params"] == {
        "max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    chat = ROUTES["chat"].body("hi", 5, True, "m")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["stream_options"]["include_usage"]
    assert "stream_options" not in ROUTES["completions"].body("hi", 5, False, "m")


# ---- judging streams -------------------------------------------------------------------------------------
def test_generate_stream_ok_with_ttft_and_itl():
    raw = sse(gen_event(1), gen_event(2), gen_event(3, {"type": "length", "length": 3}), b"[DONE]")
    reader, verdict = read_stream("generate", raw, 3)
    assert verdict.outcome == OK and verdict.completion_tokens == 3 and verdict.weight_version == "v1"
    assert reader.first_token_at is not None and reader.last_token_at > reader.first_token_at
    assert reader.itl_s() == pytest.approx((reader.last_token_at - reader.first_token_at) / 2)


def test_chat_stream_counts_usage_and_ignores_role_chunk():
    raw = sse(chat_chunk(""), chat_chunk(" a"), chat_chunk(" b"), chat_chunk(finish="length"),
              chat_chunk(usage={"completion_tokens": 2}), b"[DONE]")
    reader, verdict = read_stream("chat", raw, 2)
    assert verdict.outcome == OK and verdict.finish_reason == "length" and reader.tokens == 2


@pytest.mark.parametrize("raw, expected_error", [
    (sse(gen_event(1), gen_event(2)), "without [DONE]"),
    (sse(gen_event(1), {"error": {"message": "decode worker failed mid-stream"}}, b"[DONE]"), "mid-stream"),
    (sse(gen_event(1), gen_event(2, {"type": "length"}), b"[DONE]"), "after 2 tokens, asked for 3"),
    (sse(gen_event(1), gen_event(2), b"[DONE]"), "no finish_reason"),
    (sse(gen_event(1, {"type": "length"}), b"[DONE]", gen_event(1)), "after [DONE]"),
    (sse(b"{not json", b"[DONE]"), "not JSON"),
])
def test_generate_stream_errors(raw, expected_error):
    _, verdict = read_stream("generate", raw, 3)
    assert verdict.outcome == ERROR and expected_error in verdict.error


def test_aborted_stream_is_not_an_error():
    raw = sse(gen_event(1), gen_event(2, {"type": "abort", "message": "Abort in waiting queue"}), b"[DONE]")
    _, verdict = read_stream("generate", raw, 8)
    assert verdict.outcome == ABORTED and verdict.finish_reason == "abort"
    raw = sse(chat_chunk(" a"), chat_chunk(finish="abort"), b"[DONE]")
    assert read_stream("chat", raw, 8)[1].outcome == ABORTED


def test_crlf_framing():
    raw = sse(gen_event(1, {"type": "length"}), b"[DONE]").replace(b"\n", b"\r\n")
    assert read_stream("generate", raw, 1)[1].outcome == OK


# ---- judging whole answers -------------------------------------------------------------------------------
def test_whole_answers():
    completion = {"choices": [{"text": " a b", "finish_reason": "length"}], "usage": {"completion_tokens": 2},
                  "metadata": {"weight_version": "v7"}}
    verdict = ROUTES["completions"].read_whole(200, orjson.dumps(completion), 2)
    assert verdict.outcome == OK and verdict.weight_version == "v7"
    chat = {"choices": [{"message": {"content": "x"}, "finish_reason": "abort"}], "usage": {"completion_tokens": 1}}
    assert ROUTES["chat"].read_whole(200, orjson.dumps(chat), 4).outcome == ABORTED
    generate = gen_event(4, {"type": "length", "length": 4})
    assert ROUTES["generate"].read_whole(200, orjson.dumps(generate), 4).outcome == OK
    assert ROUTES["generate"].read_whole(200, orjson.dumps(generate), 5).outcome == ERROR


@pytest.mark.parametrize("status, body, expected", [
    (502, b'{"error": {"message": "decode http://d failed"}}', "HTTP 502: decode http://d failed"),
    (503, b'{"object": "error", "message": "no routable decode worker"}', "HTTP 503: no routable decode"),
    (500, b"Internal Server Error", "HTTP 500: Internal Server Error"),
    (200, b"[1, 2]", "not a JSON object"),
    (200, b'{"error": {"message": "boom"}}', "error answer: boom"),
])
def test_whole_answer_errors(status, body, expected):
    verdict = ROUTES["generate"].read_whole(status, body, 4)
    assert verdict.outcome == ERROR and expected in verdict.error


# ---- summary ---------------------------------------------------------------------------------------------
def record(i: int, outcome: str = OK, start: float = 0.0, e2e: float = 100.0, ttft: float | None = 10.0,
           stream: bool = True) -> dict:
    return {"id": f"r{i}", "route": "generate", "stream": stream, "start": start, "end": start + e2e / 1000,
            "outcome": outcome, "error": "" if outcome == OK else outcome, "e2e_ms": e2e,
            "ttft_ms": ttft if stream else None, "itl_ms": 1.0 if stream else None, "lag_ms": 0.0}


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_stats_count_outcomes_apart_and_take_latencies_from_good_answers():
    records = [record(i, start=i * 0.1, e2e=100.0 + i) for i in range(10)]
    records += [record(10, ERROR, start=0.5, e2e=9000.0), record(11, ABORTED, start=0.6, e2e=8000.0, stream=False)]
    stats = stats_of(records)
    assert (stats.requests, stats.ok, stats.errors, stats.aborted) == (12, 10, 1, 1)
    assert stats.e2e_ms["p50"] == pytest.approx(104.5) and stats.e2e_ms["p99"] < 110  # failures left out
    assert stats.window_s == pytest.approx(0.5 + 9.0)  # the first start to the last end, failures included
    assert stats.requests_per_s == pytest.approx(10 / stats.window_s)
    assert stats.by_route == {"generate stream": {OK: 10, ABORTED: 0, ERROR: 1},
                              "generate": {OK: 0, ABORTED: 1, ERROR: 0}}
    assert not check_no_errors(records).passed and not check_no_aborts(records).passed
    assert check_no_errors(records[:10]).passed and check_no_aborts(records[:10]).passed


def test_router_log_failures_by_request_id(tmp_path):
    log = tmp_path / "router.log"
    lines = [
        {"logger": "router.access", "request_id": "a", "outcome": "error", "decode": "http://d1"},
        {"logger": "router.access", "request_id": "b", "outcome": "success", "decode": "http://d2"},
        {"logger": "router.proxy", "request_id": "c", "message": "retrying"},
    ]
    log.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\nnot json\n{broken\n")
    assert failed_requests_in_router_log(log) == {"a": lines[0]}
    assert failed_requests_in_router_log(tmp_path / "missing.log") == {}


def versioned(i: int, start: float, end: float, version: str | None) -> dict:
    return {**record(i, start=start, e2e=(end - start) * 1000), "weight_version": version}


def test_version_checks_around_updates():
    updates = [{"version": "v1", "start": 10.0, "end": 11.0, "ok": True},
               {"version": "v2", "start": 20.0, "end": 21.0, "ok": True}]
    good = [versioned(0, 1, 9, "default"), versioned(1, 9.5, 12, "default"),  # in flight at the update: either
            versioned(2, 11, 12, "v1"), versioned(3, 15, 19, "v1"), versioned(4, 22, 23, "v2"),
            versioned(5, 22, 23, None)]  # streamed OpenAI answers carry no version
    checks = version_checks(good, updates, initial="default")
    assert [c.passed for c in checks] == [True] * 4, checks
    stale = version_checks(good + [versioned(6, 21.5, 22, "v1")], updates, initial="default")
    assert [c.name for c in stale if not c.passed] == ["answers sent after the update carry v2"]
    early = version_checks(good + [versioned(7, 2, 3, "v1")], updates, initial="default")
    assert [c.name for c in early if not c.passed] == ["answers done before the update carry default"]
    # an update with no answer after it proves nothing
    assert not version_checks(good[:2], updates[:1], initial="default")[0].passed


def test_phases_split_answers_around_the_events():
    records = [record(i, start=float(i), e2e=100.0) for i in range(5)]  # 0..4 s, 0.1 s each
    records += [record(10, start=5.0, e2e=400.0), record(11, start=5.2, e2e=300.0), record(12, ERROR, start=5.1)]
    records += [record(20 + i, start=7.0 + i, e2e=100.0) for i in range(3)]
    out = phases(records, [Event("update", 5.3, 5.5)])
    assert (out["before"]["n"], out["during"]["n"], out["after"]["n"]) == (5, 2, 3)  # the error is left out
    assert out["during"]["e2e_p99_ms"] == pytest.approx(399.0)
    assert out["during_vs_before_e2e_p99"] == pytest.approx(3.99)
    assert phases(records, []) == {}
