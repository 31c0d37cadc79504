"""``context-engine demo``: a five-minute tour of a running server.

    context-engine demo [--grpc-addr 127.0.0.1:50051] [--session tour] [--tenant tour]
                        [--token-stdin]

Plans a session, builds a small request, builds an oversized one (pressure), compacts, builds on
the summary and rotates, printing what each call returned. Start a server first (``make run``:
dev mode, no credentials); against a server that wants credentials give the bearer token in
``CE_TOKEN`` or on standard input with ``--token-stdin`` (never on the command line, which
process lists and shell history show; sent as ``authorization: Bearer <token>``) and pass
``--tenant``, the token's tenant. The tour speaks plaintext gRPC, so a token goes only to this
machine (a loopback address or ``localhost``), straight, through no proxy of the environment.

The output is deterministic: the tour pins every input (tenant ``tour``, the session id, a Claude
model sized to 16,000 tokens, the date, the estimator factor), so a new session always prints the
same text. Hashes are printed as labels (``<prefix #1>`` is the first distinct ``prefix_sha256``
seen, ``<prefix #2>`` the second) and envelope nonces as ``…``; timestamps and ids are not
printed. Another ``--session`` changes the nonces, and with them a few token counts.

Exit status 0 after the whole tour; 1 when the server cannot be reached, the session exists
already or a call fails (the error on stderr, after the output of the steps that completed); 2 on
a usage error (a bad address, an empty token on standard input, a token for another machine).
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO, TypeVar

import grpc

from context_engine.config import Config, ConfigError
from context_engine.domain.identifiers import identifier_problem
from context_engine.healthcheck import probe_address
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

Resp = TypeVar("Resp")

TENANT = "tour"  # the default; --tenant names another
TOKEN_ENV = "CE_TOKEN"  # the bearer token, unless --token-stdin
DATE = "2026-11-29"
FACTOR = 1.0
MODEL = pb.ModelSpec(model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=2_000))
WORDS = ("cache", "prefix", "budget", "token", "window", "epoch", "summary", "envelope",
         "history", "result", "request", "model", "session", "pointer", "estimate", "yield")
FETCH_SCHEMA = ('{"type":"object","properties":{"url":{"type":"string"}},'
                '"required":["url"]}')
NONCE = re.compile(r'(nonce="|</(?:untrusted|user|memory):)[0-9a-f]{16}')


class Labels:
    """Stable names for values that differ between sessions (hashes)."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def __call__(self, digest: str) -> str:
        if digest not in self.seen:
            self.seen[digest] = f"<prefix #{len(self.seen) + 1}>"
        return self.seen[digest]


def text(n: int, seed: int) -> str:
    """``n`` filler words, the same for the same seed (a small linear congruential walk)."""
    state, words = seed + 1, []
    for _ in range(n):
        state = (state * 1103515245 + 12345) % 2**31
        words.append(WORDS[(state >> 16) % len(WORDS)])
    return " ".join(words)


def plan_request(tenant: str, session: str) -> pb.PlanRequest:
    return pb.PlanRequest(
        tenant_id=tenant, session_id=session,
        agent=pb.AgentSpec(agent_id="researcher", version="3",
                           instructions="You research questions and cite your sources.",
                           enabled_tools=["web.fetch", "clock.now"], deferred_tools=["mail.send"],
                           enables_tool_call=True),
        tool_catalog=[
            pb.ToolSpec(name="web.fetch", description="Fetch a web page. Returns its text.",
                        input_schema_json=FETCH_SCHEMA, side_effect=pb.SIDE_EFFECT_NETWORK_READ,
                        required_scopes=["web"]),
            pb.ToolSpec(name="clock.now", description="The current time.",
                        input_schema_json='{"type":"object","properties":{}}',
                        side_effect=pb.SIDE_EFFECT_NONE),
            pb.ToolSpec(name="mail.send", description="Send an email. Needs a recipient.",
                        input_schema_json='{"type":"object","properties":{"to":{"type":'
                                          '"string"},"body":{"type":"string"}},'
                                          '"required":["to","body"]}',
                        side_effect=pb.SIDE_EFFECT_NETWORK_WRITE, server="mcp.mail",
                        required_scopes=["mail"]),
        ],
        principal_scopes=["web", "mail"], model=MODEL,
        session=pb.SessionSpec(kind=pb.SESSION_KIND_INTERACTIVE))


