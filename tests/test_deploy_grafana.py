"""deploy/grafana/pd-router.json has the shape Grafana imports: panels on its 24-column grid without overlaps,
each with a Prometheus query, every variable it uses defined (the metric names are checked against a router
in test_deploy_metrics.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .promql import grafana_variables, label_values_query, reads

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pd-router.json"
DASHBOARD = json.loads(DASHBOARD_PATH.read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
PANEL_TYPES = {"timeseries", "stat", "table", "state-timeline", "bargauge", "gauge"}
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range", "__range_s"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def variables() -> dict[str, dict]:
    return {v["name"]: v for v in DASHBOARD["templating"]["list"]}


def test_dashboard_model_fields():
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("tags", list),
                      ("time", dict), ("templating", dict)):
        assert isinstance(DASHBOARD[key], kind), key
    assert len(DASHBOARD["uid"]) <= 40 and DASHBOARD["schemaVersion"] >= 36
    assert DASHBOARD.get("id") is None, "an exported dashboard carries no database id"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids))


@pytest.mark.parametrize("panel", PANELS, ids=lambda p: p["title"])
def test_panel_queries_prometheus(panel):
    assert panel["type"] in PANEL_TYPES and panel["title"] and panel.get("description")
    assert panel["datasource"] == DATASOURCE
    assert panel["targets"], "a panel without a query shows nothing"
    ref_ids = [t["refId"] for t in panel["targets"]]
    assert len(ref_ids) == len(set(ref_ids))
    for target in panel["targets"]:
        assert target["datasource"] == DATASOURCE
        assert reads(target["expr"]).metrics, f"{target['expr']!r} reads no metric"


def test_panels_tile_the_grid_without_overlapping():
    cells: dict[tuple[int, int], str] = {}
    for panel in DASHBOARD["panels"]:
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in "hwxy") and pos["w"] > 0 and pos["h"] > 0
        assert pos["x"] + pos["w"] <= 24, f"{panel['title']}: wider than the grid"
        if panel["type"] == "row":
            assert pos == {"h": 1, "w": 24, "x": 0, "y": pos["y"]} and panel["panels"] == []
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_variable_used_is_defined():
    defined = set(variables()) | BUILTIN_VARIABLES
    used = grafana_variables(json.dumps(DASHBOARD["panels"]))  # queries, legends, data sources
    for variable in variables().values():
        used |= grafana_variables(json.dumps(variable.get("query", "")))
    assert used - defined == set()
    assert {"datasource", "job", "instance"} <= used


def test_the_datasource_variable_picks_a_prometheus():
    datasource = variables()["datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"


@pytest.mark.parametrize("name", ["job", "instance", "route"])
def test_query_variables_list_label_values_of_router_metrics(name):
    variable = variables()[name]
    assert variable["type"] == "query" and variable["datasource"] == DATASOURCE
    selector, label = label_values_query(variable["query"]["query"])
    assert variable["definition"] == variable["query"]["query"]
    assert label == name and all(m.startswith("pd_router_") for m in selector.metrics)
    if variable.get("includeAll"):
        assert variable["allValue"] == ".*", "All must match every value in a =~ matcher"
