"""deploy/grafana/pardec.json, the Grafana dashboard of pardec's metrics: well formed, and every
metric and label its queries name is one the services export (gateway, verifier, drafter)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pardec.gateway.metrics import GatewayMetrics
from pardec.runtime.metrics import RequestMetrics, new_registry
from pardec.verifier.metrics import verifier_metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "pardec.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
TARGET_LABELS = {"job", "instance", "le"}  # Prometheus's own, and a histogram's bucket


def exported(engine) -> dict[str, tuple[str, set[str]]]:
    """Every series name the three services export: its family's type, and the labels it carries."""
    drafter = new_registry()
    RequestMetrics(drafter, "pardec_drafter")
    names: dict[str, tuple[str, set[str]]] = {}
    for registry in (GatewayMetrics().registry, verifier_metrics(engine)[0], drafter):
        collectors = getattr(registry, "_names_to_collectors", {})
        for family in registry.collect():
            owner = collectors.get(family.name) or collectors.get(family.name + "_total")
            labels = set(getattr(owner, "_labelnames", ()))
            for suffix in SUFFIXES.get(family.type, ("",)):
                names[family.name + suffix] = (family.type, labels)
    return names


def test_the_dashboard_names_only_what_the_services_export(engine):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pardec" and dashboard["panels"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    names = exported(engine)
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        assert panel["title"] and panel["description"] and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            used = re.findall(r"\bpardec_\w+", expr)
            assert used, expr
            for name in used:
                assert name in names, f"{panel['title']}: {name} is not exported"
                kind = names[name][0]
                over_time = re.search(rf"\b(rate|increase)\(\s*{name}\b", expr) is not None
                # A counter's (or a histogram's series') value only means something as a rate; a gauge's is one.
                assert over_time == (kind != "gauge"), (panel["title"], name, kind)
            labels = set().union(*(names[name][1] for name in used)) | TARGET_LABELS
            grouped = [label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
                       for label in group.split(",")]
            selected = [label for selector in re.findall(r"\{([^}]*)\}", expr)
                        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector)]
            for label in (*grouped, *selected, *re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"])):
                assert label in labels, (panel["title"], expr, label)
            if "histogram_quantile" in expr:
                assert all(name.endswith("_bucket") for name in used) and "by (le" in expr, expr