def item(item_id: str, seq: int, run: str, trust: pb.TrustLevel.ValueType = pb.TRUST_LEVEL_USER,
         *, user: pb.UserMessage | None = None, assistant: pb.AssistantMessage | None = None,
         tool_calls: pb.ToolCalls | None = None,
         tool_result: pb.ToolResult | None = None) -> pb.ConversationItem:
    return pb.ConversationItem(id=item_id, sequence=seq, run_id=run, trust=trust, user=user,
                               assistant=assistant, tool_calls=tool_calls,
                               tool_result=tool_result)


def fetch(i: int, seq: int, run: str, words: int, answer: int = 20) -> list[pb.ConversationItem]:
    """A user question, a web.fetch call, its untrusted result and the assistant's answer."""
    return [
        item(f"u{i}", seq, run, user=pb.UserMessage(text=f"What does page {i} say?")),
        item(f"c{i}", seq + 1, run, tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
            call_id=f"call-{i}", name="web.fetch",
            arguments_json=f'{{"url":"https://example.com/{i}"}}')])),
        item(f"r{i}", seq + 2, run, pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
             tool_result=pb.ToolResult(call_id=f"call-{i}", tool_name="web.fetch",
                                       content=f"Page {i}. " + text(words, i),
                                       artifact_ref=f"artifact:pages/{i}", event_id=seq + 2)),
        item(f"a{i}", seq + 3, run,
             assistant=pb.AssistantMessage(text=f"Page {i} is about {text(answer, i + 1)}.")),
    ]


def checkpoint(items: Sequence[pb.ConversationItem], run: str, *,
               knowledge: Sequence[pb.KnowledgePassage] = (),
               summary: pb.Summary | None = None) -> pb.Checkpoint:
    cp = pb.Checkpoint(
        active_run_id=run, items=items, knowledge=knowledge,
        working_state=pb.WorkingState(objective="Compare the pages.",
                                      constraints=["Cite every page you use."]),
        runtime=pb.RuntimeMetadata(current_date=DATE))
    if summary is not None:
        cp.summary.CopyFrom(summary)
    return cp


def clip(line: str, width: int = 92) -> str:
    return line if len(line) <= width else line[:width - 1] + "…"


def short(message: pb.Message, width: int = 58) -> str:
    first = NONCE.sub(r"\1…", message.text.split("\n", 1)[0])
    if message.tool_calls:
        first = "calls " + ", ".join(c.name for c in message.tool_calls)
    return first if len(first) <= width else first[:width - 1] + "…"


def show_messages(out: list[str], messages: Sequence[pb.Message]) -> None:
    out.append("  row  role       item   text")
    for m in messages:
        role = pb.Role.Name(m.role).removeprefix("ROLE_").lower()
        out.append(f"  {m.row:>3}  {role:<9}  {m.item_id or '-':<5}  {short(m)}")


STEP_WORDS = {"knowledge": ("passage", "dropped"), "recall": ("recall line", "trimmed"),
              "tool_results": ("result", "replaced by a typed pointer"),
              "history": ("item", "left out")}


def ids(values: Sequence[str]) -> str:
    return ", ".join(values) if len(values) <= 3 else f"{values[0]} ... {values[-1]}"


