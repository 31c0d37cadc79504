"""The TypeScript client as a user takes it home: `npm pack` of the built package (message
types generated from the proto at build time) carries the compiled client, its generated types,
the contract and the example, and nothing else; installed with npm into a new folder outside
the repository, it is imported by name, type-checks through `exports`, and runs against the
real server, giving the prefix hashes the Python stub sees for the same inputs.

Node.js 20+ and npm are required (a missing toolchain fails, never skips); the install fetches
the package's runtime dependencies from the npm registry or npm's cache."""

from __future__ import annotations

import json
import re
import tarfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.clients.test_typescript_client import (
    FIXTURE,
    PACKAGE,
    build_package,
    check_agent_loop_output,
    client_env,
    fixture_checkpoint,
    plan_request,
    run_tool,
    toolchain,
)
from tests.conftest import REPO, ServerThread

pytestmark = pytest.mark.integration

CONTRACT = REPO / "proto" / "context_engine" / "v1" / "context_engine.proto"
HEX64 = re.compile(r"^[0-9a-f]{64}$")

# A consumer's script: the package by name, nothing else of the repository.
CONSUMER_JS = r"""
const fs = require("node:fs");
const path = require("node:path");
const ce = require("@context-engine/client");

async function main() {
  const fixture = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
  const [tenantId, sessionId] = [process.argv[3], process.argv[4]];
  const client = new ce.ContextEngineClient({ target: process.env.CE_GRPC_ADDR,
    insecure: true, deadlineMs: 20000 });
  try {
    const planned = await client.plan({ ...ce.PlanRequest.fromJSON(fixture.plan),
      tenantId, sessionId }, { metadata: { "x-request-id": "package-test" } });
    const built = await client.build({ tenantId, sessionId,
      checkpoint: ce.Checkpoint.fromJSON(fixture.checkpoint) });
    let notFound = null;
    try {
      await client.getPlan({ tenantId, sessionId: sessionId + "-missing" });
    } catch (err) {
      notFound = { error: err instanceof ce.ContextEngineError, code: err.codeName,
        reason: err.reason, domain: err.domain };
    }
    const repo = process.env.REPO_DIR;
    console.log(JSON.stringify({
      resolved: require.resolve("@context-engine/client"),
      fromRepo: Object.keys(require.cache).filter((p) => p.startsWith(repo + path.sep)),
      protoShipped: fs.existsSync(path.join(ce.PROTO_DIR, "context_engine", "v1",
        "context_engine.proto")),
      serviceConfig: ce.packagedServiceConfig(),
      epoch: planned.plan.epoch, createdAt: planned.plan.createdAt instanceof Date,
      planSha256: planned.plan.prefixSha256, buildSha256: built.prefixSha256,
      buildEpoch: built.epoch, trust: ce.TrustLevel.TRUST_LEVEL_USER, notFound,
    }));
  } finally {
    client.close();
  }
}
main().catch((err) => { console.error(err); process.exit(1); });
"""

# The same, as TypeScript a user would write: it must type-check against the installed
# package's declarations, reached through package.json "exports".
CONSUMER_TS = """
import { ContextEngineClient, ContextEngineError, GrpcStatus, type Input, type PlanRequest,
  type BuildResponse, TrustLevel, ConversationItem } from "@context-engine/client";

const request: Input<PlanRequest> = { tenantId: "t", sessionId: "s",
  model: { modelId: "claude-sonnet-4-5" }, toolCatalog: [{ name: "web.fetch",
  sideEffect: "SIDE_EFFECT_NETWORK_READ" }] };
const item: ConversationItem = ConversationItem.fromPartial({ id: "u1", sequence: "1",
  trust: TrustLevel.TRUST_LEVEL_USER, user: { text: "hi" } });

export async function run(client: ContextEngineClient): Promise<string> {
  await client.plan(request, { deadlineMs: 5_000, metadata: { traceparent: "00-1-2-01" } });
  const built: BuildResponse = await client.build({ tenantId: "t", sessionId: "s",
    checkpoint: { activeRunId: "r", items: [item] } });
  try {
    await client.getPlan({ tenantId: "t", sessionId: "missing" });
  } catch (err) {
    if (err instanceof ContextEngineError && err.code === GrpcStatus.NOT_FOUND) return err.reason;
  }
  return built.prefixSha256;
}
"""


