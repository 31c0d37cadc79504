"""Fuzzing the gRPC API: over ten thousand malformed and boundary requests, across every RPC,
against the real server and database.

Every answer is OK (only for requests that may be valid) or one of INVALID_ARGUMENT,
FAILED_PRECONDITION, NOT_FOUND, RESOURCE_EXHAUSTED with exactly one ErrorInfo of the service's
domain in the rich status; never INTERNAL or UNKNOWN. Tenants that receive only malformed
requests own no row afterwards, a tenant whose session receives only malformed requests keeps
the rows it had, and the server still reports SERVING.

The malformed bytes are sent once more to a server that requires credentials, with a valid
token: a request that does not decode is still INVALID_ARGUMENT with ErrorInfo, and one that
decodes naming another tenant is PERMISSION_DENIED (TENANT_MISMATCH) before anything is read.

Every successful Build answer is read back by validators that share no code with the service:
tool pairing (``tests/support/tool_pairs.py``: every call has exactly one later result, every
result an earlier call, no duplicates) in the returned request and in ``provider_body_json``
(Anthropic and OpenAI), and envelopes (``tests/support/envelope_parser.py``: every envelope
closed exactly once, no envelope body that reads as containing a tag) in every prefix block and
message. A stage of valid, tool-heavy conversations (``tests/support/fuzz_conversations.py``)
gives those checks answers worth reading.

Seed: every run draws a fresh seed and prints it (``fuzz seed N``; pytest shows it with any
failure, and every failure message repeats it). To reproduce a run, set the variable::

    CE_FUZZ_SEED=N .venv/bin/python -m pytest tests/integration/test_fuzz.py -q

The same seed generates the same requests (tenant names aside, which are fresh per run).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from context_engine.api.auth import token_sha256
from context_engine.v1 import context_engine_pb2 as pb
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import plan_request
from tests.integration.test_budget_rpc import SMALL
from tests.support import fuzz
from tests.support.fuzz_conversations import paired_build

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

DOMAIN = "context-engine"
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
TABLES = ("sessions", "plans", "context_events", "compactions", "estimator_calibration",
          "idempotency_keys")
IN_FLIGHT = 64  # requests on the channel at once
PER_EXAMPLE = 16  # cases hypothesis draws per example


@dataclass
class Sender:
    """Sends cases as raw bytes, ``IN_FLIGHT`` at a time, and checks every answer."""

    channel: grpc.Channel
    seed: int
    sent: int = 0
    stage: int = 0  # each run() draws from its own seed, derived from ``seed``
    checked: Counter[str] = field(default_factory=Counter)  # Build answers read back
    codes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    pending: list[fuzz.Case] = field(default_factory=list)
    calls: dict[str, Callable[..., Any]] = field(default_factory=dict)
    # With credentials: the token's metadata and tenant. A case that decodes naming another
    # tenant must then be refused TENANT_MISMATCH; one that does not decode INVALID_ARGUMENT.
    metadata: tuple[tuple[str, str], ...] = ()
    tenant: str | None = None

    def __post_init__(self) -> None:
        for rpc, (_, response) in fuzz.METHODS.items():
            self.calls[rpc] = self.channel.unary_unary(
                fuzz.path(rpc), request_serializer=lambda b: b,
                response_deserializer=response.FromString)

    def add(self, cases: list[fuzz.Case]) -> None:
        self.pending.extend(cases)
        while len(self.pending) >= IN_FLIGHT:
            batch, self.pending = self.pending[:IN_FLIGHT], self.pending[IN_FLIGHT:]
            self._send(batch)

    def flush(self) -> None:
        batch, self.pending = self.pending, []
        if batch:
            self._send(batch)

    def _send(self, batch: list[fuzz.Case]) -> None:
        futures = [(case, self.calls[case.rpc].future(case.payload, timeout=60,
                                                       metadata=self.metadata))
                   for case in batch]
        for case, future in futures:
            self.sent += 1
            try:
                response = future.result()
            except grpc.RpcError as err:
                self._check_error(case, err)
            else:
                self.codes[f"{case.rpc} OK"] += 1
                if case.malformed or self._expected(case) is not None:
                    self.problems.append(f"{case!r}: answered OK")
                elif case.rpc == "Build":
                    self._check_build(case, response)

    def _check_build(self, case: fuzz.Case, response: pb.BuildResponse) -> None:
        """An OK Build answer, read back by the independent validators."""
        self.checked["Build answers"] += 1
        if response.provider_body_json:
            self.checked[f"{case.label.split(':')[0]} provider bodies"] += 1
            fmt = pb.BuildRequest.FromString(case.payload).provider_format
            self.checked[f"provider bodies {pb.ProviderFormat.Name(fmt)}"] += 1
        if any(m.tool_calls for m in response.request.messages):
            self.checked["Build answers with tool calls"] += 1
        for problem in fuzz.build_answer_problems(case.payload, response):
            self.problems.append(f"{case!r}: OK answer: {problem}")

    def _expected(self, case: fuzz.Case) -> tuple[grpc.StatusCode, str] | None:
        """With credentials, the one answer a case must get, if the bytes alone decide it."""
        if self.tenant is None:
            return None
        try:
            request = fuzz.METHODS[case.rpc][0].FromString(case.payload)
        except DecodeError:
            return grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
        if request.tenant_id != self.tenant:
            return grpc.StatusCode.PERMISSION_DENIED, "TENANT_MISMATCH"
        return None

    def _check_error(self, case: fuzz.Case, err: grpc.RpcError) -> None:
        assert isinstance(err, grpc.Call)
        code = err.code()
        self.codes[f"{case.rpc} {code.name}"] += 1
        where = f"{case!r}: {code.name} {err.details()!r}"
        expected = self._expected(case)
        if (code not in ALLOWED if expected is None else code is not expected[0]):
            self.problems.append(where if expected is None
                                 else f"{where}: expected {expected[0].name}")
            return
        try:
            status = rpc_status.from_call(err)
        except ValueError as exc:  # a status that contradicts the call's code
            self.problems.append(f"{where}: {exc}")
            return
        if status is None:
            self.problems.append(f"{where}: no rich status")
            return
        infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        if len(infos) != 1:
            self.problems.append(f"{where}: {len(infos)} ErrorInfo details")
            return
        info = error_details_pb2.ErrorInfo()
        infos[0].Unpack(info)
        if info.domain != DOMAIN or not info.reason:
            self.problems.append(f"{where}: ErrorInfo {info.domain!r} {info.reason!r}")
        elif expected is not None and info.reason != expected[1]:
            self.problems.append(f"{where}: reason {info.reason!r}, expected {expected[1]!r}")

    def run(self, strategy: st.SearchStrategy[fuzz.Case], examples: int) -> None:
        """``examples`` hypothesis examples of ``PER_EXAMPLE`` cases each, sent as they come."""
        self.stage += 1

        @hypothesis_seed(self.seed * 1_000 + self.stage)
        @settings(max_examples=examples, derandomize=False, deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(st.lists(strategy, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
        def send(cases: list[fuzz.Case]) -> None:
            self.add(cases)

        send()
        self.flush()

    def assert_clean(self) -> None:
        kinds = Counter(p.split(": ", 1)[1].split(" ", 1)[0] + " " + p.split(",", 2)[1]
                        for p in self.problems)
        assert not self.problems, (f"{fuzz.reproduce_hint(self.seed)}: {len(self.problems)} "
                                   f"bad answers {dict(kinds)}; first:\n"
                                   + "\n".join(self.problems[:25]))


def per_rpc(make: Callable[[str], st.SearchStrategy[fuzz.Case]]) -> st.SearchStrategy[
        fuzz.Case]:
    return st.one_of(*(make(rpc) for rpc in fuzz.RPCS))


def rows(db: Any, tenant: str | None = None) -> dict[str, int]:
    if tenant is None:
        return {t: int(db.val(f"SELECT count(*) FROM {t}")) for t in TABLES}
    return {t: int(db.val(f"SELECT count(*) FROM {t} WHERE tenant_id = $1", tenant))
            for t in TABLES}


def test_fuzz_every_rpc(server, channel, stub, db):
    seed = fuzz.run_seed()
    hint = fuzz.reproduce_hint(seed)
    print(f"\n{hint}")
    run_id = uuid.uuid4().hex[:10]
    malformed_only = f"fuzz-malformed-{run_id}"    # no session, only malformed traffic
    guarded = f"fuzz-guarded-{run_id}"             # a session, then only malformed traffic
    open_tenant = f"fuzz-boundary-{run_id}"        # a session, boundary traffic
    session = "fuzz-session"
    stub.Plan(fuzz.base_request("Plan", guarded, session))
    stub.Plan(fuzz.base_request("Plan", open_tenant, session))
    pairs_tenant = f"fuzz-pairs-{run_id}"          # valid tool-heavy Builds
    pairs_sessions = ("wide", "small")             # a 200k and a 16k window
    stub.Plan(fuzz.base_request("Plan", pairs_tenant, "wide"))
    stub.Plan(plan_request(pairs_tenant, "small", model=SMALL))
    guarded_rows = rows(db, guarded)
    assert guarded_rows["plans"] == 1

    sender = Sender(channel, seed=seed)

    # 1. random bytes as the serialized request: nothing anywhere may be written
    before = rows(db)
    sender.run(per_rpc(fuzz.random_bytes), examples=100)
    sender.assert_clean()
    assert rows(db) == before, hint

    # 2. wire-level damage to encodings of requests no session exists for (the Plan carries a
    # violation): truncation, bit flips, invalid UTF-8, wrong wire types, unknown fields, deep
    # nesting, lengths past the end. A tenant of its own: one flipped bit can make a valid
    # request (0x1a to 0x12 turns the Plan's instructions into the version it lacks), so it
    # may gain rows; the answers are checked all the same.
    wire_tenant = f"fuzz-wire-{run_id}"

    def wire(rpc: str) -> st.SearchStrategy[fuzz.Case]:
        msg = fuzz.base_request(rpc, wire_tenant, session)
        if rpc == "Plan":
            msg.agent.version = ""  # type: ignore[attr-defined]
        return fuzz.wire_mutation(rpc, msg.SerializeToString())
    sender.run(per_rpc(wire), examples=80)

    # 3. whole request messages of boundary values, in any field
    sender.run(per_rpc(fuzz.generated), examples=70)

    # 4. certainly malformed requests from a tenant without sessions, some naming another
    # tenant's session (mixed tenants)
    sender.run(st.one_of(*(fuzz.malformed(rpc, malformed_only, s) for rpc in fuzz.RPCS
                           for s in (session, "fuzz-unknown-session"))), examples=150)

    # 5. certainly malformed requests against an existing session
    sender.run(per_rpc(lambda rpc: fuzz.malformed(rpc, guarded, session)), examples=130)

    # 6. boundary requests against an existing session: any of them may be valid (DeleteSession
    # erases a session of its own, so the others keep theirs)
    stub.Plan(fuzz.base_request("Plan", open_tenant, "fuzz-erased"))
    sender.run(per_rpc(lambda rpc: fuzz.boundary(
        rpc, open_tenant, "fuzz-erased" if rpc == "DeleteSession" else session)), examples=100)
    sender.assert_clean()

    # 6b. valid conversations with tool pairs arranged every way the contract allows, with and
    # without a provider body, under a wide and a small window: most are answered OK, and
    # every OK answer is read back by the independent validators
    paired_before = sender.checked["paired provider bodies"], sender.checked["Build answers"]
    sender.run(paired_build(pairs_tenant, pairs_sessions), examples=10)
    sender.assert_clean()
    paired_answers = sender.checked["Build answers"] - paired_before[1]
    assert paired_answers >= 10 * PER_EXAMPLE // 2, (hint, dict(sender.codes))
    assert sender.checked["paired provider bodies"] > paired_before[0], hint

    # 7. unknown sessions and epochs of a tenant that has one
    unknown = [
        fuzz.Case("GetPlan", pb.GetPlanRequest(tenant_id=guarded, session_id=session,
                                               epoch=e).SerializeToString(), True, "epoch")
        for e in (2, 3, 1000, 2**31 - 1)]
    unknown += [
        fuzz.Case(rpc, msg.SerializeToString(), True, "unknown session")
        for rpc in fuzz.RPCS if rpc not in ("Plan", "DeleteSession")  # these two answer OK
        for msg in [fuzz.base_request(rpc, guarded, "fuzz-no-such-session")]]
    build = fuzz.base_request("Build", guarded, session)
    build.epoch = 9  # type: ignore[attr-defined]
    unknown.append(fuzz.Case("Build", build.SerializeToString(), True, "unknown epoch"))
    sender.add(unknown)
    sender.flush()
    sender.assert_clean()

    assert sender.sent >= 10_000, (hint, sender.sent)
    assert rows(db, malformed_only) == dict.fromkeys(TABLES, 0), hint
    assert rows(db, guarded) == guarded_rows, hint
    # the answer checks read real answers: both provider formats, tool calls in the request
    for kind in ("provider bodies PROVIDER_FORMAT_ANTHROPIC_MESSAGES",
                 "provider bodies PROVIDER_FORMAT_OPENAI_RESPONSES",
                 "Build answers with tool calls"):
        assert sender.checked[kind] > 0, (hint, kind, dict(sender.checked))
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "context_engine.v1.ContextEngine"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == (
            health_pb2.HealthCheckResponse.SERVING)
    print(f"\n{sender.sent} requests: " + ", ".join(
        f"{k}={v}" for k, v in sorted(sender.codes.items())))
    print("read back by the independent validators: " + ", ".join(
        f"{k}={v}" for k, v in sorted(sender.checked.items())) + f"; {hint}")


def test_fuzz_malformed_bytes_with_credentials(database_url, db, tmp_path: Path):
    """Stages 1 and 2 (random bytes, wire-level damage) against a server that requires a
    token, sent with a valid one: authentication comes first, then a request that does not
    decode is INVALID_ARGUMENT and one naming another tenant TENANT_MISMATCH; nothing is
    written for any tenant but the token's."""
    seed = fuzz.run_seed()
    hint = fuzz.reproduce_hint(seed)
    print(f"\n{hint}")
    tenant = f"fuzz-secured-{uuid.uuid4().hex[:10]}"
    token = f"fuzz-{uuid.uuid4().hex}"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256(token), "tenant_id": tenant,
                                   "rpcs": ["*"]}]))
    config = base_config().replace(dev_mode=False, auth_tokens_file=tokens)
    server = ServerThread(config, database_url)
    channel = grpc.insecure_channel(server.address)
    try:
        sender = Sender(channel, seed=seed, metadata=(("authorization", f"Bearer {token}"),),
                        tenant=tenant)
        before = rows(db)
        sender.run(per_rpc(fuzz.random_bytes), examples=40)
        sender.assert_clean()
        assert rows(db) == before, hint

        def wire(rpc: str) -> st.SearchStrategy[fuzz.Case]:
            msg = fuzz.base_request(rpc, tenant, "fuzz-session")
            if rpc == "Plan":
                msg.agent.version = ""  # type: ignore[attr-defined]
            return fuzz.wire_mutation(rpc, msg.SerializeToString())
        sender.run(per_rpc(wire), examples=50)
        sender.assert_clean()

        # a flipped bit may leave a valid request of the token's tenant; no other tenant
        # gains a row
        after, own = rows(db), rows(db, tenant)
        assert {t: after[t] - own[t] for t in TABLES} == before, hint
        assert sender.sent >= 1_400, (hint, sender.sent)
        answered = Counter(key.split(" ", 1)[1] for key in sender.codes.elements())
        # every kind of answer was exercised: refused unread, tenant-checked, served
        assert answered["INVALID_ARGUMENT"] > 0 and answered["PERMISSION_DENIED"] > 0, (
            hint, answered)
        assert sum(n for code, n in answered.items()
                   if code not in ("INVALID_ARGUMENT", "PERMISSION_DENIED")) > 0, (hint,
                                                                                  answered)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == (
            health_pb2.HealthCheckResponse.SERVING)
        print(f"\n{sender.sent} requests with credentials: " + ", ".join(
            f"{k}={v}" for k, v in sorted(sender.codes.items())))
    finally:
        channel.close()
        server.stop()


