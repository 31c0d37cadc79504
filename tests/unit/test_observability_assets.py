"""The operators' assets under deploy/: Prometheus rules and alerts (checked and unit-tested
with promtool), the Grafana dashboard and its provisioning, and the local compose stack. Every
PromQL expression may only name metrics the service exports (or rules recorded in rules.yml, or
Prometheus' own `up`) and labels those metrics carry, none may filter or group by a tenant or
session, README "Metrics" names every metric with its labels, every aggregation keeps
`job` and `namespace`, every alert links an absolute runbook_url to a section of
deploy/README.md, and every dashboard query follows the dashboard's job and namespace
variables. The Kubernetes copies of the rules and the dashboard are what
scripts/gen_monitoring.py writes."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml
from context_engine.config import Config, split_addr
from context_engine.telemetry.metrics import Metrics
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
RULES = PROMETHEUS / "rules.yml"
RULES_TEST = PROMETHEUS / "rules_test.yml"
PROMETHEUS_CONFIG = PROMETHEUS / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "context-engine.json"
GRAFANA_DASHBOARDS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "context-engine.yml"
GRAFANA_DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
TOKENS = DEPLOY / "compose" / "tokens.json"
DEMO_TOKEN = "ce-local-demo-token"  # the documented local demo token of the compose stack


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------- promtool


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not on PATH: run scripts/ensure-promtool (as root it installs "
                    "Debian's prometheus package; otherwise it says how to install promtool)")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def _assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{result.args}:\n{result.stdout}\n{result.stderr}"


def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", str(RULES))
    _assert_ok(result)
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    result = _promtool("test", "rules", str(RULES_TEST))
    _assert_ok(result)
    assert "SUCCESS" in result.stdout


def test_promtool_checks_the_prometheus_config_with_its_rules() -> None:
    result = _promtool("check", "config", str(PROMETHEUS_CONFIG))
    _assert_ok(result)
    assert "1 rule files found" in result.stdout


# ---------------------------------------------------------------------------- rules


def _rules() -> list[dict[str, Any]]:
    return [rule for group in _yaml(RULES)["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def _recorded() -> set[str]:
    return {rule["record"] for rule in _rules() if "record" in rule}


EXPECTED_ALERTS = {
    "ContextEnginePrefixHashMismatch", "ContextEngineEpochsPerSessionHigh",
    "ContextEngineBudgetExceeded", "ContextEngineEstimatorUndercount",
    "ContextEngineCachedPrefixRatioLow", "ContextEngineBuildLatencyHigh",
    "ContextEngineRpcErrors", "ContextEngineTargetDown", "ContextEngineTargetMissing",
}
# absent() cannot keep the labels of series that do not exist: it fires with none.
UNLABELLED_ALERTS = {"ContextEngineTargetMissing"}
SCOPE = ("job", "namespace")


def test_the_alerts_cover_the_tracked_failure_modes() -> None:
    assert {alert["alert"] for alert in _alerts()} == EXPECTED_ALERTS


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in _yaml(RULES_TEST)["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert firing >= EXPECTED_ALERTS, f"no firing case for {EXPECTED_ALERTS - firing}"
    assert quiet >= EXPECTED_ALERTS, f"no quiet case for {EXPECTED_ALERTS - quiet}"


def test_every_recording_rule_has_a_value_test() -> None:
    tested = " ".join(check["expr"] for case in _yaml(RULES_TEST)["tests"]
                      for check in case.get("promql_expr_test", []))
    untested = {name for name in _recorded() if name not in tested}
    assert not untested, f"recording rules without a promql_expr_test: {sorted(untested)}"


def _readme_anchors() -> set[str]:
    anchors = set()
    for line in (DEPLOY / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


def test_every_alert_has_severity_summary_description_and_a_runbook_section() -> None:
    anchors = _readme_anchors()
    bases = set()
    for alert in _alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in {"critical", "warning"}, name
        annotations = alert["annotations"]
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        assert "runbook" not in annotations, f"{name}: the annotation is runbook_url"
        url = urllib.parse.urlsplit(annotations["runbook_url"])
        assert url.scheme == "https" and url.netloc, f"{name}: runbook_url is not absolute"
        assert url.fragment in anchors, f"{name}: deploy/README.md has no section #{url.fragment}"
        assert url.fragment == name.lower(), name
        bases.add(url._replace(fragment="").geturl())
    assert len(bases) == 1, f"one runbook base for every alert: {sorted(bases)}"


def test_the_runbook_anchor_check_fails_on_a_missing_section() -> None:
    assert "contextenginerpcerrors" in _readme_anchors()
    assert "contextengineneverwritten" not in _readme_anchors()


# ---------------------------------------------------------------------------- job, namespace

_AGGREGATION = re.compile(r"\b(sum|count|avg|min|max|group|stddev|stdvar|topk|bottomk|quantile|"
                          r"count_values)\s*(?:(by|without)\s*\(([^()]*)\))?\s*\(")
_MATCHING = re.compile(r"\b(on|ignoring)\s*\(([^()]*)\)")


def scope_problems(expr: str) -> list[str]:
    """Where an expression aggregates or matches without keeping `job` and `namespace`."""
    text = _STRING.sub('""', expr)
    problems = []
    for found in _AGGREGATION.finditer(text):
        labels = {label.strip() for label in (found.group(3) or "").split(",")}
        if found.group(2) != "by" or not set(SCOPE) <= labels:
            problems.append(f"{found.group(0)!r} does not keep job and namespace")
    for found in _MATCHING.finditer(text):
        labels = {label.strip() for label in found.group(2).split(",")}
        keeps = set(SCOPE) <= labels if found.group(1) == "on" else not labels & set(SCOPE)
        if not keeps:
            problems.append(f"{found.group(0)!r} matches across jobs or namespaces")
    return problems


def test_scope_problems_sees_dropped_labels() -> None:
    assert scope_problems("sum by (job, namespace, le) (rate(x[5m]))") == []
    assert scope_problems("a > 1 and on (job, namespace) b") == []
    for bad in ("sum(rate(x[5m]))", "sum by (job) (x)", "max without (pod) (x)",
                "a and on () b", "a / ignoring (namespace) b", "count(up == 0)"):
        assert scope_problems(bad), bad


def test_every_rule_aggregates_by_job_and_namespace() -> None:
    for name, expr in _rule_expressions():
        assert not scope_problems(expr), f"{name}: {scope_problems(expr)}"
        if name in UNLABELLED_ALERTS:
            assert expr.strip().startswith("absent("), name
            continue
        # every selector of a raw series leaves job and namespace alone
        assert not re.search(r"\b(job|namespace)\s*(=|!=|!~)[^~]", _STRING.sub('""', expr)), name


def test_the_rule_tests_carry_job_and_namespace() -> None:
    """Every input series of the promtool tests has both labels, and every expected sample
    and alert keeps them: a rule that drops one fails its promtool test."""
    for case in _yaml(RULES_TEST)["tests"]:
        for series in case["input_series"]:
            for label in SCOPE:
                assert f'{label}="' in series["series"], (case["name"], series["series"])
        for check in case.get("promql_expr_test", []):
            for sample in check["exp_samples"]:
                for label in SCOPE:
                    assert f'{label}="' in sample["labels"], (case["name"], check["expr"])
        for check in case.get("alert_rule_test", []):
            for alert in check.get("exp_alerts") or []:
                if check["alertname"] in UNLABELLED_ALERTS:
                    continue
                assert set(SCOPE) <= set(alert["exp_labels"]), (case["name"],
                                                                 check["alertname"])
    namespaces = {re.search(r'namespace="([^"]*)"', series["series"]).group(1)  # type: ignore[union-attr]
                  for case in _yaml(RULES_TEST)["tests"] for series in case["input_series"]}
    assert len(namespaces) >= 2, "no case with two namespaces in one Prometheus"


# ---------------------------------------------------------------------------- gen_monitoring

GEN = ROOT / "scripts" / "gen_monitoring.py"


def _gen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_kubernetes_copies_of_the_rules_and_the_dashboard_are_up_to_date() -> None:
    done = _gen("--check")
    assert done.returncode == 0, done.stderr


def test_a_new_runbook_base_rewrites_every_link_and_the_tests_still_pass(tmp_path) -> None:
    root = tmp_path / "repo"
    for rel in ("deploy/prometheus", "deploy/grafana/dashboards"):
        shutil.copytree(ROOT / rel, root / rel)
    base = "https://wiki.example.org/ops/context-engine"
    done = _gen("--root", str(root), "--runbook-base", base)
    assert done.returncode == 0, done.stderr
    rules = yaml.safe_load((root / "deploy/prometheus/rules.yml").read_text())
    urls = [r["annotations"]["runbook_url"] for g in rules["groups"] for r in g["rules"]
            if "alert" in r]
    assert urls and all(u.startswith(base + "#") for u in urls)
    rendered = (root / "deploy/kubernetes/components/monitoring/prometheusrule.yaml").read_text()
    assert yaml.safe_load(rendered)["spec"]["groups"] == rules["groups"]
    test_text = (root / "deploy/prometheus/rules_test.yml").read_text()
    assert "git.example.com" not in test_text and base + "#" in test_text
    result = subprocess.run(["promtool", "test", "rules", "rules_test.yml"],
                            cwd=root / "deploy/prometheus", capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    # a relative base is refused
    assert _gen("--root", str(root), "--runbook-base", "deploy/README.md").returncode == 2


# ---------------------------------------------------------------------------- PromQL names

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan", "atan2"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression selects, filters or groups by."""
    text = _STRING.sub('""', expr)
    labels = {label for body in _MATCHERS.findall(text)
              for label in _MATCHER_LABEL.findall(body)}
    labels |= {label.strip() for body in _GROUPING.findall(text)
               for label in body.split(",") if label.strip()}
    text = _GROUPING.sub(" ", _RANGE.sub(" ", _MATCHERS.sub(" ", text)))
    metrics = {name for name in _IDENT.findall(text) if name.lower() not in _KEYWORDS}
    return metrics, labels


