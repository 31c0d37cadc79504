"""The image is correct by construction (no Docker needed to check it): pinned bases, a
non-root user, every copied path in the build context, the entrypoint a console script with
the subcommands the image and the manifests run, the default ports exposed, only runtime
dependencies in the final stage, the encodings where the service looks, and a HEALTHCHECK
that really tells a serving server from a stopped one, in plaintext and under (mutual) TLS with
certificates made at test time by the openssl CLI."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from context_engine.adapters.tokenizers import _OFFICIAL
from context_engine.config import Config, ConfigError, split_addr
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.support.certs import Pki, make_pki
from tests.unit.test_kubernetes import config_reading

REPO = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "context-engine"
PINNED_IMAGE = re.compile(
    r"^(?P<name>[a-z0-9./_-]+):(?P<version>\d+\.\d+\.\d+)(?P<variant>-[a-z0-9.-]+)?"
    r"(?:@sha256:[0-9a-f]{64})?$")


def instructions() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    result: list[tuple[str, str, str]] = []
    stage = ""
    pending = ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            words = args.split()
            stage = words[2] if len(words) == 3 and words[1].upper() == "AS" else words[0]
        result.append((stage, op, args.strip()))
    return result


def stages() -> list[str]:
    return [stage for stage, op, _ in instructions() if op == "FROM"]


def final(op: str) -> list[str]:
    last = stages()[-1]
    return [args for stage, o, args in instructions() if stage == last and o == op]


def image_env() -> dict[str, str]:
    """The final stage's ENV, as the container sees it."""
    env: dict[str, str] = {}
    for args in final("ENV"):
        for word in shlex.split(args):
            name, _, value = word.partition("=")
            env[name] = value
    return env


def copies() -> list[tuple[str, list[str], str, str | None]]:
    """(stage, sources, destination, --from stage or None)."""
    found = []
    for stage, op, args in instructions():
        if op != "COPY":
            continue
        words = args.split()
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")),
                            None)
        found.append((stage, paths[:-1], paths[-1], source_stage))
    return found


def dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, pattern) per .dockerignore line, in order (the last match wins)."""
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        excludes = not line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((excludes, re.compile(regex)))
    return rules


def excluded(path: str) -> bool:
    """Whether the build context lacks ``path`` (a path is gone when it or a parent is)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    verdict = False
    for excludes, regex in dockerignore():
        if any(regex.fullmatch(p) for p in prefixes):
            verdict = excludes
    return verdict


def tracked(path: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", path], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return out.split()


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_the_ignore_matcher_follows_docker_rules():
    # The checks below lean on it: it must exclude what .dockerignore names and keep the rest.
    assert excluded(".git/HEAD") and excluded(".venv/bin/python")
    assert excluded("service/context_engine/__pycache__/cli.cpython-311.pyc")
    assert excluded("service/context_engine/v1/context_engine_pb2.py")
    assert not excluded("service/context_engine/cli.py")
    assert not excluded("pyproject.toml")


def test_base_images_are_pinned_by_version():
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(n) for n in re.fullmatch(r">=(\d+)\.(\d+)", requires).groups())
    bases = []
    for args in [a for _, op, a in instructions() if op == "FROM"]:
        image = args.split()[0]
        if image in stages():  # a previous stage, not a base
            continue
        match = PINNED_IMAGE.match(image)
        assert match, f"{image} is not pinned to an x.y.z version"
        bases.append(image)
        if match["name"] in ("python", "docker.io/library/python"):
            version = tuple(int(n) for n in match["version"].split("."))
            assert version[:2] >= minimum, image
    # Every stage on one base: what the build stage built runs on the runtime stage.
    assert len(bases) >= 2 and len(set(bases)) == 1


def test_runs_as_a_numeric_non_root_user_before_the_entrypoint():
    last = stages()[-1]
    ops = [(op, args) for stage, op, args in instructions() if stage == last]
    users = [i for i, (op, _) in enumerate(ops) if op == "USER"]
    entry = next(i for i, (op, _) in enumerate(ops) if op == "ENTRYPOINT")
    assert users and users[-1] < entry
    user = ops[users[-1]][1]
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, user
    assert not gid or (gid.isdigit() and int(gid) != 0), user
    assert f"--uid {uid}" in " ".join(a for o, a in ops if o == "RUN")


