"""The TypeScript client (clients/typescript) against the real server: its Node test suite, the
same prefix hashes as the Python stub for the same inputs, and the agent-loop example.

Node.js 20+ and npm are required; a missing toolchain or a failed install fails these tests.
`npm run build` generates the message types from proto/ (ts-proto through buf) and compiles."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine_client import Client as PyClient
from context_engine_client import NotFound
from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as cpb
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2

from tests.clients.test_python_client import OWN_MESSAGE, Fake
from tests.clients.test_python_client import fake as fake  # the fixture, shared
from tests.conftest import REPO, ServerThread

pytestmark = pytest.mark.integration

PACKAGE = REPO / "clients" / "typescript"
FIXTURE = PACKAGE / "test" / "fixtures" / "session.json"
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def run_tool(args: list[str], *, timeout: float, env: dict[str, str] | None = None,
             what: str, cwd: Path = PACKAGE,
             stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False, input=stdin)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{what} did not finish within {timeout:.0f} s: {err.stdout!r} {err.stderr!r}")
    if done.returncode != 0:
        pytest.fail(f"{what} failed (exit {done.returncode}):\n{done.stdout[-6000:]}\n"
                    f"{done.stderr[-6000:]}")
    return done


def _stale(node_modules: Path) -> bool:
    """npm ci records what it installed in node_modules/.package-lock.json."""
    installed = node_modules / ".package-lock.json"
    if not installed.exists():
        return True
    newest = max((PACKAGE / "package-lock.json").stat().st_mtime,
                 (PACKAGE / "package.json").stat().st_mtime)
    return newest > installed.stat().st_mtime


def toolchain() -> tuple[str, str]:
    """node and npm, or a failure that says what is missing (never a skip)."""
    node_bin, npm_bin = shutil.which("node"), shutil.which("npm")
    if node_bin is None or npm_bin is None:
        pytest.fail("the TypeScript client needs Node.js 20+ and npm on PATH "
                    f"(node: {node_bin}, npm: {npm_bin})")
    version = run_tool([node_bin, "--version"], timeout=30, what="node --version").stdout.strip()
    major = int(version.lstrip("v").split(".")[0])
    assert major >= 20, f"Node.js 20+ is required, found {version}"
    return node_bin, npm_bin


def build_package() -> tuple[str, str]:
    """The dependencies installed from package-lock.json when they are not yet, then
    `npm run build`: types generated from proto/, compiled to dist/. Returns node and npm.

    One build at a time on this machine (a lock file), and under pytest-xdist once per run:
    the run's workers share the package folder, and a second `npm ci` or build would rewrite
    node_modules/ or dist/ under a test of another worker that is running from them."""
    node_bin, npm_bin = toolchain()
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    built = PACKAGE / "node_modules" / ".ce-test-run"  # the run that built it last
    tag = hashlib.sha256(str(PACKAGE).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"ce-ts-build-{tag}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if run_id and built.exists() and built.read_text() == run_id:
                return node_bin, npm_bin
            if _stale(PACKAGE / "node_modules"):
                run_tool([npm_bin, "ci", "--no-audit", "--no-fund"], timeout=600,
                         what="npm ci in clients/typescript")
            run_tool([npm_bin, "run", "build"], timeout=300,
                     what="npm run build (buf generate with ts-proto, then tsc)")
            if run_id:
                built.write_text(run_id)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return node_bin, npm_bin


@pytest.fixture(scope="module")
def node() -> str:
    """The Node toolchain, the dependencies installed from package-lock.json, the build."""
    return build_package()[0]


def client_env(address: str, **extra: str) -> dict[str, str]:
    """The environment of a Node process: the server's address, no token (dev mode)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CE_TOKEN", "NODE_OPTIONS")}
    env.update(CE_GRPC_ADDR=address, **extra)
    return env


def _env(server: ServerThread, **extra: str) -> dict[str, str]:
    return client_env(server.address, **extra)


def fixture_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


def plan_request(tenant: str, session: str) -> pb.PlanRequest:
    req = json_format.ParseDict(fixture_data()["plan"], pb.PlanRequest())
    req.tenant_id, req.session_id = tenant, session
    return req