def test_promql_names_finds_metrics_and_labels_and_ignores_functions() -> None:
    metrics, labels = promql_names(
        'histogram_quantile(0.99, sum by (method, le) (rate(a_bucket{code!~"OK|x"}[5m])))'
        ' / on () b:rec:ratio5m > 1e3 and ignoring(tenant_id) c offset 5m'
        ' unless sum without (x) (d{session="s", y=~"z"})')
    assert metrics == {"a_bucket", "b:rec:ratio5m", "c", "d"}
    assert labels == {"method", "le", "code", "tenant_id", "x", "session", "y"}


def exported_sample_names() -> set[str]:
    """Every sample name the service's metrics expose, labelled ones given one child each."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for collector in vars(metrics).values():
        if isinstance(collector, MetricWrapperBase) and collector._labelnames:
            collector.labels(*["probe"] * len(collector._labelnames))
    return {sample.name for family in registry.collect() for sample in family.samples}


def test_exported_sample_names_follow_the_metric_types() -> None:
    names = exported_sample_names()
    assert {"context_engine_sessions_opened_total", "context_engine_epochs_total",
            "context_engine_rpc_seconds_bucket", "context_engine_rpc_seconds_count",
            "context_engine_estimator_correction_factor", "context_engine_build_info",
            "grpc_server_started_total", "grpc_server_handled_total",
            "grpc_server_msg_received_total", "grpc_server_msg_sent_total",
            "grpc_server_handling_seconds_bucket"} <= names
    assert "context_engine_epochs" not in names


def _rule_expressions() -> list[tuple[str, str]]:
    return [(rule.get("record") or rule["alert"], str(rule["expr"])) for rule in _rules()]


def _dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return document


def _dashboard_expressions() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in _dashboard()["panels"]
            for target in panel.get("targets", [])]


def test_rules_name_only_exported_metrics_or_recorded_rules() -> None:
    known = exported_sample_names() | _recorded() | {"up"}  # up: Prometheus' own, per target
    for name, expr in _rule_expressions():
        metrics, _ = promql_names(expr)
        assert metrics, f"{name}: no metric found in {expr!r}"
        assert metrics <= known, f"{name}: not exported: {sorted(metrics - known)}"


def test_dashboard_names_only_exported_metrics_or_recorded_rules() -> None:
    exported = exported_sample_names()
    recorded = _recorded()
    for title, expr in _dashboard_expressions():
        metrics, _ = promql_names(expr)
        assert metrics, f"{title}: no metric found in {expr!r}"
        rules = {name for name in metrics if ":" in name}
        assert rules <= recorded, f"{title}: not recorded in rules.yml: {sorted(rules - recorded)}"
        raw = metrics - rules
        assert raw <= exported, f"{title}: not exported: {sorted(raw - exported)}"


def exported_labels() -> dict[str, set[str]]:
    """The label names of every sample name the service's metrics expose (``le`` on a
    histogram's buckets)."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for collector in vars(metrics).values():
        if isinstance(collector, MetricWrapperBase) and collector._labelnames:
            collector.labels(*["probe"] * len(collector._labelnames))
    return {sample.name: set(sample.labels) for family in registry.collect()
            for sample in family.samples}


