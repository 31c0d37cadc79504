"""The Kubernetes manifests agree with the service they deploy: ports and probe names with the
server's defaults, every variable with what ``Config.from_env`` reads, labels with selectors,
workers with the CPU limit, and the pod's termination grace with the service's shutdown."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from context_engine.api.auth import FileTokens, token_sha256
from context_engine.api.server import SERVICE_NAME
from context_engine.config import Config, ConfigError, split_addr
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
CLI = Path(sys.executable).parent / "context-engine"


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


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def kind(name: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc["kind"] == name]


def one(kind_name: str) -> dict[str, Any]:
    docs = kind(kind_name)
    assert len(docs) == 1, f"expected one {kind_name}, found {len(docs)}"
    return docs[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def services() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ClusterIP Service, the headless one)."""
    svcs = kind("Service")
    headless = [s for s in svcs if s["spec"].get("clusterIP") == "None"]
    regular = [s for s in svcs if s["spec"].get("clusterIP") != "None"]
    assert len(headless) == 1 and len(regular) == 1, [s["metadata"]["name"] for s in svcs]
    return regular[0], headless[0]


def literal_env(workload: dict[str, Any]) -> dict[str, str]:
    """The environment the workload's container gets from the ConfigMap and literal values."""
    configmap = one("ConfigMap")
    spec = container(workload)
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


def env_names(workload: dict[str, Any]) -> set[str]:
    names = set(literal_env(workload))
    names |= {var["name"] for var in container(workload).get("env", [])}
    return names


@pytest.fixture
def served_env(tmp_path: Path) -> dict[str, str]:
    """The Deployment's environment, with the tokens file it mounts made real here."""
    env = literal_env(one("Deployment"))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256("t"), "tenant_id": "acme",
                                   "rpcs": ["*"]}]))
    env["CE_AUTH_TOKENS_FILE"] = str(tokens)
    env["DATABASE_URL"] = "postgresql://user:pw@db.invalid:5432/context_engine"
    return env


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_kustomization_lists_every_manifest_and_none_names_a_namespace():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert len(kustomization["resources"]) == len(set(kustomization["resources"]))
    assert "namespace" not in kustomization
    for name, doc in documents():
        assert "namespace" not in doc["metadata"], name


def test_every_expected_object_is_there_with_its_api_version():
    expected = {
        ("apps/v1", "Deployment"): 1, ("v1", "Service"): 2, ("batch/v1", "Job"): 1,
        ("policy/v1", "PodDisruptionBudget"): 1,
        ("autoscaling/v2", "HorizontalPodAutoscaler"): 1, ("v1", "ConfigMap"): 1,
        ("v1", "Secret"): 1, ("monitoring.coreos.com/v1", "ServiceMonitor"): 1,
    }
    found: dict[tuple[str, str], int] = {}
    for _, doc in documents():
        key = (doc["apiVersion"], doc["kind"])
        found[key] = found.get(key, 0) + 1
    assert found == expected


def test_container_ports_and_bind_addresses_are_the_service_defaults():
    defaults = Config()
    grpc_port = split_addr(defaults.grpc_addr)[1]
    metrics_port = split_addr(defaults.metrics_addr)[1]
    ports = {p["name"]: p["containerPort"] for p in container(one("Deployment"))["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port}
    env = literal_env(one("Deployment"))
    # Off loopback, so that the kubelet, the Services and Prometheus reach the pod.
    assert split_addr(env["CE_GRPC_ADDR"]) == ("0.0.0.0", grpc_port)
    assert split_addr(env["CE_METRICS_ADDR"]) == ("0.0.0.0", metrics_port)
    regular, headless = services()
    for svc in (regular, headless):
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)
            assert port["port"] == ports[port["targetPort"]]
    assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"grpc"}
    assert {p["targetPort"] for p in regular["spec"]["ports"]} == {"grpc", "metrics"}


@pytest.mark.integration
def test_probes_are_native_grpc_health_checks_of_names_the_server_serves(server):
    grpc_port = split_addr(Config().grpc_addr)[1]
    spec = container(one("Deployment"))
    names = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = spec[probe]["grpc"]
        assert check["port"] == grpc_port, probe
        names[probe] = check.get("service", "")
    # Readiness follows the ContextEngine service, which is what clients call.
    assert names["readinessProbe"] == SERVICE_NAME
    # Every name the probes use answers SERVING on a real server (an unknown name would be
    # NOT_FOUND and the pod would never become ready).
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for probe, name in names.items():
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, probe


def test_every_variable_in_the_manifests_is_read_by_config_and_documented(served_env):
    used = set()
    for workload in (one("Deployment"), one("Job")):
        used |= {n for n in env_names(workload) if n.startswith("CE_") or n == "DATABASE_URL"}
    used |= {k for k in one("ConfigMap")["data"]}
    _, read = config_reading(served_env)
    assert used - read == set(), "set in the manifests but never read by Config.from_env"
    assert used - documented_variables() == set(), "missing from the README table"


def test_the_deployment_environment_is_a_valid_serving_configuration(served_env):
    config, _ = config_reading(served_env)
    config.validate_serving()  # credentials are configured and dev mode is off
    assert not config.dev_mode and config.auth_tokens_file is not None
    assert config.database_url == served_env["DATABASE_URL"]
    # The migration Job's environment is valid for `migrate` (it mounts no tokens file).
    job_env = literal_env(one("Job"))
    job_env["DATABASE_URL"] = served_env["DATABASE_URL"]
    Config.from_env(job_env)


