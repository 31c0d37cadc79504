"""The Kustomize tree under deploy/kubernetes (base, overlays/dev, overlays/production and the
monitoring component), rendered by ``kubectl kustomize`` as ``kubectl apply -k`` would render it,
agrees with the service it deploys: ports and probe names with the server's defaults, every
variable with what ``Config.from_env`` reads, labels with selectors, workers with the CPU limit,
the pod's termination grace with the service's shutdown, migrations before the server in every
pod, every image pinned, no placeholder credentials rendered (production does not render at all
without the operator's secret files), and the monitoring objects equal to the promtool-tested
rules and the dashboard."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from context_engine.api.auth import FileTokens, token_sha256
from context_engine.api.server import FLUSH_SECONDS, POOL_CLOSE_SECONDS, SERVICE_NAME
from context_engine.config import Config, ConfigError, split_addr
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
COMPONENT = KUBERNETES / "components" / "monitoring"
OVERLAYS = ("dev", "production")
PRODUCTION_SECRETS = KUBERNETES / "overlays" / "production" / "secrets"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "context-engine.json"
COMPOSE = REPO / "deploy" / "docker-compose.yml"
CLI = Path(sys.executable).parent / "context-engine"
DEMO_TOKEN = "ce-local-demo-token"  # the public local demo token (compose and overlays/dev)
# What an operator would put in overlays/production/secrets/ (the test's own values).
OPERATOR_DATABASE_URL = "postgresql://context_engine:s3cret@db.internal:5432/context_engine"
OPERATOR_TOKEN = "an operator's token"
PLACEHOLDER = re.compile(r"REPLACE_ME|CHANGE_?ME|<[^>]+>", re.I)


# ---------------------------------------------------------------------------- rendering


def kustomize(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.fail("kubectl is not on PATH: its built-in kustomize renders deploy/kubernetes "
                    "(https://kubernetes.io/docs/tasks/tools/)")
    return subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=120, check=False)


def rendered_docs(path: Path) -> list[dict[str, Any]]:
    done = kustomize(path)
    assert done.returncode == 0, f"kubectl kustomize {path}:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def tree_copy(dest: Path) -> Path:
    """deploy/kubernetes copied to ``dest`` (without any secret file an operator left in the
    checkout)."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        if Path(directory).resolve() == PRODUCTION_SECRETS.resolve():
            return {n for n in names if n != ".gitignore" and not n.endswith(".example")}
        return set()
    shutil.copytree(KUBERNETES, dest, ignore=ignore)
    return dest


@functools.cache
def rendered(name: str) -> tuple[dict[str, Any], ...]:
    """``base``, an overlay, or ``production`` with the operator's secret files in place."""
    if name == "base":
        return tuple(rendered_docs(BASE))
    if name == "dev":
        return tuple(rendered_docs(KUBERNETES / "overlays" / "dev"))
    assert name == "production"
    with tempfile.TemporaryDirectory() as tmp:
        tree = tree_copy(Path(tmp) / "kubernetes")
        secrets = tree / "overlays" / "production" / "secrets"
        (secrets / "database.env").write_text(f"DATABASE_URL={OPERATOR_DATABASE_URL}\n")
        (secrets / "tokens.json").write_text(json.dumps([{
            "sha256": token_sha256(OPERATOR_TOKEN), "tenant_id": "acme", "rpcs": ["*"]}]))
        return tuple(rendered_docs(tree / "overlays" / "production"))


def kind(overlay: str, name: str) -> list[dict[str, Any]]:
    return [doc for doc in rendered(overlay) if doc["kind"] == name]


def one(overlay: str, kind_name: str, name: str | None = None) -> dict[str, Any]:
    docs = [d for d in kind(overlay, kind_name)
            if name is None or d["metadata"]["name"] == name]
    assert len(docs) == 1, f"{overlay}: expected one {kind_name} {name or ''}, found {len(docs)}"
    return docs[0]


def the_deployment(overlay: str) -> dict[str, Any]:
    """The context-engine Deployment."""
    return one(overlay, "Deployment", "context-engine")


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def migrator(workload: dict[str, Any]) -> dict[str, Any]:
    (init,) = workload["spec"]["template"]["spec"]["initContainers"]
    return init


