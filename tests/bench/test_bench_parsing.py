"""Parsing of wrk's result line and of the simulated fleet's announcement; the routers' launch flags."""

import pytest

from bench import wrk
from bench.contenders import contender
from bench.fleet import Fleet
from bench.loadgen import percentile
from bench.simfleet import parse_fleet_line


def test_wrk_result_line_is_parsed_into_rates_and_milliseconds():
    out = ("Running 10s test @ http://x\n" + wrk.RESULT_MARKER +
           '{"requests":1000,"duration_us":2000000,"bytes":5,"connect":0,"read":1,"write":0,'
           '"status":10,"timeout":2,"p50_us":1500,"p90_us":2000,"p99_us":9000,"max_us":12000,"mean_us":1600.5}\n')
    got = wrk.parse_output(out)
    assert got["rps"] == 495.0  # non-2xx answers are not served requests
    assert got["errors"] == 13
    assert got["error_kinds"] == {"read": 1, "status": 10, "timeout": 2}
    assert (got["p50_ms"], got["p99_ms"]) == (1.5, 9.0)


def test_wrk_without_result_line_is_an_error():
    with pytest.raises(ValueError):
        wrk.parse_output("connection refused\n")


@pytest.mark.parametrize("line", [
    '{"prefill": [{"url": "http://127.0.0.1:1", "bootstrap_port": 9}], "decode": [{"url": "http://127.0.0.1:2"}]}',
    '{"fleet": {"prefill": [["http://127.0.0.1:1", 9]], "decode": ["http://127.0.0.1:2"]}}',
])
def test_fleet_announcement_forms(line):
    fleet = parse_fleet_line(line)
    assert fleet.prefill == [("http://127.0.0.1:1", 9)]
    assert fleet.decode == ["http://127.0.0.1:2"]


@pytest.mark.parametrize("line", ["INFO starting", "{not json", '{"prefill": []}'])
def test_other_lines_are_not_a_fleet(line):
    assert parse_fleet_line(line) is None


def test_every_router_gets_mini_lb_flags():
    fleet = Fleet(prefill=[("http://127.0.0.1:1", 9), ("http://127.0.0.1:3", None)], decode=["http://127.0.0.1:2"])
    argv = contender("sgl-router").argv(fleet, 8000, "random")
    assert argv[argv.index("--pd-disaggregation") + 1:] == [
        "--prefill", "http://127.0.0.1:1", "9", "--prefill", "http://127.0.0.1:3", "--decode", "http://127.0.0.1:2",
        "--host", "127.0.0.1", "--port", "8000", "--policy", "random", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", argv[-1]]
    assert argv[-1] != "29000"
    assert "--mini-lb" in contender("mini_lb").argv(fleet, 8000, None)
    assert contender("pd-router").argv(fleet, 8000, None)[1:3] == ["-m", "router"]


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_profile_summary_counts_self_and_inclusive_shares():
    from bench.profile import summarize

    collapsed = ("process 1:router;run (a/main.py:1);handle (a/proxy.py:10);dumps (orjson:0) 3\n"
                 "process 1:router;run (a/main.py:1);handle (a/proxy.py:12) 1\n"
                 "garbage line\n")
    got = summarize(collapsed)
    assert got["samples"] == 4
    assert dict(got["self_by_function"]) == {"dumps (orjson)": 75.0, "handle (a/proxy.py)": 25.0}
    assert dict(got["inclusive_by_function"])["handle (a/proxy.py)"] == 100.0
    assert dict(got["self_by_file"]) == {"orjson": 75.0, "a/proxy.py": 25.0}
