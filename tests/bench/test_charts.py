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
