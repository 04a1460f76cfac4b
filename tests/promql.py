"""The metric and label names a PromQL expression reads: enough of PromQL to check the dashboards and alert rules
in deploy/ against a router's /metrics (no parser on PyPI covers PromQL; this reads the names, not the meaning)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Every function and aggregation the artefacts may call; an identifier before "(" that is not here fails, so a
# typo cannot hide as an unknown function.
FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp",
    "clamp_max", "clamp_min", "count", "count_over_time", "count_values", "delta", "deriv", "exp", "floor",
    "group", "histogram_quantile", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time",
    "ln", "max", "max_over_time", "min", "min_over_time", "quantile", "quantile_over_time", "rate", "resets",
    "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "stddev", "sum", "sum_over_time", "time", "timestamp",
    "topk", "vector",
})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"})
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
RANGE = re.compile(r"\[[^\]]*\]")
IDENTIFIER = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)")
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


@dataclass
class Reads:
    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)


def grafana_variables(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in GRAFANA_VARIABLE.finditer(text)}


def reads(expr: str) -> Reads:
    """Metric names and label names (matchers and grouping) that `expr` reads; Grafana variables allowed."""
    out = Reads()
    text = GRAFANA_VARIABLE.sub("0", STRING.sub('""', expr))  # variables sit in strings, ranges or numbers
    for match in GROUPING.finditer(text):
        out.labels.update(label.strip() for label in match.group(2).split(",") if label.strip())
    text = GROUPING.sub(" ", text)
    for match in MATCHERS.finditer(text):
        out.labels.update(MATCHER_LABEL.findall(match.group(1)))
    text = RANGE.sub(" ", MATCHERS.sub(" ", text))
    for match in IDENTIFIER.finditer(text):
        name = match.group(1)
        after = text[match.end():].lstrip()
        if after.startswith("("):
            if name not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {name!r} in {expr!r}")
        elif name not in KEYWORDS:
            out.metrics.add(name)
    if text.count("(") != text.count(")"):
        raise ValueError(f"unbalanced parentheses in {expr!r}")
    return out


LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*?)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$")


def label_values_query(query: str) -> tuple[Reads, str]:
    """Grafana's `label_values(selector, label)`: what the selector reads, and the label it lists."""
    match = LABEL_VALUES.match(query)
    if match is None:
        raise ValueError(f"not a label_values(selector, label) query: {query!r}")
    return reads(match.group(1)), match.group(2)
