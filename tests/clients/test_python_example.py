"""clients/python/examples/agent_loop.py runs against the real server and shows what it
promises: each request's budget table, its cache markers and prefix_sha256, a compaction when
Build asks for one, and the rotation at the end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "clients" / "python" / "examples" / "agent_loop.py"


def test_agent_loop_example(server):
    session = f"example-{uuid.uuid4().hex[:12]}"
    # The factor is pinned: the model's reconciled factor is shared by every test of the run.
    env = {k: v for k, v in os.environ.items() if k not in ("CE_TOKEN", "CE_GRPC_ADDR")}
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--grpc-addr", server.address, "--tenant", "example",
         "--session", session, "--estimator-factor", "1.0"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    check_agent_loop_output(out.stdout)


def test_agent_loop_example_reads_its_address_and_token_from_the_environment(server, db):
    """CE_GRPC_ADDR names the server, CE_TENANT_ID and CE_SESSION_ID the session (the README
    says the examples read them; this one read neither, and a token's tenant set there was
    refused TENANT_MISMATCH); a token comes from CE_TOKEN or stdin, never argv (a dev-mode
    server takes a bearer token it does not need, so a wrong one would not show: the
    example's own refusal of an empty stdin token is checked instead)."""
    session = f"env-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, CE_GRPC_ADDR=server.address, CE_TENANT_ID="example",
               CE_SESSION_ID=session)
    env.pop("CE_TOKEN", None)
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--estimator-factor", "1.0"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    check_agent_loop_output(out.stdout)
    assert db.val("SELECT count(*) FROM sessions WHERE tenant_id = 'example' "
                  "AND session_id = $1", session) == 1
    empty = subprocess.run([sys.executable, str(EXAMPLE), "--token-stdin"], input="\n",
                           capture_output=True, text=True, timeout=60, env=env)
    assert empty.returncode == 2 and "no token on standard input" in empty.stderr
    helped = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True,
                            text=True, timeout=60, env=env)
    assert "--token " not in helped.stdout and "--target" not in helped.stdout


# The top-level keys of each format's body (the first request: tools, a system prompt, the
# user's message), and of Gemini's cached-content create body.
BODY_KEYS = {
    "anthropic_messages": {"model", "max_tokens", "system", "messages", "tools"},
    "openai_responses": {"model", "instructions", "input", "prompt_cache_key", "tools"},
    "openai_chat_completions": {"model", "messages", "tools"},
    "gemini_generate_content": {"contents", "systemInstruction", "tools", "generationConfig"},
    "bedrock_converse": {"modelId", "system", "messages", "toolConfig", "inferenceConfig"},
}
GEMINI_CREATE_KEYS = {"model", "displayName", "ttl"}


def printed_json(text: str, header: str) -> tuple[str, dict[str, object]]:
    """The header line matching ``header`` (a regex) and the JSON object printed after it."""
    found = re.search(header + r"\n", text, re.M)
    assert found, text[-3000:]
    value, _ = json.JSONDecoder().raw_decode(text, found.end())
    assert isinstance(value, dict)
    return found.group(0).strip(), value


@pytest.mark.parametrize("name", list(BODY_KEYS))
def test_agent_loop_example_prints_the_body_of_each_format(server, name):
    env = {k: v for k, v in os.environ.items() if k not in ("CE_TOKEN", "CE_GRPC_ADDR")}
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--grpc-addr", server.address, "--tenant", "example",
         "--session", f"body-{uuid.uuid4().hex[:12]}", "--estimator-factor", "1.0",
         "--print-body", name], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    check_agent_loop_output(out.stdout)  # the rest of the output is what it always is
    assert len(re.findall(r"^== provider body ", out.stdout, re.M)) == 1  # the first request
    _, body = printed_json(out.stdout, rf"^== provider body {name} \(turn 1, step 1\):$")
    assert BODY_KEYS[name] <= set(body), sorted(body)
    assert "Draft release notes for 2.4" in json.dumps(body)  # the first user message
    creates = re.findall(r"^== gemini cached content ", out.stdout, re.M)
    if name != "gemini_generate_content":
        assert not creates
        return
    header, create = printed_json(
        out.stdout, r"^== gemini cached content (ce-[0-9a-f]{16}-e1) \(ttl \d+s, holds .+; "
                    r"\d+ tokens, minimum \d+\), create body:$")
    assert len(creates) == 1
    assert set(create) >= GEMINI_CREATE_KEYS and create["displayName"] in header