def _members(tarball: Path) -> dict[str, bytes]:
    with tarfile.open(tarball) as tar:
        return {m.name: tar.extractfile(m).read()  # type: ignore[union-attr]  # a file
                for m in tar.getmembers() if m.isfile()}


@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`npm run build` (generate, compile), then `npm pack` into a temporary folder."""
    _, npm = build_package()
    out = tmp_path_factory.mktemp("ts-pack")
    run_tool([npm, "pack", "--pack-destination", str(out)], timeout=180, what="npm pack")
    [packed] = out.glob("*.tgz")
    return packed


@pytest.fixture(scope="module")
def installed(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new npm project outside the repository with the tarball installed into it."""
    _, npm = toolchain()
    app = tmp_path_factory.mktemp("ts-app")
    assert not app.resolve().is_relative_to(REPO.resolve())
    env = client_env("127.0.0.1:1", NODE_PATH="")
    run_tool([npm, "init", "-y"], cwd=app, env=env, timeout=60, what="npm init -y")
    run_tool([npm, "install", "--no-audit", "--no-fund", str(tarball)], cwd=app, env=env,
             timeout=900, what="npm install of the packed tarball")
    return app


def test_the_tarball_carries_the_client_the_generated_types_and_the_contract(
        tarball: Path) -> None:
    files = _members(tarball)
    names = {name.removeprefix("package/") for name in files}
    assert all(name.startswith("package/") for name in files)
    # The contract ships, byte for byte, with the google.rpc error model.
    assert files["package/proto/context_engine/v1/context_engine.proto"] == CONTRACT.read_bytes()
    assert {"proto/google/rpc/status.proto", "proto/google/rpc/error_details.proto"} <= names
    # The compiled client, the generated types with their declarations, the example.
    for stem in ("src/index", "src/client", "src/errors",
                 "src/gen/context_engine/v1/context_engine", "src/gen/google/rpc/status",
                 "src/gen/google/rpc/error_details", "src/gen/retry_service_config",
                 "examples/agent_loop"):
        assert {f"dist/{stem}.js", f"dist/{stem}.d.ts"} <= names, stem
    # Nothing else: no sources, tests, source maps, build scripts or dependencies.
    unexpected = sorted(n for n in names if not (
        n in ("package.json", "README.md") or n.startswith(("dist/src/", "dist/examples/",
                                                            "proto/"))))
    assert not unexpected, unexpected
    assert not [n for n in names if n.endswith((".ts", ".map")) and not n.endswith(".d.ts")]
    # No hand-written message types: every message of the contract is declared only by the
    # generated code.
    messages = set(re.findall(r"^message (\w+)", CONTRACT.read_text(), re.M))
    assert {"PlanRequest", "BuildResponse", "ConversationItem"} <= messages
    declared = re.compile(r"^\s*(?:export\s+)?(?:declare\s+)?(?:interface|type|class)\s+("
                          + "|".join(sorted(messages)) + r")\b", re.M)
    elsewhere = {n: sorted(set(declared.findall(files[f"package/{n}"].decode())))
                 for n in names if n.endswith(".d.ts") and not n.startswith("dist/src/gen/")}
    assert not any(elsewhere.values()), {n: d for n, d in elsewhere.items() if d}
    assert "dist/src/types.js" not in names

    manifest = json.loads(files["package/package.json"])
    assert manifest["name"] == "@context-engine/client"
    assert manifest["exports"]["."] == {"types": "./dist/src/index.d.ts",
                                        "require": "./dist/src/index.js",
                                        "default": "./dist/src/index.js"}
    assert "proto/" in manifest["files"]
    assert set(manifest["dependencies"]) == {"@grpc/grpc-js", "@bufbuild/protobuf"}
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in manifest["dependencies"].values())
    assert manifest["bin"]["context-engine-agent-loop"] == "dist/examples/agent_loop.js"


