"""The Grafana dashboard the chart ships (helm/raykv/dashboards/raykv.json) queries only what
raykv exports: every metric in every expression is one that ``ServiceMetrics`` creates, named
as Prometheus sees it, and every label an expression matches or groups by is one of its
metrics' labels. The names come from the code, so a renamed metric fails here."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.util import metrics as ray_metrics

from raykv.service.control import metrics as service_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "raykv" / "dashboards" / "raykv.json"
# How Ray's metrics agent exposes a ray.util.metrics metric on a node's /metrics (Ray 2.60,
# OpenTelemetry's Prometheus exporter; read off a live node): the name in the "ray" namespace,
# a counter with "_total", a histogram as its three series. Ray's own labels (SessionName,
# WorkerId, ...) come on top; the dashboard uses none of them.
NAMESPACE = "ray_"
SERIES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*(\()?")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_LABEL_VALUES = re.compile(r"^label_values\((\w+),\s*(\w+)\)$")


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Prometheus series name -> its label names, for every metric ``ServiceMetrics`` creates
    (the constructors are recorded, not run: no Ray needed)."""
    made: dict[str, set[str]] = {}
    patch = pytest.MonkeyPatch()

    def recorder(kind: str):
        signature = inspect.signature(getattr(ray_metrics, kind))

        def make(*args, **kwargs) -> SimpleNamespace:
            bound = signature.bind(*args, **kwargs).arguments
            labels = set(bound.get("tag_keys") or ())
            for suffix in SERIES[kind]:
                extra = {"le"} if suffix == "_bucket" else set()
                made[NAMESPACE + bound["name"] + suffix] = labels | extra
            return SimpleNamespace()

        return make

    patch.setattr(service_metrics, "metrics", SimpleNamespace(**{k: recorder(k) for k in SERIES}))
    try:
        service_metrics.ServiceMetrics("test")
    finally:
        patch.undo()
    return made


def selectors(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """(metric name, labels matched) of each vector selector of a PromQL ``expr``, and the
    labels it groups or matches by."""
    label_values = _LABEL_VALUES.match(expr)  # a Grafana variable's query
    if label_values:
        return [(label_values[1], {label_values[2]})], set()
    text = _RANGE.sub("", _STRING.sub('""', expr))
    grouped = {g.strip() for m in _GROUPING.finditer(text) for g in m[1].split(",") if g.strip()}
    text = _GROUPING.sub("", text)
    found = []
    for name, braces, call in _SELECTOR.findall(text):
        if call or name.lower() in _KEYWORDS:
            continue  # a function or aggregation, an operator
        found.append((name, set(_MATCHER.findall(braces))))
    assert "{" not in _SELECTOR.sub("", text), f"a selector without a metric name: {expr}"
    return found, grouped


def problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    found, grouped = selectors(expr)
    if not found:
        return [f"no metric in {expr!r}"]
    out = [f"{name} is not exported" for name, _ in found if name not in exported]
    known = [(name, labels) for name, labels in found if name in exported]
    out += [
        f"{name} has no label {label}"
        for name, labels in known
        for label in sorted(labels - exported[name])
    ]
    carried = set().union(*(exported[name] for name, _ in known)) if known else set()
    out += [f"no metric of {expr!r} has label {label}" for label in sorted(grouped - carried)]
    return out


def expressions(dashboard: dict) -> list[str]:
    """Every query of the dashboard: its panels' targets and its variables'."""
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    out = [t["expr"] for p in panels for t in p["targets"]]
    out += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def test_every_query_uses_only_what_raykv_exports(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 10
    assert {p: problems(e, exported) for p, e in enumerate(exprs) if problems(e, exported)} == {}


def test_hit_rates_bytes_per_transport_checksum_errors_and_leases_are_on_it(exported):
    """What the dashboard is for (issue 48): each read from the metric that counts it."""
    used = {n for e in expressions(json.loads(DASHBOARD.read_text())) for n, _ in selectors(e)[0]}
    for name in ("hit_blocks_total", "miss_blocks_total", "fetched_bytes_total",
                 "checksum_errors_total", "reclaimed_leases_total", "blocks_used"):  # fmt: skip
        assert f"{NAMESPACE}raykv_{name}" in used
    assert "transport" in exported[f"{NAMESPACE}raykv_fetched_bytes_total"]


def test_the_check_catches_a_wrong_name_or_label(exported):
    assert problems("sum(rate(ray_raykv_hit_blocks[5m]))", exported) == [
        "ray_raykv_hit_blocks is not exported"
    ]
    assert problems('rate(ray_raykv_hit_blocks_total{tenant="a"}[5m])', exported) == [
        "ray_raykv_hit_blocks_total has no label tenant"
    ]
    assert problems("sum by (tenant) (rate(ray_raykv_hit_blocks_total[5m]))", exported) == [
        "no metric of 'sum by (tenant) (rate(ray_raykv_hit_blocks_total[5m]))' has label tenant"
    ]
    assert problems("label_values(ray_raykv_blocks_used, le)", exported) == [
        "ray_raykv_blocks_used has no label le"
    ]
    assert problems("vector(0)", exported) == ["no metric in 'vector(0)'"]


def test_panels_read_the_dashboards_data_source_and_have_unique_ids():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