def test_agent_loop_example_refuses_an_unknown_format():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--print-body", "gemini"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'gemini'" in out.stderr, out.stderr


def test_agent_loop_example_sends_a_token_off_the_machine_only_as_asked():
    """A token to another machine without --tls or --plaintext: one usage line, exit 2,
    nothing sent. (10.255.255.1 is not contacted: the client refuses before any call.)"""
    env = {**os.environ, "CE_TOKEN": "t0ken"}
    out = subprocess.run([sys.executable, str(EXAMPLE), "--grpc-addr", "10.255.255.1:50051"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    assert "the token would travel in plaintext to 10.255.255.1:50051" in out.stderr
    assert "pass --tls for TLS, or --plaintext" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    both = subprocess.run([sys.executable, str(EXAMPLE), "--tls", "--plaintext"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr, both.stderr


def check_agent_loop_output(text: str) -> None:
    """What one run of the example must print (also run from an installed wheel)."""
    # the estimate against the input limit (window less output reserve), as the demo and the
    # TypeScript example say it: 16,000 less 2,000 for the example's model, not the window
    limits = set(re.findall(r"^   estimated \d+ of (\d+) tokens: ", text, re.M))
    assert limits == {"14000"}, limits
    plan = re.search(r"^plan: epoch 1 prefix_sha256 ([0-9a-f]{64}) (\d+) tokens", text, re.M)
    assert plan, text
    prefix = plan.group(1)

    builds = re.findall(r"^-- (turn \d+, step \d+(?:, after compaction)?): epoch (\d+) "
                        r"prefix_sha256 ([0-9a-f]{64})$", text, re.M)
    labels = [b[0] for b in builds]
    assert [lbl for lbl in labels if "after" not in lbl] == [
        f"turn {t}, step {s}" for t in range(1, 6) for s in (1, 2)]
    assert {(epoch, sha) for _, epoch, sha in builds} == {("1", prefix)}  # one prefix

    # every request prints its budget table, one row per class with cap and use
    tables = re.findall(r"^   class +cap +used +items +yielded$", text, re.M)
    assert len(tables) == len(builds)
    rows = dict(re.findall(r"^   (tool_results|history) +\d+ +(\d+) +\d+ +\d+$", text, re.M))
    assert set(rows) == {"tool_results", "history"}
    assert len(re.findall(r"^   current_user_message +- +\d+", text, re.M)) == len(builds)

    markers = re.findall(r"^   cache markers: (.*)$", text, re.M)
    assert len(markers) == len(builds)
    assert all(m.startswith("after_system(5m), after_tools(5m)") for m in markers)
    assert any(re.search(r"run\(5m through t\d+-r\d+\)", m) for m in markers)
    assert any(re.search(r"carried_history\(5m through t\d+-answer\)", m) for m in markers)

    # history had to be cut: Build said so, the loop compacted and built again
    assert re.search(r"pressure: .*history:\d+; compaction_needed=True", text)
    compacted = re.search(r"^== compacted: depth 1, replaced (\d+) items through sequence "
                          r"(\d+), (\d+) elided spans, tokens (\d+) -> (\d+)$", text, re.M)
    assert compacted, text
    assert int(compacted.group(1)) > 0 and int(compacted.group(3)) > 0
    assert int(compacted.group(5)) < int(compacted.group(4))
    after = text.split("after compaction", 1)[1].split("\n-- ", 1)[0]
    assert "compaction_needed=True" not in after

    # the model's control-tool call went to the engine raw and its answer back to the model
    assert re.search(r"^   working state: Working state updated: objective set; 1 constraint "
                     r"added\. The block is \d+ of 1,000 tokens\.$", text, re.M), text
    assert len(re.findall(r"^   usage reported: factor", text, re.M)) == 10
    assert re.search(rf"^rotated: epoch 1 -> 2 \(operator\), prefix_sha256 {prefix}$", text,
                     re.M)