def show_pressure(out: list[str], built: pb.BuildResponse) -> None:
    p = built.pressure
    if not p.steps:
        out.append(f"pressure: none; body {built.body_tokens:,} of "
                   f"{built.budget.body_budget:,} tokens")
        return
    out.append(f"pressure: body {p.tokens_before:,} -> {p.tokens_after:,} tokens of "
               f"{built.budget.body_budget:,}; fits={p.fits}, "
               f"compaction_needed={p.compaction_needed}")
    for s in p.steps:
        noun, verb = STEP_WORDS[s.step]
        noun += "" if s.units == 1 else "s"
        out.append(f"  {s.step:<13} {s.units:>3} {noun} {verb}: {ids(s.item_ids)}")
    if p.compaction_needed:
        out.append(f"  left out: {p.left_out_items} items, {p.left_out_tokens:,} tokens; "
                   f"history now starts at item {p.history_cut_index}")


def show_budget(out: list[str], built: pb.BuildResponse) -> None:
    b = built.budget
    out.append(f"budget: {b.total_tokens:,} total - {b.output_reserve:,} output reserve - "
               f"{b.margin_tokens:,} margin - {b.prefix_tokens:,} prefix = "
               f"{b.body_budget:,} body")
    out.append("  class                    cap    used  items  yielded")
    for c in b.classes:
        cap = f"{c.cap:,}" if c.cap else "-"
        out.append(f"  {c.class_name:<20} {cap:>7} {c.used:>7,} {c.items:>6} {c.yielded:>8}")


