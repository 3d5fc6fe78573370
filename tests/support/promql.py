"""PromQL helpers for tests: which metrics an expression reads, and which metrics exist.

:func:`metric_names` is a small tokenizer, not a parser (a real Prometheus parses the
expressions in the tests that need one): it drops strings, label matchers ``{...}``, ranges
``[...]`` and ``by``/``without``/``on``/``ignoring``/``group_*`` label lists, then keeps every
identifier that is not a keyword and not followed by ``(`` (a function or an aggregation).

:func:`documented_metric_names` reads the metric catalog, docs/metrics.md, the only list of
metric names that exist, and adds the series names Prometheus sees for each type.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

# Keywords and operators spelled as words; everything else that looks like a name and is not
# called is a metric name.
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                      "unless", "offset", "atan2", "inf", "nan"})
# Series every scrape target has without exporting it.
SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                       "scrape_samples_post_metric_relabeling", "scrape_series_added"})
# Grafana's interval macros, replaced by a plain duration before Prometheus sees an expression.
GRAFANA_MACROS = {"$__rate_interval": "1m", "${__rate_interval}": "1m", "$__interval": "15s",
                  "${__interval}": "15s", "$__range": "1h", "${__range}": "1h"}

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-zA-Z]*|\$\{?\w+\}?|[a-zA-Z_:][a-zA-Z0-9_:]*")
_CATALOG_ROW = re.compile(r"^\|\s*`([a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*(gauge|counter|histogram|summary|info)\s*\|")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    names = set()
    for match in _TOKEN.finditer(text):
        token = match.group(0)
        if token[0].isdigit() or token[0] == "$" or token.lower() in KEYWORDS:
            continue
        if text[match.end():].lstrip().startswith("("):
            continue
        names.add(token)
    return names


def documented_metric_names(catalog: Path) -> set[str]:
    """Every series name the catalog's tables define: gauges and counters as written (counters
    already end in ``_total``), histograms as ``_bucket``/``_sum``/``_count``, summaries as
    themselves plus ``_sum``/``_count``, info metrics as their ``_info`` name; plus the series
    Prometheus adds to every target (``up``, ``scrape_*``)."""
    names = set(SYNTHETIC)
    for line in catalog.read_text().splitlines():
        match = _CATALOG_ROW.match(line.strip())
        if not match:
            continue
        name, kind = match.groups()
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        elif kind == "summary":
            names.update(f"{name}{suffix}" for suffix in ("", "_sum", "_count"))
        elif kind == "info":
            names.add(name if name.endswith("_info") else f"{name}_info")
        else:
            names.add(name)
    return names


def grafana_to_promql(expr: str) -> str:
    """``expr`` with Grafana's interval macros replaced by durations; ValueError for any other
    ``$variable`` (a dashboard variable this helper does not know)."""
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    leftover = re.findall(r"\$\{?\w+\}?", expr)
    if leftover:
        raise ValueError(f"unknown Grafana variables {leftover} in {expr!r}")
    return expr


def dashboard_queries(dashboard: Path) -> Iterator[tuple[str, str]]:
    """(panel title, expr) for every query target of every panel, rows' nested panels included."""
    def walk(panels: list) -> Iterator[tuple[str, str]]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                if "expr" in target:
                    yield panel.get("title", "?"), target["expr"]

    yield from walk(json.loads(dashboard.read_text())["panels"])