def test_idempotency_keys_reused_with_other_payloads(stub, ids, db):
    """A key retried with a different request is refused and changes nothing."""
    tenant, session = ids
    stub.Plan(fuzz.base_request("Plan", tenant, session))
    compact = fuzz.base_request("Compact", tenant, session)
    usage = fuzz.base_request("ReportUsage", tenant, session)
    rotate = fuzz.base_request("Rotate", tenant, session)
    stub.Compact(compact)
    stub.ReportUsage(usage)
    stub.Rotate(rotate)
    before = rows(db, tenant)
    variants: list[tuple[str, Any]] = []
    for change in (lambda m: setattr(m, "reason", "other"),
                   lambda m: setattr(m, "replace_through_sequence", 1),
                   lambda m: setattr(m, "session_id", "other-session"),
                   lambda m: m.checkpoint.items[0].user.__setattr__("text", "changed")):
        msg = pb.CompactRequest()
        msg.CopyFrom(compact)
        change(msg)
        variants.append(("Compact", msg))
    for change in (lambda m: setattr(m, "input_tokens", 3200),
                   lambda m: setattr(m, "cached_tokens", 0),
                   lambda m: setattr(m, "estimator_factor", 1.5),
                   lambda m: setattr(m, "session_id", "other-session")):
        msg = pb.ReportUsageRequest()
        msg.CopyFrom(usage)
        change(msg)
        variants.append(("ReportUsage", msg))
    for change in (lambda m: setattr(m, "session_id", "other-session"),
                   lambda m: (setattr(m, "reason", pb.ROTATION_REASON_MODEL_ROUTED),
                              m.model.CopyFrom(pb.ModelSpec(model_id="gpt-4o")))):
        msg = pb.RotateRequest()
        msg.CopyFrom(rotate)
        change(msg)
        variants.append(("Rotate", msg))
    for rpc, msg in variants:
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, rpc)(msg)
        assert err.value.code() in ALLOWED - {grpc.StatusCode.RESOURCE_EXHAUSTED}, (rpc, msg)
        status = rpc_status.from_call(err.value)
        assert status is not None
        assert rows(db, tenant) == before, (rpc, msg)


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_every_certain_violation_is_refused_on_its_base_request(channel, stub, db, ids,
                                                                planned):
    """Stages 4 and 5 send each violation after random noise, so a violation that has stopped
    being one is only drawn now and then. Here every one is sent on its plain base request, to a
    planned session and to one that is not: each is refused with a structured error, and no
    row changes."""
    tenant, session = ids
    if planned:
        stub.Plan(fuzz.base_request("Plan", tenant, session))
    before = rows(db, tenant)
    sender = Sender(channel, seed=0)
    cases = []
    for rpc in fuzz.RPCS:
        for index, violate in enumerate(fuzz.VIOLATIONS[rpc]):
            msg = fuzz.base_request(rpc, tenant, session)
            violate(msg)
            cases.append(fuzz.Case(rpc, msg.SerializeToString(), malformed=True,
                                   label=f"violation:{rpc}#{index}"))
    sender.add(cases)
    sender.flush()
    sender.assert_clean()
    assert sender.sent == sum(map(len, fuzz.VIOLATIONS.values())) > 100
    assert rows(db, tenant) == before