def services(overlay: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ClusterIP Service, the headless one) of context-engine."""
    svcs = [s for s in kind(overlay, "Service")
            if s["metadata"]["labels"]["app.kubernetes.io/name"] == "context-engine"]
    headless = [s for s in svcs if s["spec"].get("clusterIP") == "None"]
    regular = [s for s in svcs if s["spec"].get("clusterIP") != "None"]
    assert len(headless) == 1 and len(regular) == 1, [s["metadata"]["name"] for s in svcs]
    return regular[0], headless[0]


def config_map(overlay: str) -> dict[str, Any]:
    (found,) = [c for c in kind(overlay, "ConfigMap")
                if c["metadata"]["name"].startswith("context-engine-config")]
    return found


def literal_env(overlay: str, spec: dict[str, Any]) -> dict[str, str]:
    """The environment a container gets from the ConfigMap and literal values."""
    configmap = config_map(overlay)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        assert source["configMapRef"]["name"] == configmap["metadata"]["name"]
        env.update(configmap["data"])
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            assert ref["name"] == configmap["metadata"]["name"]
            env[var["name"]] = configmap["data"][ref["key"]]
    return env


def env_names(overlay: str, spec: dict[str, Any]) -> set[str]:
    return set(literal_env(overlay, spec)) | {var["name"] for var in spec.get("env", [])}


class RecordingEnv(Mapping[str, str]):
    """An environment that remembers every name looked up in it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self._env[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return key in self._env

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self._env.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._env)

    def __len__(self) -> int:
        return len(self._env)


def config_reading(env: Mapping[str, str]) -> tuple[Config, set[str]]:
    """``Config.from_env(env)`` and the names it looked up while building it."""
    recording = RecordingEnv(env)
    config = Config.from_env(recording)
    return config, recording.read


def documented_variables() -> set[str]:
    """The variables of the README's configuration table."""
    readme = (REPO / "README.md").read_text()
    return set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", readme, re.M))


def served_env(overlay: str, tmp_path: Path) -> dict[str, str]:
    """The server container's environment, with the tokens file it mounts made real here."""
    env = literal_env(overlay, container(the_deployment(overlay)))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256("t"), "tenant_id": "acme",
                                   "rpcs": ["*"]}]))
    env["CE_AUTH_TOKENS_FILE"] = str(tokens)
    env["DATABASE_URL"] = "postgresql://user:pw@db.invalid:5432/context_engine"
    return env


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    import base64

    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()} | \
        dict(secret.get("stringData", {}))


# ---------------------------------------------------------------------------- structure


def test_every_kustomization_renders_and_lists_its_files() -> None:
    for directory in (BASE, COMPONENT, KUBERNETES / "overlays" / "dev",
                      KUBERNETES / "overlays" / "production"):
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        listed = set(kustomization.get("resources", []))
        files = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
        assert files <= listed, f"{directory}: not listed: {files - listed}"
        assert "namespace" not in kustomization, directory
    component = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    for overlay in ("base", *OVERLAYS):
        docs = rendered(overlay)
        assert docs, overlay
        for doc in docs:
            assert "namespace" not in doc["metadata"], (overlay, doc["metadata"]["name"])
    # the monitoring component composes with the base as with the production overlay
    assert kind("production", "PrometheusRule") and not kind("base", "PrometheusRule")


def test_every_expected_object_is_there_with_its_api_version() -> None:
    def kinds(overlay: str) -> Counter[tuple[str, str]]:
        return Counter((d["apiVersion"], d["kind"]) for d in rendered(overlay))

    base = Counter({("apps/v1", "Deployment"): 1, ("v1", "Service"): 2,
                    ("policy/v1", "PodDisruptionBudget"): 1,
                    ("autoscaling/v2", "HorizontalPodAutoscaler"): 1, ("v1", "ConfigMap"): 1})
    assert kinds("base") == base  # no Secret: every overlay brings its own
    assert kinds("production") == base + Counter({
        ("v1", "Secret"): 1, ("monitoring.coreos.com/v1", "ServiceMonitor"): 1,
        ("monitoring.coreos.com/v1", "PrometheusRule"): 1, ("v1", "ConfigMap"): 1})
    assert kinds("dev") == Counter({
        ("apps/v1", "Deployment"): 2, ("v1", "Service"): 3, ("v1", "ConfigMap"): 1,
        ("v1", "Secret"): 2})
    for overlay in ("base", *OVERLAYS):
        assert not kind(overlay, "Job"), "migrations run in each pod's init container"


