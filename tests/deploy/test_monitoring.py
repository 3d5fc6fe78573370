"""The monitoring configuration: Prometheus's scrape configuration (and promtool's verdict on it),
Grafana's provisioning, and the dashboard's queries, each checked against the metric catalog
(docs/metrics.md) and parsed by a real Prometheus: Debian's, unpacked by `make tools`, started
on loopback for this module and stopped after it.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kvpager import devcerts
from tests.support.prometheus import PromQLError, PrometheusServer
from tests.support.promql import dashboard_queries, documented_metric_names, grafana_to_promql, metric_names

from .compose import CATALOG, DASHBOARD, DATASOURCES, DEPLOY, PROMETHEUS_YML, PROVIDERS, SECRETS, compose_config

pytestmark = pytest.mark.deploy


# -- Prometheus configuration ----------------------------------------------------------------

def test_prometheus_config():
    """Every scrape and the service discovery go over HTTPS, checked against the deployment's CA
    (never insecure_skip_verify); the manager's endpoints with the metrics token."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert jobs["kvpager-manager"]["static_configs"] == [{"targets": ["manager:9400"]}]
    sd = jobs["kvpager-workers"]["http_sd_configs"][0]
    assert sd["url"] == "https://manager:9400/sd/workers"
    for where in (jobs["kvpager-manager"], jobs["kvpager-workers"], sd):
        assert where.get("scheme", "https") == "https"
        assert where["tls_config"]["ca_file"].startswith(SECRETS + "/")
        assert not where["tls_config"].get("insecure_skip_verify", False)
    for where in (jobs["kvpager-manager"], sd):
        assert where["authorization"]["credentials_file"].startswith(SECRETS + "/")


def prometheus_config_with_credentials(tmp_path: Path) -> Path:
    """prometheus.yml with the credentials paths pointing at files devcerts made, as the
    Prometheus container sees its volume."""
    devcerts.ensure(tmp_path / "credentials")
    folder = tmp_path / "credentials" / "prometheus"
    copy = tmp_path / "prometheus.yml"
    copy.write_text(PROMETHEUS_YML.read_text().replace(SECRETS + "/", f"{folder}/"))
    return copy


def test_promtool_accepts_prometheus_config(unpacked_tools, tmp_path):
    promtool = unpacked_tools.require("promtool")
    done = subprocess.run([promtool, "check", "config", str(prometheus_config_with_credentials(tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# -- Grafana provisioning and the dashboard --------------------------------------------------

def test_grafana_provisioning_points_at_the_dashboard(compose_bin):
    grafana = compose_config(compose_bin)["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = source
    provisioning = Path(mounts["/etc/grafana/provisioning"])
    assert provisioning == DEPLOY / "grafana" / "provisioning"

    providers = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert len(providers) == 1 and providers[0]["type"] == "file"
    folder = providers[0]["options"]["path"]
    assert Path(mounts[folder]) == DASHBOARD.parent  # the provider reads the mounted dashboards
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(folder + "/") and (DASHBOARD.parent / home[len(folder) + 1:]).is_file()

    sources = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus" and sources[0]["isDefault"]
    variable = re.fullmatch(r"\$\{(\w+)\}", sources[0]["url"]).group(1)
    assert grafana["environment"][variable] == "http://prometheus:9090"  # the compose network's address


def panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    assert dashboard["uid"] == "kvpager" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid and target["expr"].strip(), panel["title"]



def test_metric_name_tokenizer():
    assert metric_names('histogram_quantile(0.99, sum by (le, kind) (rate(a_seconds_bucket{method="Step"}[$__rate_interval])))') \
        == {"a_seconds_bucket"}
    assert metric_names('sum(rate(x_total[5m] offset 1h)) by (job) / on (rank) group_left (tier) y + 1e-9 > bool z') \
        == {"x_total", "y", "z"}
    assert metric_names('up{job="kvpager-workers", instance=~"a.*"} == 1 and on() vector(1)') == {"up"}
    assert metric_names('count(max_over_time(kvpager_sequences{state="running"}[1h:1m]))') == {"kvpager_sequences"}


def test_dashboard_metrics_exist():
    """Every metric a dashboard query reads is in the catalog, docs/metrics.md (histograms as
    _bucket/_sum/_count), or is a series Prometheus adds itself (up)."""
    known = documented_metric_names(CATALOG)
    assert "kvpager_rpc_duration_seconds_bucket" in known and "kvpager_steps_total" in known
    missing = {}
    for title, expr in dashboard_queries(DASHBOARD):
        names = metric_names(expr)
        assert names, f"{title}: {expr} reads no metric"
        if names - known:
            missing[f"{title}: {expr}"] = sorted(names - known)
    assert not missing, missing


def test_dashboard_jobs_match_the_scrape_config():
    jobs = {job["job_name"] for job in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]}
    used = {job for _, expr in dashboard_queries(DASHBOARD) for job in re.findall(r'job="([^"]+)"', expr)}
    assert used and used <= jobs


@pytest.fixture(scope="module")
def prometheus(unpacked_tools, tmp_path_factory):
    with PrometheusServer("global:\n  scrape_interval: 5s\nscrape_configs: []\n", tmp_path_factory.mktemp("promql"),
                          binary=unpacked_tools.require("prometheus")) as server:
        yield server


def test_dashboard_promql_parses(prometheus):
    """Prometheus itself evaluates every query (a syntax error is errorType bad_data)."""
    with pytest.raises(PromQLError) as bad:
        prometheus.query("sum by (le (rate(x[5m]))")
    assert bad.value.error_type == "bad_data"
    failures = {}
    for title, expr in dashboard_queries(DASHBOARD):
        try:
            prometheus.query(grafana_to_promql(expr))
        except PromQLError as err:
            failures[f"{title}: {expr}"] = str(err)
    assert not failures, failures