def test_every_copied_path_is_in_the_build_context():
    names = stages()
    for stage, sources, _, source_stage in copies():
        if source_stage is not None:
            assert source_stage in names[:names.index(stage)], source_stage
            continue
        for src in sources:
            assert (REPO / src).exists(), src
            assert not excluded(src), f"{src} is excluded by .dockerignore"
            files = tracked(src)
            assert files, f"{src}: no tracked file"
            lost = [f for f in files if excluded(f)]
            assert not lost, f"tracked files under {src} left out of the context: {lost}"


def test_migrations_are_copied_where_the_image_points_the_service():
    last = stages()[-1]
    destination = next(dst for s, srcs, dst, frm in copies()
                       if s == last and frm is None and srcs == ["migrations/"])
    assert image_env()["CE_MIGRATIONS_DIR"].rstrip("/") == destination.rstrip("/")


def test_generated_code_is_built_in_the_image_not_copied():
    build = [a for s, op, a in instructions() if s == stages()[0] and op == "RUN"]
    assert any("grpc_tools.protoc" in a for a in build)
    assert excluded("service/context_engine/v1/context_engine_pb2_grpc.py")
    runtime = " ".join(a for s, _, a in instructions() if s == stages()[-1])
    assert "grpc_tools" not in runtime and "grpcio-tools" not in runtime


def test_entrypoint_is_the_console_script_and_its_commands_exist():
    entry = json.loads(final("ENTRYPOINT")[-1])
    cmd = json.loads(final("CMD")[-1])
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["context-engine"] and entry[0] in scripts
    assert cmd == ["serve"]
    listed = cli("--help")
    assert listed.returncode == 0, listed.stderr
    commands = set(re.search(r"\{([a-z,-]+)\}", listed.stdout).group(1).split(","))
    health_cmd = json.loads(re.search(r"CMD (\[.*\])", final("HEALTHCHECK")[-1]).group(1))
    needed = {cmd[0], "migrate", health_cmd[1]}
    assert needed <= commands, commands
    for command in sorted(needed):
        assert cli(command, "--help").returncode == 0, command


def test_exposed_ports_are_the_default_ports_on_every_interface():
    defaults = Config()
    grpc_port = split_addr(defaults.grpc_addr)[1]
    metrics_port = split_addr(defaults.metrics_addr)[1]
    exposed = {int(p.split("/")[0]) for args in final("EXPOSE") for p in args.split()}
    assert exposed == {grpc_port, metrics_port}
    env = image_env()
    assert split_addr(env["CE_GRPC_ADDR"]) == ("0.0.0.0", grpc_port)
    assert split_addr(env["CE_METRICS_ADDR"]) == ("0.0.0.0", metrics_port)


def test_the_image_environment_is_read_by_config_and_demands_credentials():
    env = image_env()
    # the migrations the image copies in, where this checkout holds them (the settings are
    # checked against the files they name)
    assert env["CE_MIGRATIONS_DIR"] == "/app/migrations"
    assert any(srcs == ["migrations/"] and dst == "/app/migrations/"
               for _, srcs, dst, _ in copies())
    env["CE_MIGRATIONS_DIR"] = str(REPO / "migrations")
    config, read = config_reading(env)
    assert {n for n in env if n.startswith("CE_")} <= read
    # Bound to every interface with no credentials configured, `serve` refuses to start: the
    # deployment must bring a tokens file or the api_tokens table.
    with pytest.raises(ConfigError):
        config.validate_serving()


def test_runtime_stage_installs_only_runtime_requirements():
    first, last = stages()[0], stages()[-1]
    runtime_runs = [a for s, op, a in instructions() if s == last and op == "RUN"]
    installs = [a for a in runtime_runs if "pip install" in a]
    assert installs
    for command in installs:
        for part in command.split("&&"):
            if "pip install" not in part:
                continue
            words = part.split()
            if "-r" in words:
                requirement = words[words.index("-r") + 1]
                source = next(srcs for s, srcs, dst, frm in copies()
                              if s == last and frm is None and dst == requirement)
                assert source == ["requirements/runtime.txt"], source
            else:
                assert "--no-deps" in words and any(w.endswith(".whl") for w in words), part
    runtime_text = " ".join(a for s, _, a in instructions() if s == last)
    assert "dev.txt" not in runtime_text
    # The build stage adds only pinned build tools beyond the runtime pins.
    build_tools = re.findall(r"\^\(([^)]*)\)==", " ".join(
        a for s, op, a in instructions() if s == first and op == "RUN"))
    gen = (REPO / "requirements" / "gen.txt").read_text()
    runtime = (REPO / "requirements" / "runtime.txt").read_text()
    for tool in build_tools[0].split("|"):
        assert re.search(rf"^{re.escape(tool)}==\S+$", gen, re.M), tool
        assert not re.search(rf"^{re.escape(tool)}==", runtime, re.M), tool
    for line in runtime.splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9_.+-]*", line), line


