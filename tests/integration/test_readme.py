"""The README's Python snippet and five-minute tour (``context-engine demo``) run as written
against a real server, the demo's failures are clear, it takes its token from ``CE_TOKEN`` or
standard input (never argv), its configuration table names exactly the settings the code reads,
each with the code's default and bounds, and ARCHITECTURE.md names only modules that exist."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from context_engine.cli import main
from context_engine.config import Config, variables

from tests.conftest import REPO
from tests.integration.requests import plan_request

pytestmark = pytest.mark.integration


def test_readme_snippet_calls_plan_then_build(server):
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Calling it from Python\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no '## Calling it from Python' section"
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 1
    for other in re.findall(r"```python\n(.*?)```", text, re.S):
        compile(other, "README.md", "exec")  # every Python block is at least Python
    out = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True,
                         env={**os.environ, "CE_GRPC_ADDR": server.address}, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("epoch 1 prefix ")
    assert lines[1].startswith("10 ROLE_USER <user source=\"user\" id=\"u1\"")
    assert any(line.startswith("10 ROLE_TOOL <untrusted") for line in lines)
    assert lines[-1].endswith("tokens")


def readme_tour_block() -> str:
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## A five-minute tour\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no '## A five-minute tour' section"
    blocks = re.findall(r"```text\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 1, "the tour section holds exactly one text block: the tour's output"
    return blocks[0]


@pytest.fixture(autouse=True)
def _no_ids_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo reads CE_TENANT_ID and CE_SESSION_ID: a developer's own must not change the
    tour these tests compare (its ids are in the prompt, and so in its token counts)."""
    monkeypatch.delenv("CE_TENANT_ID", raising=False)
    monkeypatch.delenv("CE_SESSION_ID", raising=False)


def demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``context-engine demo`` run in-process: its exit status, stdout and stderr."""
    capsys.readouterr()
    code = main(["demo", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_tour_is_the_demos_output(server, db, capsys):
    # The tour is deterministic for a new session of tenant "tour"; a database kept between
    # runs (CE_TEST_DATABASE_URL) may hold it from an earlier run.
    tables = [r["table_name"] for r in db.fetch(
        "SELECT table_name FROM information_schema.columns WHERE column_name = 'tenant_id' "
        "AND table_schema = current_schema()")]
    for table in sorted(tables, key=lambda t: t == "sessions"):  # sessions last (foreign keys)
        db.fetch(f'DELETE FROM "{table}" WHERE tenant_id = $1', "tour")
    code, out, err = demo(capsys, "--grpc-addr", server.address)
    assert code == 0, err
    assert "== 6. Rotate" in out and "compaction_needed=True" in out
    assert readme_tour_block() == out, (
        "README.md's tour block is not the demo's output; paste this into it:\n" + out)


def test_the_demo_refuses_a_session_that_exists(server, stub, ids, capsys):
    _, session = ids
    stub.Plan(plan_request("tour", session))
    code, out, err = demo(capsys, "--grpc-addr", server.address, "--session", session)
    assert code == 1 and not out
    assert f"session {session!r} of tenant 'tour' exists already" in err


def test_the_demo_command_reports_an_unreachable_server():
    # A bound socket that never listens: connecting to it is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        out = subprocess.run([str(Path(sys.executable).parent / "context-engine"), "demo",
                              "--grpc-addr", address], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1 and not out.stdout
    assert out.stderr.startswith(f"context-engine demo: cannot reach a context-engine server "
                                 f"at {address} (UNAVAILABLE"), out.stderr
    assert "pass --grpc-addr" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_demo_reads_the_address_from_ce_grpc_addr(monkeypatch, capsys):
    # No flag: CE_GRPC_ADDR, the variable `serve` listens on, names the server to call.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        monkeypatch.setenv("CE_GRPC_ADDR", address)
        code, _, err = demo(capsys, "--session", f"s-{uuid.uuid4().hex[:8]}")
    assert code == 1 and f"cannot reach a context-engine server at {address}" in err, err
    # One name for each, everywhere; `--token` is not even an abbreviation of --token-stdin.
    for args in (["--addr", "x"], ["--target", "x"], ["--token", "x"], ["--token"]):
        with pytest.raises(SystemExit) as exited:
            main(["demo", *args])
        assert exited.value.code == 2



def test_the_demo_sends_its_token_as_bearer_metadata(secured, monkeypatch, capsys):
    server, tenant, token = secured
    monkeypatch.delenv("CE_TOKEN", raising=False)
    code, out, err = demo(capsys, "--grpc-addr", server.address, "--tenant", tenant)
    assert code == 1 and not out
    assert "GetPlan failed: UNAUTHENTICATED" in err, err
    assert "set CE_TOKEN or pass --token-stdin" in err, err
    monkeypatch.setenv("CE_TOKEN", f"not-{token}")
    code, out, err = demo(capsys, "--grpc-addr", server.address, "--tenant", tenant)
    assert code == 1 and "GetPlan failed: UNAUTHENTICATED" in err, err
    monkeypatch.setenv("CE_TOKEN", token)
    code, out, err = demo(capsys, "--grpc-addr", server.address)  # tenant "tour"
    assert code == 1 and "GetPlan failed: PERMISSION_DENIED" in err, err
    assert token not in err
    code, out, err = demo(capsys, "--grpc-addr", server.address, "--tenant", tenant)
    assert code == 0, err
    assert out.startswith("== 1. Plan") and "== 6. Rotate" in out, out
    assert token not in out


def test_the_demo_reads_its_token_from_stdin(secured, monkeypatch, capsys):
    server, tenant, token = secured
    monkeypatch.setenv("CE_TOKEN", f"not-{token}")  # --token-stdin wins over the variable
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"  {token}  \nignored\n"))
    code, out, err = demo(capsys, "--grpc-addr", server.address, "--tenant", tenant,
                          "--session", f"stdin-{uuid.uuid4().hex[:8]}", "--token-stdin")
    assert code == 0, err
    assert out.startswith("== 1. Plan") and token not in out


def test_the_demo_reads_its_tenant_and_session_from_the_variables(secured, monkeypatch, capsys):
    """README names CE_TENANT_ID and CE_SESSION_ID as read by the demo; it read neither, and a
    token's tenant set there was refused TENANT_MISMATCH under tenant 'tour'."""
    server, tenant, token = secured
    session = f"env-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("CE_TOKEN", token)
    monkeypatch.setenv("CE_TENANT_ID", tenant)
    monkeypatch.setenv("CE_SESSION_ID", session)
    code, out, err = demo(capsys, "--grpc-addr", server.address)
    assert code == 0, err
    assert out.startswith("== 1. Plan") and "== 6. Rotate" in out
    code, _, err = demo(capsys, "--grpc-addr", server.address)  # that session exists now
    assert code == 1 and f"session {session!r} of tenant {tenant!r} exists already" in err, err


