"""config/monitoring/ against the proxy: every metric the Grafana dashboard and the Prometheus rules name is
one a running proxy exports (scraped after some traffic), the PrometheusRule holds the same rules as the plain
file, and the dashboard is well-formed. The rules' own behaviour is tested by promtool (`make rules`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.clients import ClientFactory
from tests.support.ops import scrape
from tests.support.processes import ROOT
from tests.support.wire import policies

MONITORING = ROOT / "config" / "monitoring"
METRIC = re.compile(r"\bmcp_tasks_proxy_[a-z_]+\b")


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return loaded


def rule_groups(path: Path) -> list[dict[str, Any]]:
    document = yaml.safe_load(path.read_text())
    groups: list[dict[str, Any]] = document["spec"]["groups"] if "spec" in document else document["groups"]
    return groups


def named_metrics() -> dict[str, set[str]]:
    """Every metric name the dashboard's queries and the rules' expressions use, with where."""
    named: dict[str, set[str]] = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            for name in METRIC.findall(target["expr"]):
                named.setdefault(name, set()).add(f"panel {panel['title']!r}")
    for variable in dashboard()["templating"]["list"]:
        for name in METRIC.findall(variable.get("definition", "")):
            named.setdefault(name, set()).add(f"variable {variable['name']}")
    for group in rule_groups(MONITORING / "rules.yaml"):
        for rule in group["rules"]:
            for name in METRIC.findall(rule["expr"]):
                named.setdefault(name, set()).add(f"alert {rule['alert']}")
    return named


def exported(text: str) -> tuple[set[str], set[str]]:
    """The sample names a scrape declares (counters with `_total`, histograms with their series) and those it
    has samples of."""
    declared: set[str] = set()
    sampled: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(family.type, [""])
        declared.update(family.name + suffix for suffix in suffixes)
        sampled.update(sample.name for sample in family.samples)
    return declared, sampled


async def test_every_metric_the_dashboard_and_the_rules_name_is_exported(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(greet={"mode": "required"}))
    task_id = await client.create("greet", {"name": "metrics"})
    assert (await client.settled(task_id))["status"] == "completed"
    assert await client.text("echo", {"text": "hi"}) == "hi"
    declared, sampled = exported(await scrape(client.client.app))
    named = named_metrics()
    assert len(named) >= 20
    missing = {name: sorted(where) for name, where in named.items() if name not in declared}
    assert missing == {}
    # After this traffic the core series have samples, not only declarations.
    for name in (
        "mcp_tasks_proxy_requests_total",
        "mcp_tasks_proxy_tasks_created_total",
        "mcp_tasks_proxy_tasks_settled_total",
        "mcp_tasks_proxy_upstream_request_duration_seconds_count",
        "mcp_tasks_proxy_tasks",
        "mcp_tasks_proxy_store_up",
        "mcp_tasks_proxy_lease_held",
        "mcp_tasks_proxy_upstream_sessions",
        "mcp_tasks_proxy_draining",
        "mcp_tasks_proxy_drain_calls_left",
        "mcp_tasks_proxy_config_reloads_total",
        "mcp_tasks_proxy_config_last_reload_success_timestamp_seconds",
        "mcp_tasks_proxy_config_info",
    ):
        assert name in sampled, name


def test_the_prometheusrule_holds_the_plain_rules() -> None:
    assert rule_groups(MONITORING / "prometheusrule.yaml") == rule_groups(MONITORING / "rules.yaml")
    manifest = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")


GUIDE = ROOT / "docs" / "guides" / "monitoring.md"  # the alerts and the dashboard's panels are explained there


def test_every_alert_has_a_severity_a_summary_and_an_entry_in_the_monitoring_guide() -> None:
    guide = GUIDE.read_text()
    for group in rule_groups(MONITORING / "rules.yaml"):
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert rule["annotations"]["summary"]
            assert f"`{rule['alert']}`" in guide, rule["alert"]


def test_the_dashboard_is_well_formed_and_every_panel_is_explained() -> None:
    board = dashboard()
    guide = GUIDE.read_text()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["description"]
        assert panel["targets"]
        assert f"**{panel['title']}**" in guide, panel["title"]