def test_container_ports_and_bind_addresses_are_the_service_defaults() -> None:
    defaults = Config()
    grpc_port = split_addr(defaults.grpc_addr)[1]
    metrics_port = split_addr(defaults.metrics_addr)[1]
    for overlay in OVERLAYS:
        spec = container(the_deployment(overlay))
        ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
        assert ports == {"grpc": grpc_port, "metrics": metrics_port}
        env = literal_env(overlay, spec)
        # Off loopback, so that the kubelet, the Services and Prometheus reach the pod.
        assert split_addr(env["CE_GRPC_ADDR"]) == ("0.0.0.0", grpc_port)
        assert split_addr(env["CE_METRICS_ADDR"]) == ("0.0.0.0", metrics_port)
        regular, headless = services(overlay)
        for svc in (regular, headless):
            for port in svc["spec"]["ports"]:
                assert port["targetPort"] in ports, (svc["metadata"]["name"], port)
                assert port["port"] == ports[port["targetPort"]]
        assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"grpc"}
        assert {p["targetPort"] for p in regular["spec"]["ports"]} == {"grpc", "metrics"}


@pytest.mark.integration
def test_probes_are_native_grpc_health_checks_of_names_the_server_serves(server):
    grpc_port = split_addr(Config().grpc_addr)[1]
    for overlay in OVERLAYS:
        spec = container(the_deployment(overlay))
        names = {}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = spec[probe]["grpc"]
            assert check["port"] == grpc_port, probe
            names[probe] = check.get("service", "")
        # Readiness follows the ContextEngine service, which is what clients call.
        assert names["readinessProbe"] == SERVICE_NAME
        # Every name the probes use answers SERVING on a real server (an unknown name would
        # be NOT_FOUND and the pod would never become ready).
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for probe, name in names.items():
                reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, probe


def test_every_variable_in_the_manifests_is_read_by_config_and_documented(tmp_path):
    for overlay in OVERLAYS:
        deployment = the_deployment(overlay)
        used = set()
        for spec in (container(deployment), migrator(deployment)):
            used |= {n for n in env_names(overlay, spec)
                     if n.startswith("CE_") or n == "DATABASE_URL"}
        used |= set(config_map(overlay)["data"])
        _, read = config_reading(served_env(overlay, tmp_path))
        assert used - read == set(), f"{overlay}: set but never read by Config.from_env"
        assert used - documented_variables() == set(), f"{overlay}: missing from the README"


def test_the_environments_are_valid_serving_and_migrating_configurations(tmp_path):
    for overlay in OVERLAYS:
        env = served_env(overlay, tmp_path)
        config, _ = config_reading(env)
        config.validate_serving()  # credentials are configured and dev mode is off
        assert not config.dev_mode and config.auth_tokens_file is not None
        assert config.database_url == env["DATABASE_URL"]
        # The init container's environment is valid for `migrate` (it mounts no tokens file).
        migrate_env = literal_env(overlay, migrator(the_deployment(overlay)))
        migrate_env["DATABASE_URL"] = env["DATABASE_URL"]
        Config.from_env(migrate_env)


def test_migrations_run_before_the_server_in_every_pod() -> None:
    """An init container runs `context-engine migrate` to completion before the server
    container starts, against the same database, so no pod of a release serves before its
    migrations are applied (a Job applied beside the Deployment would not be ordered)."""
    for overlay in ("base", *OVERLAYS):
        deployment = the_deployment(overlay)
        init, main = migrator(deployment), container(deployment)
        assert init["args"] == ["migrate"]
        assert init["image"] == main["image"]
        database = [v["valueFrom"]["secretKeyRef"] for spec in (init, main)
                    for v in spec["env"] if v["name"] == "DATABASE_URL"]
        assert len(database) == 2 and database[0] == database[1], overlay
        assert "restartPolicy" not in init  # a plain init container, not a sidecar
    for command in ("serve", "migrate"):
        subprocess.run([str(CLI), command, "--help"], capture_output=True, timeout=60,
                       check=True)