def _non_loopback_ip() -> str | None:
    """An address of this machine other than loopback (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: it only picks a route
        except OSError:
            return None
        ip = str(probe.getsockname()[0])
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_the_demo_sends_a_token_to_no_other_machine(monkeypatch, capsys):
    """The demo speaks plaintext gRPC only, yet sent CE_TOKEN to any address it was given:
    `demo --grpc-addr host:50051` carried the bearer token in cleartext over the network,
    where both clients and their examples refuse unless told TLS or plaintext. It refuses now,
    before it connects: nothing reaches the listener, whatever answers there."""
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no address but loopback")
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen(8)
        address = f"{ip}:{listener.getsockname()[1]}"
        monkeypatch.setenv("CE_TOKEN", "token-that-must-stay-here")
        code, out, err = demo(capsys, "--grpc-addr", address, "--session", "s")
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()[0].close()
    assert code == 2 and not out, err
    assert err == (f"context-engine demo: the demo speaks plaintext gRPC, so it sends a token "
                   f"only to this machine, and {address} is not on it: run the demo where the "
                   f"server runs (or through a tunnel to it)\n"), err
    assert "token-that-must-stay-here" not in err


def test_the_demos_token_to_this_machine_goes_through_no_proxy(secured, monkeypatch, capsys):
    """With http_proxy set (as it is behind many corporate networks), gRPC sent the demo's
    calls, and the token in them, through the proxy even to 127.0.0.1: the proxy received a
    CONNECT and then the plaintext HTTP/2 stream. The demo dials this machine straight now,
    as both clients do; the proxy sees nothing."""
    server, tenant, token = secured
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(8)
        proxy_url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        for name in ("http_proxy", "https_proxy", "grpc_proxy"):
            monkeypatch.setenv(name, proxy_url)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("no_grpc_proxy", raising=False)
        monkeypatch.setenv("CE_TOKEN", token)
        code, out, err = demo(capsys, "--grpc-addr", server.address, "--tenant", tenant,
                              "--session", f"proxy-{uuid.uuid4().hex[:8]}")
        proxy.settimeout(0.5)
        with pytest.raises(TimeoutError):
            proxy.accept()[0].close()
    assert code == 0, err
    assert out.startswith("== 1. Plan") and "== 6. Rotate" in out


@pytest.mark.parametrize("stdin", ["", "\n", "   \nsecond line\n"])
def test_the_demo_refuses_an_empty_token_on_stdin(stdin, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code, out, err = demo(capsys, "--grpc-addr", "127.0.0.1:1", "--token-stdin")
    assert code == 2 and not out
    assert err == ("context-engine demo: --token-stdin read no token: standard input's first "
                   "line is empty\n")


def test_readme_names_the_address_and_the_token_one_way():
    text = (REPO / "README.md").read_text()
    assert not re.findall(r"(?<![\w-])--addr\b", text), "the flag is --grpc-addr"
    assert "CONTEXT_ENGINE_ADDR" not in text, "the variable is CE_GRPC_ADDR"
    assert not re.findall(r"demo[^\n]*--token(?!-stdin)\b|pass\s+`--token`", text), (
        "the demo's token comes from CE_TOKEN or --token-stdin")


def configuration_rows() -> dict[str, tuple[str, str]]:
    """``{variable: (default, meaning)}`` of the README's configuration table."""
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Configuration\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no '## Configuration' section"
    rows = re.findall(r"^\| `([A-Z_]+)` \| (.*?) \| (.*) \|$", section.group(1), re.M)
    return {variable: (default, meaning) for variable, default, meaning in rows}