def fixture_checkpoint() -> pb.Checkpoint:
    return json_format.ParseDict(fixture_data()["checkpoint"], pb.Checkpoint())


def test_the_fixture_prefix_does_not_depend_on_the_session(
        stub: pb_grpc.ContextEngineStub) -> None:
    """The comparison below plans Node's inputs under another session id. That holds only
    while no Region A content of the fixture is enveloped (an envelope's nonce is derived
    from the session key): no server-provided tool, memory snapshot or untrusted skill."""
    plan = json_format.ParseDict(fixture_data()["plan"], pb.PlanRequest())
    assert not plan.HasField("memory_snapshot") and not plan.skill_catalog
    assert all(not tool.server for tool in plan.tool_catalog)
    tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    hashes = {stub.Plan(plan_request(tenant, f"s-{i}-{uuid.uuid4().hex[:8]}"),
                        timeout=30).plan.prefix_sha256 for i in range(2)}
    other = stub.Plan(plan_request(f"tenant-{uuid.uuid4().hex[:12]}", "s-other"),
                      timeout=30).plan.prefix_sha256
    assert len(hashes) == 1 and other in hashes


def test_node_suite_and_prefix_hashes_match_python(node: str, server: ServerThread,
                                                   stub: pb_grpc.ContextEngineStub,
                                                   tmp_path: Path) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    result_file = tmp_path / "result.json"
    done = run_tool([node, "--test", "dist/test/integration.test.js", "dist/test/client.test.js",
                     "dist/test/formats.test.js", "dist/test/incremental.test.js"],
                    timeout=120, env=_env(server, CE_RESULT_FILE=str(result_file),
                                          CE_TENANT_ID=tenant),
                    what="node --test")
    assert re.search(r"^# pass [1-9]\d*$", done.stdout, re.M), done.stdout[-3000:]
    assert re.search(r"^# fail 0$", done.stdout, re.M), done.stdout[-3000:]
    assert re.search(r"^# skipped 0$", done.stdout, re.M), done.stdout[-3000:]
    assert "# SKIP" not in done.stdout, done.stdout[-3000:]  # a skipped suite is not counted

    node_result = json.loads(result_file.read_text())
    assert node_result["tenantId"] == tenant
    node_session = node_result["sessionId"]
    assert node_result["notFound"] == {"code": "NOT_FOUND", "reason": "SESSION_NOT_FOUND",
                                       "domain": "context-engine"}
    for step in ("plan", "build", "rotate", "compact"):
        assert HEX64.match(node_result[step]["prefixSha256"]), step
    # Incremental Build against this server: deltas read back byte-identical (checked in Node),
    # and the one Build whose base was erased went again whole.
    stats = node_result["incremental"]
    assert stats["incremental"] >= 10 and stats["fullResends"] == 1, stats
    assert stats["bytesSaved"] > 0, stats

    # The same inputs from Python, under another session id of the same tenant.
    session = f"py-{uuid.uuid4().hex[:12]}"
    assert session != node_session
    plan = stub.Plan(plan_request(tenant, session), timeout=30).plan
    assert plan.epoch == 1
    assert plan.prefix_sha256 == node_result["plan"]["prefixSha256"]

    built = stub.Build(pb.BuildRequest(tenant_id=tenant, session_id=session,
                                       checkpoint=fixture_checkpoint()), timeout=30)
    assert built.prefix_sha256 == node_result["build"]["prefixSha256"]
    assert built.estimated_input_tokens > 0

    rotated = stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                           reason=pb.ROTATION_REASON_OPERATOR,
                                           idempotency_key=f"rotate-{session}"), timeout=30)
    assert rotated.rotated and rotated.plan.epoch == node_result["rotate"]["epoch"] == 2
    assert rotated.plan.prefix_sha256 == node_result["rotate"]["prefixSha256"]

    compacted = stub.Compact(pb.CompactRequest(
        tenant_id=tenant, session_id=session, checkpoint=fixture_checkpoint(),
        replace_through_sequence=int(fixture_data()["compactThroughSequence"]),
        reason="budget_pressure", idempotency_key=f"compact-{session}"), timeout=30)
    assert list(compacted.replaced_item_ids) == node_result["compact"]["replacedItemIds"]
    checkpoint = fixture_checkpoint()
    checkpoint.summary.CopyFrom(compacted.summary)
    on_summary = stub.Build(pb.BuildRequest(tenant_id=tenant, session_id=session,
                                            checkpoint=checkpoint), timeout=30)
    assert on_summary.epoch == node_result["compact"]["epoch"] == 2
    assert on_summary.prefix_sha256 == node_result["compact"]["prefixSha256"]

    # Every provider format came back typed in Node, with the format's top-level keys; the
    # same format from Python has the same keys.
    formats = node_result["formats"]
    assert formats["default"] == "anthropic_messages"
    for name, keys in BODY_KEYS.items():
        entry = formats[name]
        assert entry["providerFormat"] == f"PROVIDER_FORMAT_{name.upper()}", entry
        assert keys <= set(entry["keys"]), (name, entry["keys"])
        from_python = stub.Build(pb.BuildRequest(
            tenant_id=tenant, session_id=session, checkpoint=fixture_checkpoint(),
            provider_format=pb.ProviderFormat.Value(entry["providerFormat"])), timeout=30)
        assert sorted(json.loads(from_python.provider_body_json)) == entry["keys"], name
    cached = formats["gemini_generate_content"]["cachedContent"]
    # the session's own name (session key, prefix, epoch), as the README gives it
    tag = hashlib.sha256(f"{cached['sessionKey']}:{cached['prefixSha256']}".encode()).hexdigest()
    assert cached["displayName"] == f"ce-{tag[:16]}-e1", cached
    assert {"model", "displayName", "ttl"} <= set(cached["createKeys"])
    assert set(cached["holds"]) <= set(cached["createKeys"])

    # And Node's own session, read back through the Python stub.
    for epoch, step in ((1, "plan"), (2, "rotate")):
        got = stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=node_session,
                                             epoch=epoch), timeout=30).plan
        assert got.prefix_sha256 == node_result[step]["prefixSha256"]


