"""The Grafana dashboard's queries and Prometheus scrapes, for the tests that check one against the other."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "scripts" / "monitoring" / "grafana" / "dashboards" / "batchinfer.json"
_METRIC_NAME = re.compile(r"\bbatchinfer[a-zA-Z0-9_:]*")


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard's panels."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def dashboard_metric_names() -> set[str]:
    """The sample names (``..._bucket``, ``..._total``) the dashboard's expressions query."""
    return {name for expr in dashboard_exprs() for name in _METRIC_NAME.findall(expr)}


def parse_scrape(text: str) -> dict[str, Any]:
    """``{family name: family}`` of a Prometheus text exposition (prometheus_client's parser)."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_names(families: dict[str, Any]) -> set[str]:
    return {sample.name for family in families.values() for sample in family.samples}


def sample_value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    """The sum of ``sample_name``'s samples whose labels include ``labels`` (0 when none)."""
    return sum(
        sample.value
        for family in families.values()
        for sample in family.samples
        if sample.name == sample_name and labels.items() <= sample.labels.items()
    )
