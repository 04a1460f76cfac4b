"""bench.conversion_overhead's accounting: what counts as a failed request, and the overhead summary."""

from collections import Counter

import orjson

from bench.conversion_overhead import answer_problem, summarize


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else orjson.dumps(e)) + b"\n\n" for e in events)


def test_answer_problem_accepts_complete_answers_only():
    done = {"text": "x", "meta_info": {"finish_reason": {"type": "length", "length": 16}}}
    aborted = {"text": "x", "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"}}}
    assert answer_problem(200, orjson.dumps(done), False) is None
    assert answer_problem(200, sse(done, b"[DONE]"), True) is None
    assert answer_problem(200, orjson.dumps(aborted), False) == "finish_abort"
    assert answer_problem(200, sse(aborted, b"[DONE]"), True) == "finish_abort"
    assert answer_problem(200, sse(done), True) == "stream_without_done"
    assert answer_problem(200, sse({"error": {"message": "cut"}}, b"[DONE]"), True) == "stream_error"
    assert answer_problem(503, b"{}", False) == "http_503"


def test_summary_splits_time_and_compares_with_the_direct_switch():
    records = [
        {"outcome": "converted", "duration_s": 0.50, "empty_s": 0.15, "server_switch_s": 0.30, "overhead_s": 0.05},
        {"outcome": "converted", "duration_s": 0.33, "empty_s": 0.01, "server_switch_s": 0.30, "overhead_s": 0.02},
        {"outcome": "restored", "duration_s": 0.10, "empty_s": 0.10, "server_switch_s": None, "overhead_s": 0.0},
    ]
    summary = summarize(records, [0.25, 0.20, 0.30], Counter({"http_502": 2}), 100)
    assert summary["conversions"] == 3 and summary["converted"] == 2
    assert summary["overhead_ms_median"] == 35.0 and summary["overhead_ms_max"] == 50.0
    assert summary["direct_switch_ms_median"] == 250.0
    assert summary["overhead_vs_direct_switch"] == 0.14
    assert summary["failed_requests"] == 2 and summary["client_requests"] == 100


def test_the_chart_shows_each_conversions_parts_beside_the_direct_switch():
    import xml.etree.ElementTree as ET

    from bench.conversion_overhead import chart

    records = [
        {"outcome": "converted", "mode": "drain", "old_role": "decode", "new_role": "prefill", "duration_s": 0.5,
         "empty_s": 0.15, "server_switch_s": 0.30, "overhead_s": 0.05},
        {"outcome": "converted", "mode": "abort", "old_role": "prefill", "new_role": "decode", "duration_s": 0.33,
         "empty_s": 0.01, "server_switch_s": 0.30, "overhead_s": 0.02},
    ]
    root = ET.fromstring(chart(summarize(records, [0.25], Counter(), 10)))
    svg = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in root.iter(svg + "title")]
    assert "drain D>P: emptying the worker 150.0 ms" in titles and "abort P>D: router-side 20.0 ms" in titles
    assert titles.count("drain D>P: direct switch, no router 250.0 ms") == 1 and len(titles) == 8