def test_secrets_are_referenced_mounted_and_marked_placeholders(tmp_path: Path):
    secret = one("Secret")
    data = secret["stringData"]
    assert set(data) == {"DATABASE_URL", "tokens.json"}
    assert all("REPLACE_ME" in value for value in data.values())
    deployment = one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    refs = [v["valueFrom"]["secretKeyRef"] for w in (deployment, one("Job"))
            for v in container(w).get("env", []) if "secretKeyRef" in v.get("valueFrom", {})]
    assert refs and all(r["name"] == secret["metadata"]["name"] and r["key"] in data
                        for r in refs)
    # The tokens file is mounted where CE_AUTH_TOKENS_FILE points.
    tokens_path = Path(literal_env(deployment)["CE_AUTH_TOKENS_FILE"])
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert [i["path"] for i in volume["secret"]["items"]] == [tokens_path.name]
    assert [i["key"] for i in volume["secret"]["items"]] == ["tokens.json"]
    mount = next(m for m in container(deployment)["volumeMounts"]
                 if m["name"] == volume["name"])
    assert Path(mount["mountPath"]) == tokens_path.parent and mount["readOnly"] is True
    # Left unreplaced, the placeholder stops the server instead of admitting anyone; with a
    # real hash in its place the same entry loads.
    placeholder = tmp_path / "placeholder.json"
    placeholder.write_text(data["tokens.json"])
    with pytest.raises(ConfigError):
        FileTokens.load(placeholder)
    entries = json.loads(data["tokens.json"])
    entries[0]["sha256"] = token_sha256("a real token")
    entries[0]["tenant_id"] = "acme"
    filled = tmp_path / "filled.json"
    filled.write_text(json.dumps(entries))
    FileTokens.load(filled)


def test_labels_and_selectors_agree():
    deployment = one("Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    regular, headless = services()
    assert regular["spec"]["selector"] == selector
    assert headless["spec"]["selector"] == selector
    assert one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert all(c["labelSelector"]["matchLabels"] == selector for c in spread)
    target = one("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"], "Deployment", deployment["metadata"]["name"])
    # Migration pods are neither behind the Services nor adopted by the Deployment.
    job_labels = one("Job")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= job_labels.items()
    # The ServiceMonitor selects exactly one Service (no pod scraped twice), and its endpoint
    # port leads to the container port named metrics.
    monitor = one("ServiceMonitor")["spec"]
    wanted = monitor["selector"]["matchLabels"].items()
    chosen = [s for s in (regular, headless) if wanted <= s["metadata"]["labels"].items()]
    assert chosen == [regular]
    (endpoint,) = monitor["endpoints"]
    port = next(p for p in regular["spec"]["ports"] if p["name"] == endpoint["port"])
    assert port["targetPort"] == "metrics" and endpoint["path"] == "/metrics"


def test_workers_equal_the_cpu_limit(served_env):
    spec = container(one("Deployment"))
    args = spec["args"]
    assert args[0] == "serve"
    workers = int(args[args.index("--workers") + 1])
    assert literal_env(one("Deployment"))["CE_WORKERS"] == str(workers)
    assert cpu_cores(spec["resources"]["limits"]["cpu"]) == workers
    assert cpu_cores(spec["resources"]["requests"]["cpu"]) <= workers
    config, _ = config_reading(served_env)
    assert config.worker_count() == workers
    out = subprocess.run([str(CLI), "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "--workers" in out


def test_termination_grace_outlasts_the_drain_and_the_grace(served_env):
    config, _ = config_reading(served_env)
    pod = one("Deployment")["spec"]["template"]["spec"]
    pre_stop = container(one("Deployment")).get("lifecycle", {}).get("preStop", {})
    sleep = pre_stop.get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] > sleep + config.drain_seconds \
        + config.grace_seconds
    # A drain long enough for readiness to notice at least once.
    readiness = container(one("Deployment"))["readinessProbe"]
    assert config.drain_seconds >= readiness["periodSeconds"]


def test_replicas_autoscaling_and_disruption_budget():
    deployment = one("Deployment")
    hpa = one("HorizontalPodAutoscaler")["spec"]
    # The autoscaler alone sets the count: a replicas field would reset it on every apply.
    assert "replicas" not in deployment["spec"]
    assert hpa["minReplicas"] >= 3
    assert hpa["maxReplicas"] > hpa["minReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert container(deployment)["resources"]["requests"]["cpu"]  # utilization needs it
    pdb = one("PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] < hpa["minReplicas"]


def test_pods_run_non_root_with_a_read_only_root_and_a_writable_tmp():
    dockerfile = (REPO / "Dockerfile").read_text()
    image_uid = int(re.findall(r"^USER (\d+)", dockerfile, re.M)[-1])
    for workload in (one("Deployment"), one("Job")):
        pod = workload["spec"]["template"]["spec"]
        spec = container(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == image_uid != 0
        assert spec["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["allowPrivilegeEscalation"] is False
        assert spec["securityContext"]["capabilities"]["drop"] == ["ALL"]
        tmp = next(m for m in spec["volumeMounts"] if m["mountPath"] == "/tmp")
        volume = next(v for v in pod["volumes"] if v["name"] == tmp["name"])
        assert "emptyDir" in volume


def test_image_and_commands():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    deployment, job = one("Deployment"), one("Job")
    assert container(deployment)["image"] == container(job)["image"] == \
        f"context-engine:{version}"
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["images"] == [{"name": "context-engine", "newTag": version}]
    assert container(job)["args"] == ["migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    for command in ("serve", "migrate"):
        subprocess.run([str(CLI), command, "--help"], capture_output=True, timeout=60,
                       check=True)