# Read beside the settings, by the token counter (adapters/tokenizers.py), documented in the
# table as what it is.
NOT_SETTINGS = {"TIKTOKEN_CACHE_DIR"}


def test_readme_configuration_table_matches_the_code():
    """Every variable read is a row, and every row a variable read."""
    documented = set(configuration_rows())
    read = set(variables().values())
    assert {"DATABASE_URL", "CE_GRPC_ADDR", "CE_SUMMARIZER_API_KEY"} <= read
    assert read <= documented, read - documented
    assert documented - read == NOT_SETTINGS, documented - read - NOT_SETTINGS


def test_readme_configuration_defaults_are_the_codes():
    """Each row's default, read as that variable's value, is the setting's default (a path:
    the documented end of it; unset: no value)."""
    rows = configuration_rows()
    default = Config()
    for name, variable in variables().items():
        written, _ = rows[variable]
        value = getattr(default, name)
        if written == "*(unset)*":
            assert value in (None, ""), f"{variable}: README says unset, the code {value!r}"
            continue
        shown = re.match(r"(?:packaged )?`([^`]*)`", written)
        assert shown, f"{variable}: no default in {written!r}"
        if isinstance(value, Path):
            assert value.parts[-len(Path(shown.group(1)).parts):] == Path(shown.group(1)).parts, (
                f"{variable}: README says {written!r}, the code {value}")
            continue
        read = getattr(Config.from_env({variable: shown.group(1)}), name)
        assert read == value, f"{variable}: README says {shown.group(1)!r}, the code {value!r}"


def _stated(number: float, text: str) -> bool:
    """Whether ``text`` writes ``number`` (1024 or 1,024; 0.5), not as part of another."""
    forms = {f"{number:g}", f"{number:,g}"} if not float(number).is_integer() else {
        str(int(number)), f"{int(number):,}"}
    return any(re.search(rf"(?<![\d,.]){re.escape(form)}(?!\d|[.,]\d)", text) for form in forms)


def test_readme_configuration_rows_state_the_codes_bounds():
    """Each setting's bounds are written in its row (lower bounds of 0 and 1 go without
    saying): a bound the code changes, or one the row never said, fails here."""
    rows = configuration_rows()
    checked = 0
    for name, variable in variables().items():
        row = " ".join(rows[variable])
        for constraint in Config.model_fields[name].metadata:
            for kind in ("ge", "gt", "le", "lt"):
                bound = getattr(constraint, kind, None)
                if bound is None or (kind in ("ge", "gt") and bound in (0, 1)):
                    continue
                checked += 1
                assert _stated(bound, row), f"{variable}: its row does not say {kind} {bound}"
    assert checked >= 20


def test_architecture_names_only_paths_that_exist():
    text = (REPO / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:service|tests|migrations|deploy|proto|clients)/[^`\s]*)`",
                           text))
    named |= {"service/context_engine/" + p for p in re.findall(
        r"`((?:domain|adapters|api|telemetry)/[^`\s]*|engine\.py|config\.py|cli\.py)`", text)}
    assert len(named) >= 30, sorted(named)
    missing = sorted(p for p in named if not (REPO / p.rstrip("/")).exists())
    assert not missing, missing


def test_a_reader_that_stops_early_ends_the_demo_quietly(server):
    """``context-engine demo | head -3``: the reader is gone while the demo still prints (here
    before it prints at all); it ends with status 1 and no traceback."""
    session = f"pipe-{uuid.uuid4().hex[:8]}"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([str(Path(sys.executable).parent / "context-engine"), "demo",
                               "--grpc-addr", server.address, "--session", session],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