class CallFailed(Exception):
    """An RPC of the tour returned an error status."""

    def __init__(self, rpc: str, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{rpc} failed: {code.name if code else 'error'}: {details}")
        self.rpc, self.code, self.details = rpc, code, details


class Engine:
    """The stub with the tour's deadline and credentials on every call."""

    def __init__(self, channel: grpc.Channel, *, token: str | None = None,
                 timeout: float = 30.0) -> None:
        self._stub = pb_grpc.ContextEngineStub(channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def _call(self, rpc: str, method: Callable[..., Resp], request: object,
              timeout: float | None = None) -> Resp:
        try:
            return method(request, metadata=self._metadata, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
            raise CallFailed(rpc, code, details) from exc

    def get_plan(self, request: pb.GetPlanRequest, timeout: float) -> pb.GetPlanResponse:
        return self._call("GetPlan", self._stub.GetPlan, request, timeout)

    def plan(self, request: pb.PlanRequest) -> pb.PlanResponse:
        return self._call("Plan", self._stub.Plan, request)

    def build(self, request: pb.BuildRequest) -> pb.BuildResponse:
        return self._call("Build", self._stub.Build, request)

    def compact(self, request: pb.CompactRequest) -> pb.CompactResponse:
        return self._call("Compact", self._stub.Compact, request)

    def rotate(self, request: pb.RotateRequest) -> pb.RotateResponse:
        return self._call("Rotate", self._stub.Rotate, request)


def tour(engine: Engine, tenant: str, session: str, out: list[str]) -> None:
    """Run the six steps for a new session, appending what they print to ``out`` (so a failed
    call leaves the output of the steps before it)."""
    label = Labels()

    def build(cp: pb.Checkpoint) -> pb.BuildResponse:
        return engine.build(pb.BuildRequest(
            tenant_id=tenant, session_id=session, checkpoint=cp, estimator_factor=FACTOR))

    # 1. Plan: Region A is rendered, measured exactly and pinned as epoch 1.
    planned = engine.plan(plan_request(tenant, session))
    plan = planned.plan
    out.append("== 1. Plan: pin the prefix (Region A) as epoch 1")
    out.append(f"created={planned.created} epoch={plan.epoch} reason={plan.reason} "
               f"prefix_sha256={label(plan.prefix_sha256)} prefix_tokens={plan.prefix_tokens}")
    out.append(f"model {plan.model_id}: window {plan.context_window:,}, output reserve "
               f"{plan.output_reserve:,}, tokenizer {plan.tokenizer}, TTL {plan.cache_ttl}")
    out.append(f"tools: {', '.join(plan.tool_names)}; deferred: "
               f"{', '.join(plan.deferred_tool_names)}")
    out.append("  class                tokens    cap")
    for c in plan.prefix_classes:
        out.append(f"  {c.class_name:<19} {c.tokens:>7,} {c.cap:>6,}")
    again = engine.plan(plan_request(tenant, session))
    out.append(f"Plan again, same inputs: created={again.created} epoch={again.plan.epoch} "
               f"prefix_sha256={label(again.plan.prefix_sha256)}")

    # 2. Build: Region A byte for byte, then the turn body, every piece in its envelope.
    first = fetch(1, 1, "run-1", 60)[:3]
    built = build(checkpoint(first, "run-1"))
    out.append("")
    out.append("== 2. Build: one model request from the runtime's checkpoint")
    out.append(f"prefix_sha256={label(built.prefix_sha256)} epoch={built.epoch} "
               f"estimated_input_tokens={built.estimated_input_tokens:,} of "
               f"{built.context_window - built.output_reserve:,}")
    out.append("prefix blocks (rows 1-8): " + ", ".join(
        f"{b.row}" for b in built.request.prefix_blocks) + f"; {len(built.request.tools)} "
        "tool definitions (row 5)")
    show_messages(out, built.request.messages)
    out.append("cache breakpoints: " + ", ".join(
        f"{c.name} {c.ttl}" + (f" through {c.through_item}" if c.through_item else "")
        for c in built.cache_breakpoints))
    same = build(checkpoint(first, "run-1"))
    out.append(f"Build again: identical request={same.request == built.request}")
    show_pressure(out, built)

    # 3. Pressure: forty earlier fetches and three knowledge passages do not fit 16,000 tokens.
    carried: list[pb.ConversationItem] = []
    for i in range(40):
        carried.extend(fetch(i + 10, 4 * i + 1, f"run-{i // 10 + 2}", 300, 120))
    now = [item("u99", 1000, "run-9", user=pb.UserMessage(text="Which pages agree?"))]
    passages = [pb.KnowledgePassage(id=f"doc-{k}", source="handbook", text=text(900, k), rank=k,
                                    trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for k in range(3)]
    big = checkpoint(carried + now, "run-9", knowledge=passages)
    pressed = build(big)
    out.append("")
    out.append(f"== 3. Pressure: {len(carried)} carried items and 3 knowledge passages")
    out.append(f"prefix_sha256={label(pressed.prefix_sha256)} "
               f"estimated_input_tokens={pressed.estimated_input_tokens:,} of "
               f"{pressed.context_window - pressed.output_reserve:,}")
    show_pressure(out, pressed)
    show_budget(out, pressed)
    pointers = [m for m in pressed.request.messages if "[elided] tool.result" in m.text]
    if pointers:
        out.append(f"{len(pointers)} old results are pointers now, each in its envelope, e.g.:")
        out.extend("  " + clip(NONCE.sub(r"\1…", line))
                   for line in pointers[0].text.splitlines())

    # 4. Compact: a write. The runtime asks for more than Build left out (here: the three
    # oldest runs), so the next steps fit too. Untrusted results become pointers; constraints
    # are kept verbatim.
    through = max(i.sequence for i in carried if i.run_id in ("run-2", "run-3", "run-4"))
    compacted = engine.compact(pb.CompactRequest(
        tenant_id=tenant, session_id=session, checkpoint=big,
        replace_through_sequence=through, reason="budget_pressure",
        idempotency_key=f"{session}-compact-1", estimator_factor=FACTOR))
    s = compacted.summary
    out.append("")
    out.append("== 4. Compact: replace the oldest carried history with a summary")
    out.append(f"compacted={compacted.compacted} depth={s.depth} summarizer="
               f"{compacted.summarizer_version} replaced {len(compacted.replaced_item_ids)} "
               f"items through sequence {s.replaced_through_sequence}")
    out.append(f"tokens {compacted.tokens_before:,} -> {compacted.tokens_after:,}; "
               f"{len(s.elided)} untrusted results elided as pointers")
    out.append(f"constraints kept verbatim: {list(s.constraints)}")
    out.append(f"narrative: {len(s.text):,} characters written from trusted text only, "
               f"label {pb.TrustLevel.Name(s.trust).removeprefix('TRUST_LEVEL_').lower()}")

    # 5. Build on the summary: the runtime wrote it into its checkpoint; the prefix is unchanged.
    on_summary = build(checkpoint(carried + now, "run-9", knowledge=passages, summary=s))
    out.append("")
    out.append("== 5. Build on the summary")
    out.append(f"prefix_sha256={label(on_summary.prefix_sha256)} "
               f"estimated_input_tokens={on_summary.estimated_input_tokens:,}")
    show_pressure(out, on_summary)
    rows = [m.row for m in on_summary.request.messages]
    out.append(f"messages: {len(rows)}; row 9 (summary): {rows.count(9)}, "
               f"row 10 (history): {rows.count(10)}, rows 11-15: "
               f"{sum(1 for r in rows if r > 10)}")
    out.append("row 9 as the model reads it (the narrative and the constraints are data, each "
               "in an envelope):")
    (row9,) = [m for m in on_summary.request.messages if m.row == 9]
    lines = [NONCE.sub(r"\1…", line) for line in row9.text.splitlines()]
    close = next(i for i, line in enumerate(lines) if line.startswith("</user:"))
    out.extend("  " + clip(line) for line in [*lines[:3], "...", *lines[close:close + 7],
                                              "..."])

    # 6. Rotate: an explicit new epoch, here to take mail.send out of the prompt at once.
    rotated = engine.rotate(pb.RotateRequest(
        tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_SECURITY_REVOCATION,
        drop_tools=["mail.send"], idempotency_key=f"{session}-rotate-1"))
    retried = engine.rotate(pb.RotateRequest(
        tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_SECURITY_REVOCATION,
        drop_tools=["mail.send"], idempotency_key=f"{session}-rotate-1"))
    new = rotated.plan
    out.append("")
    out.append("== 6. Rotate: drop mail.send from the prompt (security_revocation)")
    out.append(f"rotated={rotated.rotated} epoch={new.epoch} reason={new.reason} "
               f"prefix_sha256={label(new.prefix_sha256)} prefix_tokens={new.prefix_tokens}")
    out.append(f"tools: {', '.join(new.tool_names)}; deferred: "
               f"{', '.join(new.deferred_tool_names) or '(none)'}")
    out.append(f"same key again: rotated={retried.rotated} epoch={retried.plan.epoch}")
    after = build(checkpoint(first, "run-1"))
    out.append(f"Build now uses epoch {after.epoch}, prefix_sha256={label(after.prefix_sha256)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grpc-addr", help="the server's gRPC address, host:port (default: "
                                            "CE_GRPC_ADDR, else 127.0.0.1:50051)")
    parser.add_argument("--session", default=None,
                        help="a session id the tenant has not used yet (default: "
                             "CE_SESSION_ID, else 'tour')")
    parser.add_argument("--tenant", "--tenant-id", default=None,
                        help="tenant id (default: CE_TENANT_ID, else 'tour'; with a token, "
                             "the token's tenant)")
    parser.add_argument("--token-stdin", action="store_true",
                        help="read the bearer token from the first line of standard input "
                             f"(else {TOKEN_ENV}); sent as 'authorization: Bearer <token>' "
                             "metadata, for a server that requires credentials")


_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_HINTS = {grpc.StatusCode.UNAUTHENTICATED: f"the server requires credentials: set {TOKEN_ENV} "
                                           "or pass --token-stdin",
          grpc.StatusCode.PERMISSION_DENIED: "pass --tenant with the token's tenant (a "
                                             "TENANT_MISMATCH), or use a token that may call "
                                             "this RPC (an RPC_NOT_ALLOWED)"}


def session_exists(engine: Engine, tenant: str, session: str) -> bool:
    """Whether ``session`` has a plan already; the tour's output holds only for a new one."""
    try:
        engine.get_plan(pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=10)
    except CallFailed as exc:
        if exc.code is grpc.StatusCode.NOT_FOUND:
            return False
        raise
    return True


def bearer_token(args: argparse.Namespace, environ: Mapping[str, str],
                 stdin: TextIO | None = None) -> str | None:
    """The token to send: the first line of standard input with ``--token-stdin`` (stripped;
    ``ConfigError`` when empty), else ``CE_TOKEN``, else none."""
    if args.token_stdin:
        token = (stdin or sys.stdin).readline().strip()
        if not token:
            raise ConfigError("--token-stdin read no token: standard input's first line is "
                              "empty")
        return token
    return environ.get(TOKEN_ENV, "").strip() or None


def on_this_machine(address: str) -> bool:
    """Whether ``address`` (``host:port``, as ``probe_address`` gives it) is loopback:
    ``localhost``, ``127.0.0.0/8`` or ``::1``."""
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name resolved elsewhere
        return False


# A token in plaintext goes to this machine straight: neither the proxy of http_proxy,
# https_proxy or grpc_proxy nor gRPC's address-level one (as both clients dial it).
_NO_PROXY = (("grpc.enable_http_proxy", 0), ("grpc.address_http_proxy_enabled_addresses", ""))


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run the tour for parsed ``demo`` arguments: 0 when done, 1 when it could not be, 2 on a
    usage error."""
    try:
        # A server bound to every interface is dialled over loopback, as `health` does.
        address = probe_address(args.grpc_addr or environ.get("CE_GRPC_ADDR")
                                or Config().grpc_addr)
        token = bearer_token(args, environ)
    except ConfigError as exc:
        print(f"context-engine demo: {exc}", file=sys.stderr)
        return 2
    if token is not None and not on_this_machine(address):
        # the demo speaks plaintext only: the token would cross the network in clear text
        print(f"context-engine demo: the demo speaks plaintext gRPC, so it sends a token only "
              f"to this machine, and {address} is not on it: run the demo where the server "
              f"runs (or through a tunnel to it)", file=sys.stderr)
        return 2
    tenant = args.tenant or environ.get("CE_TENANT_ID") or TENANT
    session = args.session or environ.get("CE_SESSION_ID") or "tour"
    for name, value in (("--tenant" if args.tenant else "CE_TENANT_ID", tenant),
                        ("--session" if args.session else "CE_SESSION_ID", session)):
        problem = identifier_problem(value)
        if problem is not None:  # the server's own rule, before a request cannot be made
            print(f"context-engine demo: {name} {problem}", file=sys.stderr)
            return 2
    out: list[str] = []
    options = _NO_PROXY if token is not None else ()
    with grpc.insecure_channel(address, options=options) as channel:
        engine = Engine(channel, token=token)
        try:
            if session_exists(engine, tenant, session):
                print(f"context-engine demo: session {session!r} of tenant "
                      f"{tenant!r} exists already; pass another --session",
                      file=sys.stderr)
                return 1
            tour(engine, tenant, session, out)
        except CallFailed as exc:
            if out:
                print("\n".join(out))
            if exc.rpc == "GetPlan" and exc.code is not None and exc.code in _UNREACHABLE:
                message = (f"cannot reach a context-engine server at {address} ({exc.code.name}: "
                           f"{exc.details}); start one with `make run`, or pass --grpc-addr")
            else:
                hint = _HINTS.get(exc.code) if exc.code is not None else None
                message = str(exc) if hint is None else f"{exc}; {hint}"
            print(f"context-engine demo: {message}", file=sys.stderr)
            return 1
    print("\n".join(out))
    return 0