def test_agent_loop_example(node: str, server: ServerThread,
                            stub: pb_grpc.ContextEngineStub) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    session = f"loop-{uuid.uuid4().hex[:12]}"
    done = run_tool([node, "dist/examples/agent_loop.js"], timeout=120,
                    env=_env(server, CE_TENANT_ID=tenant, CE_SESSION_ID=session),
                    what="the agent_loop example")
    check_agent_loop_output(done.stdout, stub, tenant=tenant, session=session)



def test_agent_loop_example_reads_its_token_from_stdin_or_the_environment(
        node: str, secured: tuple[ServerThread, str, str]) -> None:
    """--grpc-addr wins over CE_GRPC_ADDR; the bearer token comes from one line of standard
    input with --token-stdin, or from CE_TOKEN; without one the server refuses the call."""
    server, tenant, token = secured
    example = "dist/examples/agent_loop.js"
    unreachable = client_env("127.0.0.1:1")  # the flag must win over the variable
    done = run_tool([node, example, "--grpc-addr", server.address, "--tenant", tenant,
                     "--session", f"stdin-{uuid.uuid4().hex[:12]}", "--token-stdin"],
                    stdin=f"{token}\n", timeout=120, env=unreachable,
                    what="the agent_loop example with --token-stdin")
    assert re.search(r"^RESULT \{", done.stdout, re.M), done.stdout[-2000:]
    done = run_tool([node, example, "--tenant", tenant,
                     "--session", f"env-{uuid.uuid4().hex[:12]}"], timeout=120,
                    env=client_env(server.address, CE_TOKEN=token),
                    what="the agent_loop example with CE_TOKEN")
    assert re.search(r"^RESULT \{", done.stdout, re.M), done.stdout[-2000:]
    refused = subprocess.run([node, example, "--tenant", tenant, "--session", "no-token"],
                             cwd=PACKAGE, env=client_env(server.address), capture_output=True,
                             text=True, timeout=120, check=False)
    assert refused.returncode == 1, refused.stdout[-2000:]
    assert "context-engine error UNAUTHENTICATED" in refused.stderr, refused.stderr[-2000:]