# What Prometheus adds to every scraped series (the scrape config's job, the Kubernetes
# namespace, the target's instance).
TARGET_LABELS = {"job", "namespace", "instance"}


def _recorded_labels() -> dict[str, set[str]]:
    """The labels a recorded rule may keep: those of what its expression reads."""
    exported = exported_labels()
    kept: dict[str, set[str]] = {}
    for rule in _rules():
        if "record" in rule:
            metrics, _ = promql_names(str(rule["expr"]))
            kept[rule["record"]] = set().union(
                TARGET_LABELS, *(exported.get(m, set()) | kept.get(m, set()) for m in metrics))
    return kept


def test_rules_and_dashboard_use_only_labels_their_metrics_have() -> None:
    """A label an expression filters or groups by that none of its metrics carries (a label
    renamed in the code, or misspelt in a rule) matches nothing or folds every series into one,
    without an error: each must be a label of a metric the expression reads, or the target's."""
    exported = exported_labels()
    recorded = _recorded_labels()
    for name, expr in _rule_expressions() + _dashboard_expressions():
        metrics, labels = promql_names(expr)
        carried = set().union(TARGET_LABELS, *(exported.get(m, set()) | recorded.get(m, set())
                                               for m in metrics))
        assert labels <= carried, f"{name}: no metric of it has {sorted(labels - carried)}"