def test_a_consumer_imports_the_installed_package_by_name(
        installed: Path, server: ServerThread, stub: pb_grpc.ContextEngineStub) -> None:
    node, _ = toolchain()
    script = installed / "consumer.js"
    script.write_text(CONSUMER_JS)
    tenant, session = f"tenant-{uuid.uuid4().hex[:12]}", f"pkg-{uuid.uuid4().hex[:12]}"
    done = run_tool([node, str(script), str(FIXTURE), tenant, session], cwd=installed,
                    env=client_env(server.address, REPO_DIR=str(REPO), NODE_PATH=""),
                    timeout=120, what="a script requiring the installed package")
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    package_dir = (installed / "node_modules" / "@context-engine" / "client").resolve()
    assert Path(got["resolved"]).resolve().is_relative_to(package_dir), got["resolved"]
    assert got["fromRepo"] == [], "nothing may load from the checkout"
    assert got["protoShipped"] is True
    shared = json.loads((REPO / "clients" / "retry_service_config.json").read_text())
    assert got["serviceConfig"] == shared
    assert got["epoch"] == 1 and got["createdAt"] is True and got["buildEpoch"] == 1
    assert got["trust"] == "TRUST_LEVEL_USER"
    assert got["notFound"] == {"error": True, "code": "NOT_FOUND", "reason": "SESSION_NOT_FOUND",
                               "domain": "context-engine"}
    assert HEX64.match(got["planSha256"]) and got["buildSha256"] == got["planSha256"]

    # The Python stub, same inputs, another session of the same tenant: the same bytes.
    other = f"py-{uuid.uuid4().hex[:12]}"
    assert stub.Plan(plan_request(tenant, other), timeout=30).plan.prefix_sha256 == \
        got["planSha256"]
    built = stub.Build(pb.BuildRequest(tenant_id=tenant, session_id=other,
                                       checkpoint=fixture_checkpoint()), timeout=30)
    assert built.prefix_sha256 == got["buildSha256"]


def test_a_typescript_consumer_type_checks_against_the_installed_declarations(
        installed: Path) -> None:
    node, _ = toolchain()
    source = installed / "consumer.ts"
    source.write_text(CONSUMER_TS)
    tsc = PACKAGE / "node_modules" / "typescript" / "bin" / "tsc"
    node_types = PACKAGE / "node_modules" / "@types"
    run_tool([node, str(tsc), "--noEmit", "--strict", "--target", "ES2022",
              "--module", "node16", "--moduleResolution", "node16", "--skipLibCheck",
              "--typeRoots", str(node_types), "--types", "node", str(source)],
             cwd=installed, timeout=120,
             what="tsc on a consumer of the installed package (types through `exports`)")


def test_the_packaged_example_runs_from_the_installed_package(
        installed: Path, server: ServerThread, stub: pb_grpc.ContextEngineStub) -> None:
    tenant, session = f"tenant-{uuid.uuid4().hex[:12]}", f"loop-{uuid.uuid4().hex[:12]}"
    example = installed / "node_modules" / ".bin" / "context-engine-agent-loop"
    assert example.exists(), "the package's bin is installed"
    target = example.resolve()
    assert target.is_relative_to(installed.resolve()) and target.name == "agent_loop.js"
    done = run_tool([str(example), "--tenant", tenant, "--session", session], cwd=installed,
                    env=client_env(server.address, NODE_PATH=""), timeout=180,
                    what="the packaged agent-loop example")
    check_agent_loop_output(done.stdout, stub, tenant=tenant, session=session)