def test_official_encodings_are_baked_where_the_service_reads_them():
    first, last = stages()[0], stages()[-1]
    fetch = next(a for s, op, a in instructions()
                 if s == first and op == "RUN" and "tiktoken.get_encoding" in a)
    fetched_dir = re.search(r"TIKTOKEN_CACHE_DIR=(\S+)", fetch).group(1)
    fetched = set(re.findall(r"'(\w+_base)'", fetch))
    assert fetched == {"cl100k_base", "o200k_base"} and fetched <= set(_OFFICIAL)
    destination = next(dst for s, srcs, dst, frm in copies()
                       if s == last and frm == first and srcs == [fetched_dir])
    assert image_env()["TIKTOKEN_CACHE_DIR"].rstrip("/") == destination.rstrip("/")
    # The build fails unless the service's own loader finds each of them offline.
    check = next(a for s, op, a in instructions()
                 if s == last and op == "RUN" and "cached_offline" in a)
    assert set(re.findall(r"'(\w+_base)'", check)) == fetched


def _probe_env(grpc_addr: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CE_")}
    env.update(image_env())
    env["CE_GRPC_ADDR"] = grpc_addr
    return env


def _healthcheck() -> tuple[list[str], dict[str, str]]:
    text = final("HEALTHCHECK")[-1]
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", text))
    command = json.loads(re.search(r"CMD (\[.*\])", text).group(1))
    return command, options


def _seconds(value: str) -> float:
    return float(value[:-1]) if value.endswith("s") else float(value)


@pytest.mark.integration
def test_healthcheck_passes_on_a_serving_server(server):
    command, options = _healthcheck()
    assert command[0] == json.loads(final("ENTRYPOINT")[-1])[0]
    port = server.address.rpartition(":")[2]
    # As in the image: the server bound to every interface, the probe dials loopback.
    done = cli(*command[1:], env=_probe_env(f"0.0.0.0:{port}"))
    assert done.returncode == 0, done.stderr
    assert "SERVING" in done.stdout
    # The probe gives up before Docker would kill it.
    assert _seconds(options["timeout"]) > 2.0


def test_healthcheck_fails_when_nothing_listens():
    command, _ = _healthcheck()
    with socket.socket() as sock:  # bound and not listening while the probe dials it: refused
        sock.bind(("127.0.0.1", 0))  # (and no other process can take the port meanwhile)
        port = sock.getsockname()[1]
        done = cli(*command[1:], env=_probe_env(f"0.0.0.0:{port}"))
    assert done.returncode != 0
    assert "UNAVAILABLE" in done.stderr


def test_healthcheck_fails_on_a_server_that_is_not_serving():
    command, _ = _healthcheck()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = cli(*command[1:], env=_probe_env(f"0.0.0.0:{port}"))
        assert done.returncode == 1, done.stderr
        assert "NOT_SERVING" in done.stdout
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert cli(*command[1:], env=_probe_env(f"0.0.0.0:{port}")).returncode == 0
    finally:
        server.stop(None)


# ---------------------------------------------------------------- the HEALTHCHECK under TLS

# The server certificate names only this host: the probe, dialing loopback, must be told it.
SERVER_NAME = "context-engine.internal"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), ca_name="context-engine probe CA",
                    server_alt_names=f"DNS:{SERVER_NAME}")


def _tls_container_env(port: int | str, pki: Pki, *, mutual: bool = False,
                       **probe: Path | str) -> dict[str, str]:
    """The container's environment for a server run with TLS, plus the probe's settings."""
    env = _probe_env(f"0.0.0.0:{port}")
    env["CE_TLS_CERT_FILE"] = str(pki.server_cert)
    env["CE_TLS_KEY_FILE"] = str(pki.server_key)
    if mutual:
        env["CE_TLS_CLIENT_CA_FILE"] = str(pki.ca)
    env.update({f"CE_HEALTH_TLS_{name.upper()}": str(value) for name, value in probe.items()})
    return env