# ---------------------------------------------------------------------------- credentials


def test_no_placeholder_secret_is_rendered() -> None:
    assert not kind("base", "Secret")
    for overlay in OVERLAYS:
        for secret in kind(overlay, "Secret"):
            for key, value in secret_data(secret).items():
                assert not PLACEHOLDER.search(value), (overlay, secret["metadata"]["name"], key)


def test_production_does_not_render_without_the_operators_secret_files(tmp_path):
    tree = tree_copy(tmp_path / "kubernetes")
    done = kustomize(tree / "overlays" / "production")
    assert done.returncode != 0
    assert "secrets/database.env" in done.stderr, done.stderr
    ignored = (PRODUCTION_SECRETS / ".gitignore").read_text().split()
    assert ignored[ignored.index("*"):] == ["*", "!.gitignore", "!*.example"]


def test_the_production_secret_is_the_operators_files_mounted_where_config_reads(tmp_path):
    secret = one("production", "Secret")
    data = secret_data(secret)
    assert data["DATABASE_URL"] == OPERATOR_DATABASE_URL
    tokens = tmp_path / "tokens.json"
    tokens.write_text(data["tokens.json"])
    FileTokens.load(tokens)
    deployment = the_deployment("production")
    pod = deployment["spec"]["template"]["spec"]
    refs = [v["valueFrom"]["secretKeyRef"] for spec in (container(deployment),
                                                       migrator(deployment))
            for v in spec.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})]
    assert refs and all(r["name"] == secret["metadata"]["name"] and r["key"] in data
                        for r in refs)
    # The tokens file is mounted where CE_AUTH_TOKENS_FILE points.
    tokens_path = Path(literal_env("production", container(deployment))["CE_AUTH_TOKENS_FILE"])
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert [i["path"] for i in volume["secret"]["items"]] == [tokens_path.name]
    assert [i["key"] for i in volume["secret"]["items"]] == ["tokens.json"]
    mount = next(m for m in container(deployment)["volumeMounts"]
                 if m["name"] == volume["name"])
    assert Path(mount["mountPath"]) == tokens_path.parent and mount["readOnly"] is True


def test_the_examples_copied_unchanged_stop_the_server_instead_of_admitting_anyone(tmp_path):
    example = PRODUCTION_SECRETS / "tokens.json.example"
    assert "REPLACE_ME" in example.read_text()
    with pytest.raises(ConfigError):
        FileTokens.load(example)
    entries = json.loads(example.read_text())
    entries[0]["sha256"] = token_sha256("a real token")
    entries[0]["tenant_id"] = "acme"
    filled = tmp_path / "filled.json"
    filled.write_text(json.dumps(entries))
    FileTokens.load(filled)
    database = (PRODUCTION_SECRETS / "database.env.example").read_text()
    assert re.search(r"^DATABASE_URL=postgresql://\S*REPLACE_ME", database, re.M)


def test_dev_holds_only_the_public_demo_credentials(tmp_path):
    compose = yaml.safe_load(COMPOSE.read_text())
    dev = KUBERNETES / "overlays" / "dev"
    assert (dev / "tokens.json").read_bytes() == (REPO / "deploy" / "compose" /
                                                  "tokens.json").read_bytes()
    secret = one("dev", "Secret", next(s["metadata"]["name"] for s in kind("dev", "Secret")
                                       if s["metadata"]["name"].startswith(
                                           "context-engine-secrets")))
    data = secret_data(secret)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(data["tokens.json"])
    FileTokens.load(tokens)
    assert json.loads(data["tokens.json"])[0]["sha256"] == token_sha256(DEMO_TOKEN)
    # the database beside it: the compose stack's image, reached by its Service's name
    database = one("dev", "Deployment", "context-engine-postgres")
    assert container(database)["image"] == compose["services"]["postgres"]["image"]
    postgres = one("dev", "Service", "context-engine-postgres")
    assert f"@{postgres['metadata']['name']}:{postgres['spec']['ports'][0]['port']}/" in \
        data["DATABASE_URL"]
    for doc in (dev / "kustomization.yaml", REPO / "deploy" / "README.md"):
        assert DEMO_TOKEN in doc.read_text(), doc