def test_readme_names_every_metric_with_its_labels() -> None:
    """README "Metrics" names each metric the service registers, as exposed (a counter with
    ``_total``), with its labels in braces; the gRPC server metrics' common labels (``grpc_type``,
    ``grpc_service``, ``grpc_method``) are said once for all of them."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^### Metrics\n(.*?)^### ", text, re.S | re.M)
    assert section, "README.md has no '### Metrics' section"
    documented: dict[str, set[str]] = {}
    for name, labels in re.findall(r"`((?:context_engine|grpc_server)_[a-z_]+)"
                                   r"(?:\{([a-z_,]+)\})?`", section.group(1)):
        documented.setdefault(name, set()).update(labels.split(",") if labels else ())
    grpc_common = {"grpc_type", "grpc_service", "grpc_method"}
    assert all(f"`{label}`" in section.group(1) for label in grpc_common)
    registered: dict[str, set[str]] = {}
    for collector in vars(Metrics(CollectorRegistry())).values():
        if isinstance(collector, MetricWrapperBase):
            name = collector._name + ("_total" if collector._type == "counter" else "")
            labels = set(collector._labelnames)
            registered[name] = labels - grpc_common if name.startswith("grpc_") else labels
    assert documented == registered


def test_every_dashboard_query_follows_the_job_and_namespace_variables() -> None:
    for title, expr in _dashboard_expressions():
        metrics, _ = promql_names(expr)
        for metric in metrics:
            for found in re.finditer(rf"(?<![\w:]){re.escape(metric)}(?![\w:])(\{{[^}}]*\}})?",
                                     expr):
                matchers = found.group(1) or ""
                assert 'job=~"$job"' in matchers and 'namespace=~"$namespace"' in matchers, \
                    f"{title}: {metric} without the job and namespace variables in {expr!r}"


def test_no_expression_filters_or_groups_by_tenant_or_session() -> None:
    for name, expr in _rule_expressions() + _dashboard_expressions():
        _, labels = promql_names(expr)
        assert "__name__" not in labels, name
        bad = {label for label in labels if re.search("tenant|session", label, re.I)}
        assert not bad, f"{name}: groups or filters by {sorted(bad)}"
        assert "tenant" not in expr.lower(), name


# ---------------------------------------------------------------------------- Grafana


def test_dashboard_has_the_operator_panels_and_a_datasource_variable() -> None:
    dashboard = _dashboard()
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Epochs per session (6h)", "Rotations by reason", "Budget pressure by step",
            "Budget exceeded by class", "Cached prefix ratio", "Estimator error by model",
            "Build latency", "RPC errors by method and code",
            "Compactions per thousand Builds"} <= titles
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    for name in SCOPE:  # a query variable per label, "All" matching a missing label too
        variable = variables[name]
        assert variable["type"] == "query", name
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        query = variable["query"]["query"]
        assert re.fullmatch(rf"label_values\(context_engine_build_info(\{{[^}}]*\}})?, {name}\)",
                            query), query
        assert variable["definition"] == query
        assert variable["includeAll"] is True and variable["allValue"] == ".*", name
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    latency = next(p for p in dashboard["panels"] if p["title"] == "Build latency")
    quantiles = {q for t in latency["targets"]
                 for q in re.findall(r"histogram_quantile\(([\d.]+)", t["expr"])}
    assert {"0.5", "0.95", "0.99"} <= quantiles
    # the spec's compaction rate (per thousand turns; each turn makes at least one Build)
    rate = next(p for p in dashboard["panels"] if p["title"] == "Compactions per thousand Builds")
    assert [re.sub(r"\{.*\}", "", t["expr"]) for t in rate["targets"]] == [
        "context_engine:compactions_per_1k_builds:ratio1h"]
    # and the share reaching depth 2, beside it
    depth = next(p for p in dashboard["panels"]
                 if p["title"] == "Share of compactions reaching depth 2")
    assert [re.sub(r"\{.*\}", "", t["expr"]) for t in depth["targets"]] == [
        "context_engine:compactions_depth2_share:ratio1h"]


def test_grafana_provisioning_points_at_the_compose_services() -> None:
    compose = _yaml(COMPOSE)
    grafana = compose["services"]["grafana"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in grafana["volumes"]}
    providers = _yaml(GRAFANA_DASHBOARDS)["providers"]
    assert [p["type"] for p in providers] == ["file"]
    dashboards_dir = providers[0]["options"]["path"]
    assert (COMPOSE.parent / mounts[dashboards_dir] / DASHBOARD.name).resolve() == DASHBOARD
    assert (COMPOSE.parent / mounts["/etc/grafana/provisioning"]).resolve() == \
        GRAFANA_DASHBOARDS.parents[1]
    (source,) = _yaml(GRAFANA_DATASOURCES)["datasources"]
    assert source["type"] == "prometheus"
    match = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"])
    assert match is not None
    assert match.group(1) in compose["services"]
    prometheus_ports = compose["services"][match.group(1)]["ports"]
    assert any(port.endswith(f":{match.group(2)}") for port in prometheus_ports)


# ---------------------------------------------------------------------------- compose


def _compose() -> dict[str, Any]:
    document: dict[str, Any] = _yaml(COMPOSE)
    return document


def test_compose_builds_from_the_repository_dockerfile() -> None:
    services = _compose()["services"]
    for name in ("migrate", "context-engine"):
        build = services[name]["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT, name
        assert (context / build["dockerfile"]).is_file(), name
    assert services["migrate"]["command"] == ["migrate"]
    assert services["context-engine"]["command"] == ["serve"]
    assert services["context-engine"]["depends_on"]["migrate"]["condition"] == \
        "service_completed_successfully"


def test_compose_mounts_only_paths_that_exist_in_the_repository() -> None:
    compose = _compose()
    named = set(compose.get("volumes") or {})
    mounted = 0
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source in named:
                continue
            path = (COMPOSE.parent / source).resolve()
            assert path.exists(), f"{name}: {source} does not exist"
            assert ROOT in path.parents, f"{name}: {source} is outside the repository"
            mounted += 1
    assert mounted >= 5


def test_compose_images_are_pinned() -> None:
    for name, service in _compose()["services"].items():
        if "build" in service:
            continue
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and re.fullmatch(r"v?\d+(\.\d+){1,2}(-[\w.]+)?", tag), f"{name}: {image}"


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in service["environment"].items()}


def test_compose_ports_agree_with_the_service_defaults() -> None:
    defaults = Config()
    _, grpc_port = split_addr(defaults.grpc_addr)
    _, metrics_port = split_addr(defaults.metrics_addr)
    service = _compose()["services"]["context-engine"]
    env = _env(service)
    assert env["CE_GRPC_ADDR"] == f"0.0.0.0:{grpc_port}"
    assert env["CE_METRICS_ADDR"] == f"0.0.0.0:{metrics_port}"
    assert env["DATABASE_URL"].startswith("postgresql://")
    assert "@postgres:5432/" in env["DATABASE_URL"]
    assert set(service["ports"]) == {f"127.0.0.1:{grpc_port}:{grpc_port}",
                                     f"127.0.0.1:{metrics_port}:{metrics_port}"}
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert f"EXPOSE {grpc_port} {metrics_port}" in dockerfile


def test_prometheus_scrapes_the_services_metrics_port_and_loads_the_rules() -> None:
    _, metrics_port = split_addr(Config().metrics_addr)
    compose = _compose()
    config = _yaml(PROMETHEUS_CONFIG)
    assert config["rule_files"] == ["rules.yml"]
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (static,) = job["static_configs"]
    assert static["targets"] == [f"context-engine:{metrics_port}"]
    assert "context-engine" in compose["services"]
    prometheus = compose["services"]["prometheus"]
    targets = {volume.split(":")[1]: (COMPOSE.parent / volume.split(":")[0]).resolve()
               for volume in prometheus["volumes"] if volume.startswith("./")}
    assert targets["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    assert targets["/etc/prometheus/rules.yml"] == RULES
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_compose_tokens_file_holds_the_documented_demo_token() -> None:
    service = _compose()["services"]["context-engine"]
    mounted = {volume.split(":")[1]: (COMPOSE.parent / volume.split(":")[0]).resolve()
               for volume in service["volumes"]}
    assert mounted[_env(service)["CE_AUTH_TOKENS_FILE"]] == TOKENS
    entries = json.loads(TOKENS.read_text(encoding="utf-8"))
    assert isinstance(entries, list) and len(entries) == 1
    (entry,) = entries
    assert set(entry) == {"sha256", "tenant_id", "rpcs"}
    assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
    assert entry["sha256"] == hashlib.sha256(DEMO_TOKEN.encode()).hexdigest()
    assert isinstance(entry["tenant_id"], str) and entry["tenant_id"]
    assert entry["rpcs"] == ["*"]
    for doc in (ROOT / "README.md", DEPLOY / "README.md", COMPOSE):
        assert DEMO_TOKEN in doc.read_text(encoding="utf-8"), f"{doc} omits the demo token"
