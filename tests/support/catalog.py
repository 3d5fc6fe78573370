"""The metric catalog, docs/metrics.md, against what a live /metrics endpoint exports.

``check_exports`` holds a scrape to one table of the catalog both ways: every row is exported
with its type and labels, and nothing named ``kvpager_*`` is exported that the table lacks.
"""

from __future__ import annotations

import pathlib
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

CATALOG = pathlib.Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def catalog(section: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) of each row of the table under ``## <section>``."""
    text = CATALOG.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`kvpager_"):
            labels = re.sub(r"\([^)]*\)", "", cells[2])  # drop the lists of values
            rows[cells[0].strip("`")] = (cells[1], set(re.findall(r"`(\w+)`", labels)))
    assert rows, f"no {section} table found in docs/metrics.md"
    return rows


def scrape_families(address: str) -> dict[str, object]:
    """Family name (as the catalog writes it) -> parsed family, of http://address/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        # The text format's parser names a counter without _total; the catalog with it.
        families[family.name + "_total" if family.type == "counter" else family.name] = family
    return families


def check_exports(families: dict[str, object], section: str) -> None:
    rows = catalog(section)
    for name, (kind, labels) in rows.items():
        assert name in families, f"{name} is in docs/metrics.md but not exported"
        family = families[name]
        assert family.type == ("gauge" if kind == "info" else kind), name  # the text format has no info type
        exported = {label for s in family.samples for label in s.labels} - {"le"}
        assert exported == labels, (name, exported, labels)
    extra = {n for n in families if n.startswith("kvpager_")} - set(rows)  # no *_created series: metrics_http
    assert not extra, f"exported but not in the {section} table of docs/metrics.md: {sorted(extra)}"