def test_agent_loop_example_answers_help_and_a_bad_command_line_in_one_line(node: str) -> None:
    """--help prints the usage (exit 0); an unknown option, a missing value, an unknown
    format or an empty --token-stdin is one line on stderr and exit 2, no stack trace, and
    nothing is sent (the address is unreachable)."""
    example = "dist/examples/agent_loop.js"
    env = client_env("127.0.0.1:1")
    helped = subprocess.run([node, example, "--help"], cwd=PACKAGE, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: "), helped
    assert "--print-body FORMAT" in helped.stdout and "bedrock_converse" in helped.stdout
    for argv, stdin, said in (
            (["--nope"], None, "Unknown option '--nope'"),
            (["--tenant"], None, "--tenant"),
            (["--print-body", "nope"], None, 'unknown provider format "nope"'),
            (["--token-stdin"], "\n", "standard input has no token"),
            (["--tls", "--plaintext"], None, "--tls and --plaintext exclude each other"),
            (["--grpc-addr", "10.255.255.1:50051", "--token-stdin"], "t0ken\n",
             "the token would travel in plaintext to 10.255.255.1:50051, which is not on this "
             "machine: pass --tls for TLS, or --plaintext"),
            # a name shaped like a loopback address, which DNS could answer with any host
            (["--grpc-addr", "127.999.0.1:50051", "--token-stdin"], "t0ken\n",
             "the token would travel in plaintext to 127.999.0.1:50051"),
            (["--grpc-addr", "[::1%lo]:50051", "--token-stdin"], "t0ken\n",
             "the token would travel in plaintext to [::1%lo]:50051")):
        done = subprocess.run([node, example, *argv], cwd=PACKAGE, env=env, input=stdin,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, (argv, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (argv, done.stderr)
        assert lines[0].startswith("context-engine-agent-loop: ") and lines[0].endswith(
            "(see --help)"), lines
        assert done.stdout == "", (argv, done.stdout)


def test_agent_loop_example_sends_its_token_to_this_machine_straight(
        node: str, secured: tuple[ServerThread, str, str]) -> None:
    """Plaintext with a token to this machine: not through the environment's proxy, which
    would carry the token elsewhere (grpc-js honours http_proxy and grpc_proxy)."""
    server, tenant, token = secured
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen(8)
    proxy.settimeout(0.5)
    at = f"http://127.0.0.1:{proxy.getsockname()[1]}"
    env = {k: v for k, v in client_env(server.address).items()
           if k.lower() not in ("no_proxy", "http_proxy", "https_proxy", "grpc_proxy")}
    try:
        done = run_tool([node, "dist/examples/agent_loop.js", "--tenant", tenant, "--session",
                         f"proxy-{uuid.uuid4().hex[:12]}", "--token-stdin"],
                        stdin=f"{token}\n", timeout=120,
                        env={**env, "http_proxy": at, "grpc_proxy": at},
                        what="the agent_loop example with a proxy in the environment")
        assert re.search(r"^RESULT \{", done.stdout, re.M), done.stdout[-2000:]
        with pytest.raises(TimeoutError):
            proxy.accept()
    finally:
        proxy.close()


# The top-level keys each format's body has (tools, a system prompt, a user message).
BODY_KEYS = {
    "anthropic_messages": {"model", "max_tokens", "system", "messages", "tools"},
    "openai_responses": {"model", "instructions", "input", "prompt_cache_key", "tools"},
    "openai_chat_completions": {"model", "messages", "tools"},
    "gemini_generate_content": {"contents", "systemInstruction", "tools", "generationConfig"},
    "bedrock_converse": {"modelId", "system", "messages", "toolConfig", "inferenceConfig"},
}


def printed_json(text: str, header: str) -> tuple[str, dict[str, Any]]:
    """The header line matching ``header`` (a regex) and the JSON object printed after it."""
    found = re.search(header + r"\n", text, re.M)
    assert found, text[-3000:]
    value, _ = json.JSONDecoder().raw_decode(text, found.end())
    assert isinstance(value, dict)
    return found.group(0).strip(), value


@pytest.mark.parametrize("name", list(BODY_KEYS))
def test_agent_loop_example_prints_the_body_of_each_format(
        node: str, server: ServerThread, stub: pb_grpc.ContextEngineStub, name: str) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    session = f"body-{uuid.uuid4().hex[:12]}"
    done = run_tool([node, "dist/examples/agent_loop.js", "--print-body", name], timeout=120,
                    env=_env(server, CE_TENANT_ID=tenant, CE_SESSION_ID=session),
                    what=f"the agent_loop example with --print-body {name}")
    check_agent_loop_output(done.stdout, stub, tenant=tenant, session=session)  # all else
    assert len(re.findall(r"^== provider body ", done.stdout, re.M)) == 1  # the first request
    _, body = printed_json(done.stdout, rf"^== provider body {name} \(turn 1, step 1\):$")
    assert BODY_KEYS[name] <= set(body), sorted(body)
    assert "I need to be in Milan on 3 December" in json.dumps(body)  # the first user message
    creates = re.findall(r"^== gemini cached content ", done.stdout, re.M)
    if name != "gemini_generate_content":
        assert not creates
        return
    header, create = printed_json(
        done.stdout, r"^== gemini cached content (ce-[0-9a-f]{16}-e1) \(ttl \d+s, holds .+; "
                     r"\d+ tokens, minimum \d+\), create body:$")
    assert len(creates) == 1
    assert set(create) >= {"model", "displayName", "ttl"} and create["displayName"] in header


def check_agent_loop_output(out: str, stub: pb_grpc.ContextEngineStub, *, tenant: str,
                            session: str) -> None:
    """What the agent-loop example prints for a new session, checked against the server."""
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["sessionId"] == session
    assert result["requests"] >= 10
    assert result["rotations"] == 1 and result["compactions"] >= 1
    assert {"tool_results", "history"} <= set(result["pressureSteps"])
    assert result["maxExcerptedResults"] >= 1 and result["maxPointers"] >= 1

    # Every request prints its epoch's prefix; one hash per epoch, a new one after rotating.
    printed: dict[int, set[str]] = {}
    for epoch, digest in re.findall(r"^epoch (\d+) prefix_sha256 ([0-9a-f]{64})$", out, re.M):
        printed.setdefault(int(epoch), set()).add(digest)
    assert set(printed) == {1, 2}
    assert all(len(hashes) == 1 for hashes in printed.values())
    assert {e: h.pop() for e, h in printed.items()} == {int(k): v for k, v in
                                                        result["epochs"].items()}
    assert result["epochs"]["1"] != result["epochs"]["2"]
    for epoch in (1, 2):
        got = stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session, epoch=epoch),
                           timeout=30).plan
        assert got.prefix_sha256 == result["epochs"][str(epoch)]
    assert got.reason == "model_routed" and got.model_id == "acme-chat-64k"

    # Budget tables, cache markers and the compaction it performed.
    assert out.count("== turn ") >= result["requests"]
    assert re.search(r"^  tool_results\s+\d+\s+\d+", out, re.M)
    assert re.search(r"^budget total 12000  reserve 1500 ", out, re.M)
    assert re.search(r"^breakpoints after_system\(5m\) after_tools\(5m\) carried_history", out,
                     re.M)
    assert re.search(r"compaction_needed true  left_out \d+ items/\d+ tokens", out)
    assert re.search(r"^>> compacted \d+ items into a depth-1 summary", out, re.M)
    assert "rebuilt on the summary" in out
    # the model's working-state call went to the engine raw, its answer back as the result
    assert re.search(r"^>> working state: Working state updated: 1 fact recorded; next action "
                     r"set\. The block is \d+ of 1,000 tokens\.$", out, re.M), out[-3000:]


STATUS_TRAILERS = {  # (the status's code, its message): whether a client reads its details
    "the call's own status": (code_pb2.NOT_FOUND, OWN_MESSAGE, True),
    "another message under the call's code": (code_pb2.NOT_FOUND, "another failure's message",
                                              False),
    "another code under the call's message": (code_pb2.FAILED_PRECONDITION, OWN_MESSAGE, False),
}


@pytest.mark.parametrize("kind", list(STATUS_TRAILERS))
def test_both_clients_read_a_status_trailer_alike(node: str, fake: tuple[Fake, str],
                                                  kind: str) -> None:
    """The same failed Build (NOT_FOUND, grpc-message OWN_MESSAGE) with a
    grpc-status-details-bin trailer, to the Python client and to the TypeScript one: a status
    whose code or message is not the call's (grpc's rpc_status.from_call refuses it) is read by
    neither (no reason; the call's code and message), one that is the call's by both. The
    TypeScript client once read a status whose message alone differed."""
    status_code, status_message, read = STATUS_TRAILERS[kind]
    state, target = fake
    state.failures, state.code = 100, grpc.StatusCode.NOT_FOUND
    status = status_pb2.Status(code=status_code, message=status_message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(
        reason="SESSION_NOT_FOUND", domain="context-engine", metadata={"session_id": "s"}))
    state.trailer = status.SerializeToString()
    request = pb.BuildRequest(tenant_id="t", session_id="s")
    reason = "SESSION_NOT_FOUND" if read else ""

    with PyClient(target=target) as engine, pytest.raises(NotFound) as raised:
        engine.build(request=cpb.BuildRequest.FromString(request.SerializeToString()))
    assert (raised.value.message, raised.value.reason, dict(raised.value.metadata)) == (
        OWN_MESSAGE, reason, {"session_id": "s"} if read else {})

    lines = [{"op": "build", "target": target,
              "request_b64": base64.b64encode(request.SerializeToString()).decode()},
             {"op": "quit"}]
    done = run_tool([node, "dist/test-driver/incremental_driver.js"], timeout=60,
                    env=client_env(target), what="the TypeScript driver",
                    stdin="".join(json.dumps(line) + "\n" for line in lines))
    answer = json.loads(done.stdout.splitlines()[0])
    said = f" {reason}" if reason else ""
    assert answer == {"error": f"Build: NOT_FOUND{said}: {OWN_MESSAGE}", "code": "NOT_FOUND",
                      "reason": reason}, answer
    assert state.calls == {"Build": 2}  # one each: NOT_FOUND is never retried


@pytest.mark.integration
def test_a_refusal_names_every_violation_of_the_whole_build_whether_the_base_is_held(
        node: str, server: ServerThread, stub: pb_grpc.ContextEngineStub,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the Python client's (tests/clients/test_python_incremental.py): a Build refused for a
    field of its own (a factor out of range) and for an item it sends (the first item's id and
    sequence again) is rejected with the whole Build's violations, in order, whether the replica
    still holds the base or not (evicted: BUILD_BASE_UNKNOWN, and the Build sent again whole)."""
    # imported here: both modules import from this one
    from tests.clients.test_python_incremental import (
        base_lookups,
        build_request,
        plan,
        whole_refusal,
    )
    from tests.integration.test_incremental_differential import Driver

    tenant, sid = f"tenant-{uuid.uuid4().hex[:12]}", "refused"
    stub.Plan(plan(tenant, sid), timeout=30)
    good, bad = build_request(tenant, sid, 2), build_request(tenant, sid, 3)
    bad.estimator_factor = 0.1
    bad.checkpoint.items.append(bad.checkpoint.items[0])
    want = whole_refusal(stub, bad)
    assert len(want) == 3, want
    builds = server.running.engine.builds
    looked = base_lookups(builds, tenant, monkeypatch)
    driver = Driver()
    try:
        for held in (True, False):
            assert "response_b64" in driver.build(server.address, good)  # the base
            if not held:  # the replica no longer holds it (an eviction, a restart)
                builds.forget(tenant, sid)
            looked.clear()
            answer = driver.build(server.address, bad)
            assert answer["code"] == "INVALID_ARGUMENT", (held, answer)
            assert [tuple(v) for v in answer["violations"]] == want, (held, answer)
            assert looked and set(looked) == {held}, (held, looked)
    finally:
        driver.close()