# ---------------------------------------------------------------------------- pods


def test_labels_and_selectors_agree() -> None:
    for overlay in OVERLAYS:
        deployment = the_deployment(overlay)
        selector = deployment["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        regular, headless = services(overlay)
        assert regular["spec"]["selector"] == selector
        assert headless["spec"]["selector"] == selector
        spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert all(c["labelSelector"]["matchLabels"] == selector for c in spread)
        # nothing else (the dev database) is selected as a server pod
        for other in kind(overlay, "Deployment"):
            if other is not deployment:
                labels = other["spec"]["template"]["metadata"]["labels"]
                assert not selector.items() <= labels.items(), other["metadata"]["name"]
    selector = the_deployment("production")["spec"]["selector"]["matchLabels"]
    assert one("production", "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == \
        selector
    target = one("production", "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1", "Deployment", the_deployment("production")["metadata"]["name"])


def test_the_service_monitor_scrapes_one_service_under_the_job_the_alerts_watch() -> None:
    """It selects exactly one Service (no pod scraped twice), its endpoint port leads to the
    container port named metrics, and the `job` label it gives the series (the Service's
    label named by jobLabel) matches the target alerts' `job=~"context-engine.*"`."""
    regular, headless = services("production")
    monitor = one("production", "ServiceMonitor")["spec"]
    wanted = monitor["selector"]["matchLabels"].items()
    chosen = [s for s in (regular, headless) if wanted <= s["metadata"]["labels"].items()]
    assert chosen == [regular]
    (endpoint,) = monitor["endpoints"]
    port = next(p for p in regular["spec"]["ports"] if p["name"] == endpoint["port"])
    assert port["targetPort"] == "metrics" and endpoint["path"] == "/metrics"
    job = regular["metadata"]["labels"][monitor["jobLabel"]]
    rules = yaml.safe_load(RULES.read_text())
    matchers = {m for g in rules["groups"] for r in g["rules"]
                for m in re.findall(r'up\{job=~"([^"]+)"\}', str(r["expr"]))}
    assert matchers and all(re.fullmatch(m, job) for m in matchers), (job, matchers)


def test_workers_equal_the_cpu_limit(tmp_path):
    for overlay in OVERLAYS:
        spec = container(the_deployment(overlay))
        args = spec["args"]
        assert args[0] == "serve"
        workers = int(args[args.index("--workers") + 1])
        assert literal_env(overlay, spec)["CE_WORKERS"] == str(workers)
        assert cpu_cores(spec["resources"]["limits"]["cpu"]) == workers
        assert cpu_cores(spec["resources"]["requests"]["cpu"]) <= workers
        config, _ = config_reading(served_env(overlay, tmp_path))
        assert config.worker_count() == workers
    assert int(container(the_deployment("dev"))["args"][-1]) == 1
    out = subprocess.run([str(CLI), "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "--workers" in out


def test_termination_grace_outlasts_the_drain_and_the_grace(tmp_path):
    for overlay in OVERLAYS:
        config, _ = config_reading(served_env(overlay, tmp_path))
        deployment = the_deployment(overlay)
        pod = deployment["spec"]["template"]["spec"]
        pre_stop = container(deployment).get("lifecycle", {}).get("preStop", {})
        sleep = pre_stop.get("sleep", {}).get("seconds", 0)
        # and the rest of a stop: epoch-count claims settled (up to 2 s), the pool closed (up
        # to POOL_CLOSE_SECONDS), the traces still batched exported (up to FLUSH_SECONDS)
        assert pod["terminationGracePeriodSeconds"] > sleep + config.drain_seconds \
            + config.grace_seconds + 2 + POOL_CLOSE_SECONDS + FLUSH_SECONDS
        # A drain long enough for readiness to notice at least once.
        readiness = container(deployment)["readinessProbe"]
        assert config.drain_seconds >= readiness["periodSeconds"]


def test_compose_stop_outlasts_the_drain_the_grace_and_the_rest_of_a_stop():
    """Docker's default stop timeout (10 s) was shorter than the service's own stop with its
    defaults (drain 1 s, grace 10 s): `docker compose stop` SIGKILLed calls still in their
    grace."""

    service = yaml.safe_load(COMPOSE.read_text())["services"]["context-engine"]
    env = {k: str(v) for k, v in service.get("environment", {}).items()
           if k.startswith("CE_") and k not in ("CE_AUTH_TOKENS_FILE",)}
    config = Config.from_env(env)
    period = service["stop_grace_period"]
    assert period.endswith("s") and period[:-1].isdigit(), period
    assert int(period[:-1]) > (config.drain_seconds + config.grace_seconds + 2
                               + POOL_CLOSE_SECONDS + FLUSH_SECONDS)


def test_replicas_autoscaling_and_disruption_budget():
    deployment = the_deployment("production")
    hpa = one("production", "HorizontalPodAutoscaler")["spec"]
    # The autoscaler alone sets the count: a replicas field would reset it on every apply.
    assert "replicas" not in deployment["spec"]
    assert hpa["minReplicas"] >= 3
    assert hpa["maxReplicas"] > hpa["minReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert container(deployment)["resources"]["requests"]["cpu"]  # utilization needs it
    pdb = one("production", "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] < hpa["minReplicas"]
    # dev: one pod it counts itself, nothing to autoscale or protect
    assert the_deployment("dev")["spec"]["replicas"] == 1
    assert not kind("dev", "HorizontalPodAutoscaler") and not kind("dev", "PodDisruptionBudget")


def test_pods_run_non_root_with_a_read_only_root_and_a_writable_tmp():
    dockerfile = (REPO / "Dockerfile").read_text()
    image_uid = int(re.findall(r"^USER (\d+)", dockerfile, re.M)[-1])
    for overlay in OVERLAYS:
        for workload in kind(overlay, "Deployment"):
            pod = workload["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["automountServiceAccountToken"] is False
            for spec in (*pod.get("initContainers", []), *pod["containers"]):
                assert spec["securityContext"]["allowPrivilegeEscalation"] is False
                assert spec["securityContext"]["capabilities"]["drop"] == ["ALL"]
        deployment = the_deployment(overlay)
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == image_uid != 0
        for spec in (migrator(deployment), container(deployment)):
            assert spec["securityContext"]["readOnlyRootFilesystem"] is True
            tmp = next(m for m in spec["volumeMounts"] if m["mountPath"] == "/tmp")
            volume = next(v for v in pod["volumes"] if v["name"] == tmp["name"])
            assert "emptyDir" in volume


def test_every_image_is_pinned_and_the_service_image_is_this_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for overlay in ("base", *OVERLAYS):
        for workload in kind(overlay, "Deployment"):
            pod = workload["spec"]["template"]["spec"]
            for spec in (*pod.get("initContainers", []), *pod["containers"]):
                image = spec["image"]
                name, _, digest = image.partition("@")
                tag = name.rpartition(":")[2] if ":" in name.rsplit("/", 1)[-1] else ""
                assert digest.startswith("sha256:") or (tag and tag != "latest"), \
                    f"{overlay}: {spec['name']} runs an unpinned image {image}"
        deployment = the_deployment(overlay)
        assert container(deployment)["image"] == migrator(deployment)["image"] == \
            f"context-engine:{version}"
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert kustomization["images"] == [{"name": "context-engine", "newTag": version}]


def test_probes_are_present_on_the_server_of_every_overlay():
    for overlay in ("base", *OVERLAYS):
        spec = container(the_deployment(overlay))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in spec[probe], (overlay, probe)
    database = container(one("dev", "Deployment", "context-engine-postgres"))
    assert database["readinessProbe"]["exec"]["command"][0] == "pg_isready"


# ---------------------------------------------------------------------------- monitoring


def test_the_rendered_prometheus_rule_is_the_promtool_tested_rules_file():
    rule = one("production", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_the_dashboard_config_map_is_the_dashboard_for_grafanas_sidecar():
    (dashboard,) = [c for c in kind("production", "ConfigMap")
                    if c["metadata"]["name"] == "context-engine-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"][DASHBOARD.name]) == json.loads(DASHBOARD.read_text())
