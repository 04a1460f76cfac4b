"""bench/charts.py: the SVG it writes parses, holds one bar per value with its figure, and scales to the axis."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from bench import charts

SVG = "{http://www.w3.org/2000/svg}"


def test_grouped_bars_draw_one_bar_per_value_scaled_to_the_axis():
    svg = charts.grouped_bars("t", ["a", "b"], {"x": [50.0, 100.0], "y": [25.0, 0.0]}, y_max=100.0, height=300)
    root = ET.fromstring(svg)
    bars = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert [r.find(SVG + "title").text for r in bars] == ["a: x 50.0%", "a: y 25.0%", "b: x 100.0%", "b: y 0.0%"]
    heights = [float(r.get("height")) for r in bars]
    assert heights[2] == 2 * heights[0] == 4 * heights[1] and heights[3] == 0
    labels = {t.text for t in root.iter(SVG + "text")}
    assert {"a", "b", "x", "y", "100%"} <= labels


def test_a_value_over_the_axis_is_clipped_not_drawn_off_the_chart():
    svg = charts.grouped_bars("t", ["a"], {"x": [150.0]}, y_max=100.0, height=300)
    (bar,) = [r for r in ET.fromstring(svg).iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert float(bar.get("y")) >= 0


def test_the_live_benchmarks_chart_has_a_bar_per_variant_and_phase_and_overall():
    from bench import rebalance_splits as rs
    result = {"servers": 4, "phases": [{"name": "prefill-heavy"}, {"name": "decode-heavy"}],
              "results": {name: {"phases": [{"goodput": a}, {"goodput": b}], "overall": {"goodput": (a + b) / 2}}
                          for name, a, b in (("static 3P1D", 1.0, 0.0), ("rebalancer", 0.9, 0.5))}}
    root = ET.fromstring(rs.chart(result))
    titles = [r.find(SVG + "title").text for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert titles == ["1. prefill-heavy: static 3P1D 100.0%", "1. prefill-heavy: rebalancer 90.0%",
                      "2. decode-heavy: static 3P1D 0.0%", "2. decode-heavy: rebalancer 50.0%",
                      "overall: static 3P1D 50.0%", "overall: rebalancer 70.0%"]


def test_the_router_comparison_chart_has_a_bar_per_router_and_point_without_the_baseline():
    from bench import report

    def row(router, concurrency, rps, cpu):
        return {"router": router, "mode": "non-stream", "concurrency": concurrency, "rps": rps,
                "router_cpu_ms_per_req": cpu}

    result = {"setup": "ceiling", "best": [row("direct", 16, 9000, None), row("pd-router", 16, 4899, 0.23),
                                           row("mini_lb", 16, 847, 1.43), row("pd-router", 64, 3645, 0.32),
                                           row("mini_lb", 64, 501, 2.33)]}
    root = ET.fromstring(report.chart(result))
    titles = [t.text for t in root.iter(SVG + "title")]
    assert titles == ["non-stream c=16: mini_lb 847.0", "non-stream c=16: pd-router 4899.0",
                      "non-stream c=64: mini_lb 501.0", "non-stream c=64: pd-router 3645.0"]
    cpu = [t.text for t in ET.fromstring(report.chart(result, "router_cpu_ms_per_req")).iter(SVG + "title")]
    assert cpu[0] == "non-stream c=16: mini_lb 1.4"


def test_a_small_figure_keeps_two_significant_digits():
    svg = charts.grouped_bars("t", ["a"], {"x": [0.152], "y": [7705.0]}, unit="")
    figures = {t.text for t in ET.fromstring(svg).iter(SVG + "text")}
    assert {"0.15", "7705"} <= figures  # 0.152 was written as 0
