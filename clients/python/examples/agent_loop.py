"""A multi-turn, tool-using agent session driven through context-engine.

The model is a deterministic fake: each turn it calls tools, reads their results and answers.
Around it the loop does what an agent runtime does: it keeps the session's log (conversation
items with event sequences and run ids) and the checkpoint around it, opens the session with
``Plan``, calls ``Build`` before every model step and prints the request's budget table, cache
markers and ``prefix_sha256``, reports the provider's usage, compacts when ``Build`` says
history had to be cut, and rotates the epoch at the end. The model's calls of the engine's own
``context.update_working_state`` tool go to ``UpdateWorkingState`` exactly as the provider
returned them, and what the engine answers goes back to the model as that call's result.

    CE_GRPC_ADDR=127.0.0.1:50051 .venv/bin/python clients/python/examples/agent_loop.py

The server's address comes from ``--grpc-addr`` or ``CE_GRPC_ADDR``; a bearer token (none in
dev mode) from ``CE_TOKEN`` or, with ``--token-stdin``, from one line of standard input. Tokens
never go on the command line, where other users of the machine can read them. ``--tls``
connects over TLS with the system roots; without it a token is sent only to this machine,
unless ``--plaintext`` says otherwise.

``--print-body FORMAT`` (anthropic_messages, openai_responses, openai_chat_completions,
gemini_generate_content, bedrock_converse) asks every ``Build`` for that provider's body and
prints the first one as JSON (for Gemini also the body that creates the cached content):

    .venv/bin/python clients/python/examples/agent_loop.py --print-body bedrock_converse
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from context_engine_client import (
    FORMAT_NAMES,
    Client,
    ContextEngineError,
    FailedPrecondition,
    InvalidArgument,
    ProviderBodyError,
    anthropic_messages_body,
    bedrock_converse_body,
    chat_completions_body,
    gemini_body,
    gemini_cached_content,
    openai_responses_body,
    pb,
)

# A session capped at 16k tokens so a few turns of tool output show the budget at work.
MODEL = pb.ModelSpec(model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=2_000))
DATE = "2026-11-29"
# The working-state control tool every plan defines, and the name a provider returns for it
# (providers take no "." in tool names).
WORKING_STATE_TOOL = "context.update_working_state"
WORKING_STATE_TOOL_NAMES = (WORKING_STATE_TOOL, "context__update_working_state")


def schema(properties: dict[str, str], required: Sequence[str]) -> str:
    return json.dumps({"type": "object", "required": list(required),
                       "properties": {k: {"type": t} for k, t in properties.items()}})


TOOLS = [
    pb.ToolSpec(name="web.fetch", description="Fetch a web page. Returns its text.",
                input_schema_json=schema({"url": "string"}, ["url"]),
                side_effect=pb.SIDE_EFFECT_NETWORK_READ),
    pb.ToolSpec(name="files.read", description="Read a file of the workspace.",
                input_schema_json=schema({"path": "string"}, ["path"]),
                side_effect=pb.SIDE_EFFECT_WORKSPACE_READ),
]


def plan_request(tenant: str, session: str) -> pb.PlanRequest:
    return pb.PlanRequest(
        tenant_id=tenant, session_id=session,
        agent=pb.AgentSpec(agent_id="release-notes", version="1",
                           instructions="You write release notes from the changelog and the "
                                        "project's pages. Cite the files and pages you used.",
                           enabled_tools=["web.fetch", "files.read"]),
        tool_catalog=TOOLS, model=MODEL,
        session=pb.SessionSpec(kind=pb.SESSION_KIND_INTERACTIVE))


# ------------------------------------------------------------------------------ the fake model

@dataclass(frozen=True)
class Turn:
    user: str
    calls: tuple[tuple[str, dict[str, Any]], ...]
    answer: str


TURNS = (
    Turn("Draft release notes for 2.4 from CHANGELOG.md.",
         (("files.read", {"path": "CHANGELOG.md"}),
          # the model records its working state through the engine's control tool, in the
          # provider's name form
          ("context__update_working_state", {"objective": "Release notes for 2.4",
                                             "add_constraints": ["Cite every file and page "
                                                                 "used."]})),
         "Draft: 2.4 adds streaming exports and fixes the retry storm in the sync worker."),
    Turn("Check the docs site for what the exporter page says.",
         (("web.fetch", {"url": "https://docs.example.com/exporter"}),
          ("web.fetch", {"url": "https://docs.example.com/changelog"})),
         "The exporter page documents the new --stream flag; the changelog page lags by one "
         "release."),
    Turn("Read the full build log of the release candidate and list the warnings.",
         (("files.read", {"path": "build/rc1.log"}),),
         "Three deprecation warnings, all in the plugin loader."),
    Turn("Compare with the previous release's notes.",
         (("web.fetch", {"url": "https://docs.example.com/releases/2.3"}),),
         "2.3 was a maintenance release; 2.4 is the first with user-visible features since 2.1."),
    Turn("Finalize the notes.",
         (("files.read", {"path": "docs/upgrade.md"}),),
         "Final notes ready: features, fixes, three deprecations, upgrade steps."),
)


def draft(turn: int, words: int = 2_200) -> str:
    """The model's working draft of the notes, appended to its answer: long, so the carried
    history grows turn by turn."""
    vocabulary = ("the", "release", "adds", "streaming", "exports", "fixes", "retry", "storms",
                  "in", "the", "sync", "worker", "deprecates", "the", "legacy", "plugin",
                  "loader", "and", "documents", "upgrade", "steps")
    lines = []
    for i in range(0, words, 20):
        lines.append("- " + " ".join(vocabulary[(i + j + turn) % len(vocabulary)]
                                     for j in range(20)))
    return "\n".join(lines)


def tool_output(name: str, args: dict[str, Any],
                turn: int) -> tuple[str, pb.TrustLevel.ValueType]:
    """A fake tool: deterministic text, web pages untrusted. Turn 3's build log is oversized."""
    words = ("export", "stream", "retry", "worker", "sync", "plugin", "loader", "flag", "config",
             "release", "change", "fix", "deprecate", "warning", "upgrade", "step", "user",
             "feature", "docs", "page")
    size = 60_000 if args.get("path") == "build/rc1.log" else 9_000
    text = " ".join(words[(i * 7 + turn) % len(words)] for i in range(size // 6))[:size]
    if name == "web.fetch":
        return f"{args['url']}\n{text}", pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    return f"{args['path']}\n{text}", pb.TRUST_LEVEL_USER


# ------------------------------------------------------------------------------ the runtime

@dataclass
class Session:
    tenant: str
    session: str
    items: list[pb.ConversationItem] = field(default_factory=list)
    sequence: int = 0
    summary: pb.Summary | None = None
    working_state: pb.WorkingState = field(default_factory=pb.WorkingState)
    requests: int = 0
    estimator_factor: float | None = None
    # --print-body: the provider format every Build asks for, and whether its first body has
    # been printed
    print_body: str | None = None
    body_printed: bool = False

    def append(self, run_id: str, item_id: str, trust: pb.TrustLevel.ValueType,
               **kind: Any) -> None:
        self.sequence += 1
        self.items.append(pb.ConversationItem(id=item_id, sequence=self.sequence, run_id=run_id,
                                              trust=trust, **kind))

    def checkpoint(self, run_id: str) -> pb.Checkpoint:
        cp = pb.Checkpoint(active_run_id=run_id, items=self.items,
                           working_state=self.working_state,
                           runtime=pb.RuntimeMetadata(current_date=DATE))
        if self.summary is not None:
            cp.summary.CopyFrom(self.summary)
        return cp


def print_build(label: str, resp: pb.BuildResponse) -> None:
    b = resp.budget
    print(f"-- {label}: epoch {resp.epoch} prefix_sha256 {resp.prefix_sha256}")
    # the input limit: the window less the output reserve, as every example says it
    print(f"   estimated {resp.estimated_input_tokens} of "
          f"{resp.context_window - resp.output_reserve} tokens: prefix "
          f"{b.prefix_tokens}, body {b.body_tokens} of {b.body_budget}, factor "
          f"{resp.estimator_factor:.3f}")
    print(f"   {'class':<24}{'cap':>8}{'used':>8}{'items':>7}{'yielded':>9}")
    for c in b.classes:
        cap = str(c.cap) if c.cap else "-"
        print(f"   {c.class_name:<24}{cap:>8}{c.used:>8}{c.items:>7}{c.yielded:>9}")
    markers = ", ".join(f"{m.name}({m.ttl}" + (f" through {m.through_item}" if m.through_item
                                               else "") + ")"
                        for m in resp.cache_breakpoints)
    print(f"   cache markers: {markers}")
    p = resp.pressure
    if p.steps:
        steps = ", ".join(f"{s.step}:{s.units}" for s in p.steps)
        print(f"   pressure: {steps}; compaction_needed={p.compaction_needed} "
              f"left_out_items={p.left_out_items} left_out_tokens={p.left_out_tokens}")


# Each format's typed accessor: the body parsed, its format checked.
BODIES: Mapping[str, Callable[[pb.BuildResponse], Mapping[str, Any]]] = {
    "anthropic_messages": anthropic_messages_body,
    "openai_responses": openai_responses_body,
    "openai_chat_completions": chat_completions_body,
    "gemini_generate_content": gemini_body,
    "bedrock_converse": bedrock_converse_body,
}


def print_body(label: str, name: str, resp: pb.BuildResponse) -> None:
    """The provider body of a request as JSON; for Gemini, also the body that creates the
    cached content of the pinned prefix (explicit caching)."""
    print(f"== provider body {name} ({label}):")
    print(json.dumps(BODIES[name](resp), indent=2, ensure_ascii=False))
    if name == "gemini_generate_content":
        cached = gemini_cached_content(resp)
        print(f"== gemini cached content {cached.display_name} (ttl {cached.ttl}, holds "
              f"{', '.join(cached.holds)}; {cached.estimated_tokens} tokens, minimum "
              f"{cached.min_cacheable_tokens}), create body:")
        print(json.dumps(cached.create_body, indent=2, ensure_ascii=False))


def build(engine: Client, s: Session, run_id: str, label: str) -> pb.BuildResponse:
    def request() -> pb.BuildRequest:
        req = pb.BuildRequest(tenant_id=s.tenant, session_id=s.session,
                              checkpoint=s.checkpoint(run_id))
        if s.estimator_factor is not None:
            req.estimator_factor = s.estimator_factor
        if s.print_body is not None:
            req.provider_format = FORMAT_NAMES[s.print_body]
        return req

    resp = engine.build(request=request())
    print_build(label, resp)
    if s.print_body is not None and not s.body_printed:
        print_body(label, s.print_body, resp)
        s.body_printed = True
    if resp.pressure.compaction_needed and compact(engine, s, run_id):
        resp = engine.build(request=request())
        print_build(f"{label}, after compaction", resp)
    # The provider's usage of the sent request (a fake provider counting 2% below the
    # conservative estimate, the prefix read from its cache after the first request).
    s.requests += 1
    usage = engine.report_usage(request=pb.ReportUsageRequest(
        tenant_id=s.tenant, session_id=s.session, epoch=resp.epoch,
        estimated_input_tokens=resp.estimated_input_tokens,
        estimator_factor=resp.estimator_factor,
        estimated_attachment_tokens=resp.estimated_attachment_tokens,
        input_tokens=resp.estimated_input_tokens * 98 // 100,
        cached_tokens=resp.prefix_tokens if s.requests > 1 else 0, output_tokens=120,
        idempotency_key=f"{s.session}/usage-{s.requests}"))
    print(f"   usage reported: factor {usage.previous_factor:.3f} -> "
          f"{usage.correction_factor:.3f}")
    return resp


def compact(engine: Client, s: Session, run_id: str) -> bool:
    """Compacts every earlier run (the active run is never compacted). False when the summary
    is already at the depth cap: the runtime would hand off to a child run; here the session
    goes on with the cut history."""
    carried = [i.sequence for i in s.items if i.run_id != run_id]
    try:
        result = engine.compact(request=pb.CompactRequest(
            tenant_id=s.tenant, session_id=s.session, checkpoint=s.checkpoint(run_id),
            replace_through_sequence=max(carried), reason="budget_pressure",
            idempotency_key=f"{s.session}/compact-{s.sequence}"))
    except FailedPrecondition as err:
        if err.reason not in ("COMPACTION_DEPTH_EXCEEDED", "NOTHING_TO_COMPACT"):
            raise
        print(f"== not compacted: {err.reason} {dict(err.metadata)}")
        return False
    s.summary = result.summary
    print(f"== compacted: depth {result.summary.depth}, replaced "
          f"{len(result.replaced_item_ids)} items through sequence "
          f"{result.summary.replaced_through_sequence}, {len(result.summary.elided)} elided "
          f"spans, tokens {result.tokens_before} -> {result.tokens_after}")
    return True


def update_working_state(engine: Client, s: Session, run_id: str, sequence: int,
                         call: pb.ToolCall) -> str:
    """The model's control-tool call, sent as the provider returned it; the answer is the
    call's result for the model: a confirmation, or (refused) what was wrong and the tool's
    input schema, so the model can call again."""
    try:
        updated = engine.update_working_state(request=pb.UpdateWorkingStateRequest(
            tenant_id=s.tenant, session_id=s.session, run_id=run_id,
            current=s.working_state, sequence=sequence,
            transition=pb.WorkingStateTransition(tool_call=pb.WorkingStateToolCall(
                call_id=call.call_id, name=call.name, arguments_json=call.arguments_json))))
    except InvalidArgument as err:
        if not err.tool_result:  # the runtime's own mistake, not the model's
            raise
        print(f"   working state refused: {len(err.field_violations)} violations")
        return err.tool_result
    s.working_state = updated.state
    print(f"   working state: {updated.tool_result}")
    return updated.tool_result


def run(engine: Client, tenant: str, session: str, estimator_factor: float | None,
        body_format: str | None = None) -> None:
    plan = engine.plan(request=plan_request(tenant, session)).plan
    print(f"plan: epoch {plan.epoch} prefix_sha256 {plan.prefix_sha256} "
          f"{plan.prefix_tokens} tokens, tools {', '.join(plan.tool_names)}")
    s = Session(tenant=tenant, session=session, estimator_factor=estimator_factor,
                print_body=body_format)
    for n, turn in enumerate(TURNS, start=1):
        run_id = f"run-{n}"
        s.append(run_id, f"t{n}-user", pb.TRUST_LEVEL_USER, user=pb.UserMessage(text=turn.user))
        build(engine, s, run_id, f"turn {n}, step 1")
        # the calls as the provider returned them; the log keeps the tools' own names
        returned = [pb.ToolCall(call_id=f"call-{n}-{k}", name=name,
                                arguments_json=json.dumps(args, sort_keys=True))
                    for k, (name, args) in enumerate(turn.calls)]
        calls = [pb.ToolCall(call_id=c.call_id, arguments_json=c.arguments_json,
                             name=(WORKING_STATE_TOOL if c.name in WORKING_STATE_TOOL_NAMES
                                   else c.name)) for c in returned]
        s.append(run_id, f"t{n}-calls", pb.TRUST_LEVEL_USER, tool_calls=pb.ToolCalls(calls=calls))
        called_at = s.sequence
        for k, (call, (name, args)) in enumerate(zip(returned, turn.calls, strict=True)):
            content, trust = (
                (update_working_state(engine, s, run_id, called_at, call), pb.TRUST_LEVEL_USER)
                if call.name in WORKING_STATE_TOOL_NAMES else tool_output(name, args, n))
            s.append(run_id, f"t{n}-r{k}", trust, tool_result=pb.ToolResult(
                call_id=call.call_id, tool_name=calls[k].name, content=content,
                event_id=s.sequence + 1))
        build(engine, s, run_id, f"turn {n}, step 2")
        s.append(run_id, f"t{n}-answer", pb.TRUST_LEVEL_USER,
                 assistant=pb.AssistantMessage(text=f"{turn.answer}\n\nDraft:\n{draft(n)}"))
    rotated = engine.rotate(request=pb.RotateRequest(
        tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_OPERATOR,
        idempotency_key=f"{session}/rotate-end"))
    print(f"rotated: epoch {plan.epoch} -> {rotated.plan.epoch} ({rotated.plan.reason}), "
          f"prefix_sha256 {rotated.plan.prefix_sha256}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--grpc-addr", default=os.environ.get("CE_GRPC_ADDR")
                        or "127.0.0.1:50051",
                        help="the server's host:port (env CE_GRPC_ADDR; default %(default)s)")
    parser.add_argument("--token-stdin", action="store_true",
                        help="read the bearer token from one line of standard input (default: "
                             "env CE_TOKEN; none in dev mode)")
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument("--tls", dest="tls", action="store_const", const=True, default=None,
                           help="TLS with the system roots")
    transport.add_argument("--plaintext", dest="tls", action="store_const", const=False,
                           help="plaintext even with a token to another machine (default: "
                                "plaintext, a token only to this machine)")
    parser.add_argument("--tenant", default=None,
                        help="default: CE_TENANT_ID, else a new tenant (its reports teach the "
                             "estimator factor of a tenant and model: a fixed one would be "
                             "taught by every run); with a token, the token's tenant")
    parser.add_argument("--session", default=None,
                        help="default: CE_SESSION_ID, else a new session")
    parser.add_argument("--estimator-factor", type=float, default=None,
                        help="pin the estimator factor (default: the model's reconciled one)")
    parser.add_argument("--print-body", metavar="FORMAT", choices=list(BODIES), default=None,
                        help="ask Build for this provider format and print the first request's "
                             f"body ({', '.join(BODIES)}; default: none)")
    args = parser.parse_args(argv)
    token = os.environ.get("CE_TOKEN") or None
    if args.token_stdin:
        token = sys.stdin.readline().strip()
        if not token:
            parser.error("no token on standard input")
    session = (args.session or os.environ.get("CE_SESSION_ID")
               or f"agent-loop-{uuid.uuid4().hex[:12]}")
    tenant = args.tenant or os.environ.get("CE_TENANT_ID") or f"demo-{uuid.uuid4().hex[:12]}"
    try:
        engine = Client(target=args.grpc_addr, token=token, tls=args.tls, timeout=30)
    except ValueError as err:  # e.g. a token to another machine without --tls or --plaintext
        parser.error(str(err).replace("tls=True (or a certificate)", "--tls")
                     .replace("tls=False", "--plaintext"))
    try:
        with engine:
            run(engine, tenant, session, args.estimator_factor, args.print_body)
    except ContextEngineError as err:
        print(f"error: {err} {dict(err.metadata)}", file=sys.stderr)
        return 1
    except ProviderBodyError as err:  # Build rendered another format than the one asked
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