@pytest.mark.integration
def test_healthcheck_dials_tls_to_a_tls_server(database_url: str, pki: Pki):
    command, _ = _healthcheck()
    config = base_config().replace(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key)
    server = ServerThread(config, database_url)
    port = server.running.grpc_port
    try:
        done = cli(*command[1:], env=_tls_container_env(port, pki, ca_file=pki.ca,
                                                         server_name=SERVER_NAME))
        assert done.returncode == 0, done.stderr
        assert "SERVING" in done.stdout
        # With TLS on and nothing set for the probe, it says so instead of dialing plaintext.
        bare = cli(*command[1:], env=_tls_container_env(port, pki))
        assert bare.returncode == 2, bare.stderr
        assert "CE_HEALTH_TLS_CA_FILE" in bare.stderr and not bare.stdout
        # The certificate is really checked: against the wrong name, or trusting another CA.
        wrong_name = cli(*command[1:], env=_tls_container_env(port, pki, ca_file=pki.ca))
        assert wrong_name.returncode == 1, wrong_name.stderr
        wrong_ca = cli(*command[1:], env=_tls_container_env(
            port, pki, ca_file=pki.client_cert, server_name=SERVER_NAME))
        assert wrong_ca.returncode == 1, wrong_ca.stderr
        # Plaintext (what the probe dials when it is not told the server runs TLS) fails.
        plain = _tls_container_env(port, pki, ca_file=pki.ca, server_name=SERVER_NAME)
        del plain["CE_TLS_CERT_FILE"], plain["CE_TLS_KEY_FILE"]
        refused = cli(*command[1:], env=plain)
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    finally:
        server.stop()


@pytest.mark.integration
def test_healthcheck_presents_a_client_certificate_under_mutual_tls(database_url: str,
                                                                    pki: Pki):
    command, _ = _healthcheck()
    config = base_config().replace(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                     tls_client_ca_file=pki.ca)
    server = ServerThread(config, database_url)
    port = server.running.grpc_port
    try:
        done = cli(*command[1:], env=_tls_container_env(
            port, pki, mutual=True, ca_file=pki.ca, server_name=SERVER_NAME,
            cert_file=pki.client_cert, key_file=pki.client_key))
        assert done.returncode == 0, done.stderr
        # Without a client certificate the handshake could never succeed: a usage error.
        anonymous = cli(*command[1:], env=_tls_container_env(
            port, pki, mutual=True, ca_file=pki.ca, server_name=SERVER_NAME))
        assert anonymous.returncode == 2 and "CE_HEALTH_TLS_CERT_FILE" in anonymous.stderr
        # Flags take precedence over the variables.
        flagged = cli(*command[1:], "--tls-ca-file", str(pki.ca), "--tls-server-name",
                      SERVER_NAME, "--tls-cert-file", str(pki.client_cert), "--tls-key-file",
                      str(pki.client_key), env=_tls_container_env(port, pki, mutual=True))
        assert flagged.returncode == 0, flagged.stderr
        no_cert = cli(*command[1:], "--tls-ca-file", str(pki.ca), "--tls-server-name",
                      SERVER_NAME, env=_tls_container_env(port, pki, mutual=True))
        assert no_cert.returncode == 1, no_cert.stderr
    finally:
        server.stop()


@pytest.mark.parametrize(("probe", "message"), [
    ({"cert_file": "client.pem"}, "CE_HEALTH_TLS_KEY_FILE"),
    ({"key_file": "client.key"}, "CE_HEALTH_TLS_KEY_FILE"),
    ({"ca_file": "missing.pem", "server_name": SERVER_NAME}, "missing.pem"),
])
def test_healthcheck_tls_settings_are_checked_before_dialing(pki: Pki, probe: dict[str, str],
                                                             message: str):
    command, _ = _healthcheck()
    settings = {name: pki.ca.parent / value if name != "server_name" else value
                for name, value in probe.items()}
    done = cli(*command[1:], env=_tls_container_env(1, pki, **settings))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
