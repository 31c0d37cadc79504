"""Credentials on a real server: bearer tokens from a file and from the api_tokens table, RPC
grants, tenant binding, open health and reflection, tokens kept out of logs and errors; TLS and
mutual TLS with certificates made at test time by the openssl CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import pytest
from context_engine.api.auth import token_lookups, token_sha256
from context_engine.config import Pooler
from context_engine.telemetry.logs import JsonFormatter
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import Db, ServerThread
from tests.conftest import test_config as base_config
from tests.integration.processes import ServerProcess
from tests.integration.requests import build_request, failure, plan_request
from tests.support import fuzz
from tests.support.certs import Pki, issue_server_cert, make_pki
from tests.support.pool import every_connection_taken

pytestmark = pytest.mark.integration


@dataclass
class Secured:
    server: ServerThread
    channel: grpc.Channel
    stub: pb_grpc.ContextEngineStub
    tenant: str
    other_tenant: str
    full: str  # every RPC of tenant
    build_only: str  # Build and GetPlan of tenant
    table: str  # from api_tokens: Plan and GetPlan of tenant


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def secured(database_url: str, db, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Secured]:
    tenant, other = f"tenant-{uuid.uuid4().hex[:10]}", f"tenant-{uuid.uuid4().hex[:10]}"
    full, build_only, table = (f"{kind}-{uuid.uuid4().hex}" for kind in ("full", "build", "db"))
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    path.write_text(json.dumps([
        {"sha256": token_sha256(full), "tenant_id": tenant, "rpcs": ["*"]},
        {"sha256": token_sha256(build_only), "tenant_id": tenant, "rpcs": ["Build", "GetPlan"]},
        {"sha256": token_sha256(f"full-{other}"), "tenant_id": other, "rpcs": ["*"]},
    ]))
    db.fetch("INSERT INTO api_tokens (tenant_id, token_sha256, rpcs) VALUES ($1, $2, $3)",
             tenant, token_sha256(table), ["Plan", "GetPlan"])
    config = base_config().replace(dev_mode=False, auth_tokens_file=path, auth_db_tokens=True,
                     auth_cache_seconds=0.5)
    server = ServerThread(config, database_url)
    channel = grpc.insecure_channel(server.address)
    yield Secured(server=server, channel=channel, stub=pb_grpc.ContextEngineStub(channel),
                  tenant=tenant, other_tenant=other, full=full, build_only=build_only,
                  table=table)
    channel.close()
    server.stop()


def refused(call, request, metadata=(), timeout=30):
    with pytest.raises(grpc.RpcError) as err:
        call(request, metadata=metadata, timeout=timeout)
    return err.value


def test_calls_without_a_known_token_are_unauthenticated(secured: Secured) -> None:
    session = f"s-{uuid.uuid4().hex[:8]}"
    for metadata in ((), bearer("no-such-token"), (("authorization", f"Basic {secured.full}"),)):
        f = failure(refused(secured.stub.Plan, plan_request(secured.tenant, session), metadata))
        assert (f.code, f.reason, f.domain) == (grpc.StatusCode.UNAUTHENTICATED,
                                                "UNAUTHENTICATED", "context-engine")
        assert f.metadata == {"rpc": "Plan"}


def test_a_token_calls_its_rpcs_for_its_tenant(secured: Secured, db) -> None:
    s = secured
    session = f"s-{uuid.uuid4().hex[:8]}"
    plan = s.stub.Plan(plan_request(s.tenant, session), metadata=bearer(s.full), timeout=30)
    assert plan.created and plan.plan.epoch == 1
    built = s.stub.Build(build_request(s.tenant, session), metadata=bearer(s.build_only),
                         timeout=30)
    assert built.prefix_sha256 == plan.plan.prefix_sha256
    f = failure(refused(s.stub.Plan, plan_request(s.tenant, session), bearer(s.build_only)))
    assert (f.code, f.reason) == (grpc.StatusCode.PERMISSION_DENIED, "RPC_NOT_ALLOWED")
    assert f.metadata == {"rpc": "Plan", "tenant_id": s.tenant}


def test_a_request_for_another_tenant_is_denied_before_anything_is_written(secured: Secured,
                                                                           db) -> None:
    s = secured
    session = f"s-{uuid.uuid4().hex[:8]}"
    before = db.counts(s.other_tenant)
    f = failure(refused(s.stub.Plan, plan_request(s.other_tenant, session), bearer(s.full)))
    assert (f.code, f.reason) == (grpc.StatusCode.PERMISSION_DENIED, "TENANT_MISMATCH")
    assert f.metadata == {"rpc": "Plan", "tenant_id": s.other_tenant,
                          "token_tenant_id": s.tenant}
    assert db.counts(s.other_tenant) == before
    assert db.val("SELECT count(*) FROM sessions WHERE session_id = $1", session) == 0


UNDECODABLE = {
    "corrupt": b"\xff\xff\xff",
    "invalid-utf8-tenant": fuzz.length_delimited(1, b"\xc3\x28"),
    "overlong-length": fuzz.tag(1, 2) + fuzz.varint(2**32 + 5) + b"x",
    "deep-groups": fuzz.nested_groups(5000),
}


def raw(channel: grpc.Channel, rpc: str):
    return channel.unary_unary(fuzz.path(rpc), request_serializer=lambda b: b,
                               response_deserializer=fuzz.METHODS[rpc][1].FromString)


@pytest.mark.parametrize("rpc", fuzz.RPCS)
def test_undecodable_bytes_from_an_authenticated_caller_are_invalid_argument(
        secured: Secured, rpc: str) -> None:
    call = raw(secured.channel, rpc)
    for label, payload in UNDECODABLE.items():
        f = failure(refused(call, payload, bearer(secured.full)))
        assert (f.code, f.reason, f.domain) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                "INVALID_ARGUMENT", "context-engine"), label
        assert "request" in f.violations, label
    # decodable bytes naming no tenant are still refused as another tenant's
    f = failure(refused(call, b"", bearer(secured.full)))
    assert (f.code, f.reason) == (grpc.StatusCode.PERMISSION_DENIED, "TENANT_MISMATCH")


def test_undecodable_bytes_need_credentials_and_an_allowed_rpc_first(secured: Secured) -> None:
    for label, payload in UNDECODABLE.items():
        for metadata in ((), bearer("no-such-token")):
            f = failure(refused(raw(secured.channel, "Plan"), payload, metadata))
            assert (f.code, f.reason) == (grpc.StatusCode.UNAUTHENTICATED,
                                          "UNAUTHENTICATED"), label
        f = failure(refused(raw(secured.channel, "Plan"), payload, bearer(secured.build_only)))
        assert (f.code, f.reason) == (grpc.StatusCode.PERMISSION_DENIED, "RPC_NOT_ALLOWED"), label


def test_health_and_reflection_need_no_credentials(secured: Secured) -> None:
    health = health_pb2_grpc.HealthStub(secured.channel)
    for name in ("", "context_engine.v1.ContextEngine"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(secured.channel)
    replies = list(reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "context_engine.v1.ContextEngine" in names


def test_table_tokens_work_and_a_revocation_takes_effect_within_the_cache_ttl(
        secured: Secured, db) -> None:
    s = secured
    session = f"s-{uuid.uuid4().hex[:8]}"
    assert s.stub.Plan(plan_request(s.tenant, session), metadata=bearer(s.table),
                       timeout=30).created
    f = failure(refused(s.stub.Build, build_request(s.tenant, session), bearer(s.table)))
    assert f.reason == "RPC_NOT_ALLOWED"
    db.fetch("UPDATE api_tokens SET revoked_at = now() WHERE token_sha256 = $1",
             token_sha256(s.table))
    deadline = time.monotonic() + 10
    while True:
        try:
            s.stub.GetPlan(pb.GetPlanRequest(tenant_id=s.tenant, session_id=session),
                           metadata=bearer(s.table), timeout=30)
        except grpc.RpcError as err:
            assert failure(err).reason == "UNAUTHENTICATED"
            break
        assert time.monotonic() < deadline, "the revoked token still works after 10 s"
        time.sleep(0.1)
    # the file token of the same tenant is untouched by the revocation
    assert s.stub.GetPlan(pb.GetPlanRequest(tenant_id=s.tenant, session_id=session),
                          metadata=bearer(s.full), timeout=30).plan.epoch == 1


def test_a_token_table_the_service_may_not_read_is_internal_not_unknown(
        direct_database_url: str, tmp_path: Path) -> None:
    """The lookup of a table token failing on a database error that is no outage (here the
    service's role denied the table: SQLSTATE 42501) is answered as any defect is (README,
    "INTERNAL": message 'internal error', no metadata; one log line), not as gRPC's UNKNOWN
    carrying the driver's exception class and message, with no status and no log line."""
    admin = Db(direct_database_url)
    role = f"ce_auth_{uuid.uuid4().hex[:8]}"
    admin.fetch(f"CREATE ROLE {role} LOGIN PASSWORD 'secret'")
    admin.fetch(f"CREATE DATABASE {role} OWNER {role}")
    parts = urlsplit(direct_database_url)
    url = urlunsplit((parts.scheme, f"{role}:secret@{parts.netloc.rpartition('@')[2]}",
                      f"/{role}", parts.query, ""))
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[]")
    config = base_config().replace(dev_mode=False, auth_tokens_file=tokens,
                                   auth_db_tokens=True, db_pooler=Pooler.NONE)
    server = ServerThread(config, url)  # migrates the database as its owner
    try:
        Db(url).fetch(f"REVOKE ALL ON api_tokens FROM {role}")
        channel = grpc.insecure_channel(server.address)
        handler = Captured()
        with channel, debug_logs(handler):
            err = refused(pb_grpc.ContextEngineStub(channel).GetPlan,
                          pb.GetPlanRequest(tenant_id="acme", session_id="s"),
                          bearer(f"token-{uuid.uuid4().hex}"))
        assert err.code() is grpc.StatusCode.INTERNAL, (err.code(), err.details())
        f = failure(err)
        assert (f.reason, f.domain, f.message, f.metadata) == (
            "INTERNAL", "context-engine", "internal error", {})
        lines = [json.loads(line) for line in handler.lines[::2]]  # each record: JSON, dict
        calls = [line for line in lines if line.get("event") == "rpc"]
        assert [(c["method"], c["code"], c["reason"]) for c in calls] == [
            ("GetPlan", "INTERNAL", "INTERNAL")]
        assert {line.get("exception") for line in lines} >= {"InsufficientPrivilegeError"}
    finally:
        server.stop()
        admin.fetch(f"DROP DATABASE {role} WITH (FORCE)")
        admin.fetch(f"DROP ROLE {role}")


@contextmanager
def token_table_locked(url: str, release: threading.Event) -> Iterator[None]:
    """``api_tokens`` locked (ACCESS EXCLUSIVE, so a lookup waits) until ``release`` is set."""
    locked = threading.Event()

    async def hold() -> None:
        conn = await asyncpg.connect(url)
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE api_tokens IN ACCESS EXCLUSIVE MODE")
                locked.set()
                while not release.is_set():
                    await asyncio.sleep(0.01)
        finally:
            await conn.close()

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    holder.start()
    try:
        assert locked.wait(10), "api_tokens was never locked"
        yield
    finally:
        release.set()
        holder.join(10)


def test_a_flood_of_bad_tokens_holds_a_bounded_share_of_the_pool(
        database_url: str, direct_database_url: str, tmp_path: Path) -> None:
    """Distinct bad tokens (which no miss cache answers) each need a lookup of the token
    table: at most a quarter of CE_DB_POOL_SIZE of them run at once, as PostgreSQL itself
    shows, so a call with a good token keeps the rest of the pool. All of the pool was theirs:
    with the lookups slow (the table locked), a file token's GetPlan waited behind 40 of them
    for some 10 s."""
    tenant, good = f"tenant-{uuid.uuid4().hex[:10]}", f"file-{uuid.uuid4().hex}"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256(good), "tenant_id": tenant,
                                   "rpcs": ["GetPlan"]}]))
    timeout, size = 2.0, 8
    config = base_config().replace(dev_mode=False, auth_tokens_file=tokens,
                                   auth_db_tokens=True, db_pool_size=size,
                                   db_timeout_seconds=timeout)
    server = ServerThread(config, database_url)
    request = pb.GetPlanRequest(tenant_id=tenant, session_id="never-planned")
    postgres = Db(direct_database_url)
    waiting_lookups = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND query LIKE '%FROM api_tokens%WHERE token_sha256%'")

    async def flood() -> tuple[list[int], grpc.StatusCode, float, list[grpc.StatusCode]]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)

            async def call(token: str) -> grpc.StatusCode:
                try:
                    await stub.GetPlan(request, metadata=bearer(token), timeout=30)
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            bad = [asyncio.ensure_future(call(f"bad-{i}-{uuid.uuid4().hex}"))
                   for i in range(40)]
            seen = []
            for _ in range(3):
                await asyncio.sleep(0.3)
                seen.append(int(await asyncio.to_thread(postgres.val, waiting_lookups)))
            sent = time.perf_counter()
            code = await call(good)
            took = time.perf_counter() - sent
            return seen, code, took, list(await asyncio.gather(*bad))

    try:
        with token_table_locked(direct_database_url, threading.Event()):
            seen, code, took, bad = asyncio.run(flood())
        assert max(seen) == token_lookups(size) == 2, seen
        assert code is grpc.StatusCode.NOT_FOUND and took < timeout / 2, (code, took)
        assert set(bad) == {grpc.StatusCode.UNAVAILABLE}  # the table stayed locked
    finally:
        server.stop()


def test_a_calls_latency_counts_its_token_lookup(database_url: str, direct_database_url: str,
                                                  db) -> None:
    """The time a call spends in the credentials check (a table lookup waiting on the
    database) is the call's time, in its log line and context_engine_rpc_seconds, whether it is
    then turned away or served: a refusal was logged and sampled at 0 ms whatever it took, and
    a served call from when the servicer began, after the lookup."""
    tenant, token = f"tenant-{uuid.uuid4().hex[:10]}", f"db-{uuid.uuid4().hex}"
    db.fetch("INSERT INTO api_tokens (tenant_id, token_sha256, rpcs) VALUES ($1, $2, $3)",
             tenant, token_sha256(token), ["GetPlan"])
    timeout = 1.0
    config = base_config().replace(dev_mode=False, auth_db_tokens=True, auth_cache_seconds=0.0,
                                   db_timeout_seconds=timeout)
    server = ServerThread(config, database_url)
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    request = pb.GetPlanRequest(tenant_id=tenant, session_id="never-planned")
    handler = Captured()
    try:
        with debug_logs(handler):
            # never read, and the lookup times out: UNAVAILABLE after the database's timeout
            with token_table_locked(direct_database_url, threading.Event()):
                f = failure(refused(stub.GetPlan, request, bearer(token)))
            assert (f.code, f.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
            # the lookup waits 0.6 s for the lock, then the call is served (NOT_FOUND)
            release = threading.Event()
            with token_table_locked(direct_database_url, release):
                threading.Timer(0.6, release.set).start()
                sent = time.perf_counter()
                f = failure(refused(stub.GetPlan, request, bearer(token)))
                waited = time.perf_counter() - sent
            assert f.code is grpc.StatusCode.NOT_FOUND and waited >= 0.6
        calls = [line for line in map(json.loads, handler.lines[::2]) if line["event"] == "rpc"]
        assert [(c["code"], c["reason"]) for c in calls] == [
            ("UNAVAILABLE", "STORE_UNAVAILABLE"), ("NOT_FOUND", "SESSION_NOT_FOUND")]
        assert calls[0]["duration_ms"] >= 0.9 * timeout * 1000, calls[0]
        assert calls[1]["duration_ms"] >= 0.5 * 1000, calls[1]
        seconds = {s.labels["code"]: s.value for m in server.registry.collect()
                   if m.name == "context_engine_rpc_seconds" for s in m.samples
                   if s.name.endswith("_sum") and s.labels["method"] == "GetPlan"}
        assert seconds["UNAVAILABLE"] >= 0.9 * timeout and seconds["NOT_FOUND"] >= 0.5, seconds
    finally:
        channel.close()
        server.stop()


def test_a_call_cancelled_during_its_token_lookup_is_logged_and_sampled(
        database_url: str, direct_database_url: str, db) -> None:
    """A call whose deadline passes while its credentials check waits on the token table, or
    whose caller gives up then, ends DEADLINE_EXCEEDED or CANCELLED in its log line and
    context_engine_rpc_seconds as in grpc_server_handled_total (README, "Logs and context
    events"): such calls had neither a log line nor a latency sample, so a token table that
    stalled every call past its deadline showed no errors in the service's own error ratio."""
    tenant, token = f"tenant-{uuid.uuid4().hex[:10]}", f"db-{uuid.uuid4().hex}"
    db.fetch("INSERT INTO api_tokens (tenant_id, token_sha256, rpcs) VALUES ($1, $2, $3)",
             tenant, token_sha256(token), ["GetPlan"])
    config = base_config().replace(dev_mode=False, auth_db_tokens=True, auth_cache_seconds=0.0,
                                   db_timeout_seconds=30.0)
    server = ServerThread(config, database_url)
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    request = pb.GetPlanRequest(tenant_id=tenant, session_id="never-planned")
    handler = Captured()

    def calls() -> list[tuple[str, str]]:
        return [(c["code"], c["reason"]) for c in map(json.loads, handler.lines[::2])
                if c["event"] == "rpc" and c.get("method") == "GetPlan"]

    def counted(name: str, code_label: str) -> dict[str, float]:
        return {s.labels[code_label]: s.value for m in server.registry.collect()
                for s in m.samples if s.name == name and s.value
                and s.labels.get("method", s.labels.get("grpc_method")) == "GetPlan"}
    try:
        with debug_logs(handler), token_table_locked(direct_database_url, threading.Event()):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetPlan(request, metadata=bearer(token), timeout=0.5)
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            given_up = stub.GetPlan.future(request, metadata=bearer(token), timeout=30)
            time.sleep(0.5)  # its lookup waits on the lock
            given_up.cancel()
            deadline = time.monotonic() + 10
            while len(calls()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert sorted(calls()) == [("CANCELLED", "CANCELLED"),
                                   ("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED")]
        expected = {"CANCELLED": 1.0, "DEADLINE_EXCEEDED": 1.0}
        assert counted("grpc_server_handled_total", "grpc_code") == expected
        assert counted("context_engine_rpc_seconds_count", "code") == expected
    finally:
        channel.close()
        server.stop()


def test_a_token_lookup_waits_for_a_connection_at_most_the_database_timeout(
        database_url: str, db) -> None:
    """With every connection of the pool taken, the lookup of a table token gives up after
    CE_DB_TIMEOUT_SECONDS and the call is answered UNAVAILABLE (STORE_UNAVAILABLE), as any
    call of the store waiting for a connection is (README, "Pool sizes"); it waited for one
    without limit, until the caller's own deadline."""
    tenant, token = f"tenant-{uuid.uuid4().hex[:10]}", f"db-{uuid.uuid4().hex}"
    db.fetch("INSERT INTO api_tokens (tenant_id, token_sha256, rpcs) VALUES ($1, $2, $3)",
             tenant, token_sha256(token), ["GetPlan"])
    timeout, size = 1.0, 2
    config = base_config().replace(dev_mode=False, auth_db_tokens=True, db_pool_size=size,
                                   db_timeout_seconds=timeout)
    server = ServerThread(config, database_url)
    try:
        with every_connection_taken(server, size):
            with grpc.insecure_channel(server.address) as channel:
                sent = time.perf_counter()
                err = refused(pb_grpc.ContextEngineStub(channel).GetPlan,
                              pb.GetPlanRequest(tenant_id=tenant, session_id="never-planned"),
                              bearer(token), timeout=10 * timeout)
                waited = time.perf_counter() - sent
            f = failure(err)
            assert (f.code, f.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE"), (
                f.code, f.reason, waited)
            assert 0.9 * timeout <= waited < 5 * timeout, waited
    finally:
        server.stop()


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.formatter_ = JsonFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.formatter_.format(record))
        self.lines.append(repr(record.__dict__))


@contextmanager
def debug_logs(handler: logging.Handler) -> Iterator[None]:
    """``handler`` gets every record of the service's loggers, DEBUG included, in the block."""
    logger = logging.getLogger("context_engine")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_tokens_never_reach_logs_or_errors(secured: Secured) -> None:
    s = secured
    session = f"s-{uuid.uuid4().hex[:8]}"
    unknown = f"unknown-{uuid.uuid4().hex}"
    handler = Captured()
    with debug_logs(handler):
        errors = [
            refused(s.stub.Plan, plan_request(s.tenant, session), bearer(unknown)),
            refused(s.stub.Plan, plan_request(s.tenant, session), bearer(s.build_only)),
            refused(s.stub.Plan, plan_request(s.other_tenant, session), bearer(s.full)),
        ]
    reasons = [json.loads(line).get("reason") for line in handler.lines[::2]]
    assert reasons == ["UNAUTHENTICATED", "RPC_NOT_ALLOWED", "TENANT_MISMATCH"]
    text = "\n".join(handler.lines)
    for err in errors:
        text += f"\n{err.details()}\n{err.trailing_metadata()!r}\n{err.debug_error_string()}"
    for token in (unknown, s.build_only, s.full):
        assert token not in text
        assert token_sha256(token) not in text


# ---------------------------------------------------------------- TLS and mutual TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), ca_name="context-engine test CA",
                    server_alt_names="IP:127.0.0.1,DNS:localhost")


def _health(channel: grpc.Channel) -> int:
    return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5).status)


def _health_failure(channel: grpc.Channel) -> grpc.StatusCode:
    """The code a health check on ``channel`` fails with; the channel is closed after."""
    with channel, pytest.raises(grpc.RpcError) as err:
        _health(channel)
    return err.value.code()


def _secure(address: str, pki: Pki, *, client_cert: bool) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pki.client_key.read_bytes() if client_cert else None,
        certificate_chain=pki.client_cert.read_bytes() if client_cert else None)
    return grpc.secure_channel(address, creds)


def test_tls_serves_tls_clients_and_refuses_plaintext(database_url: str, pki: Pki, ids,
                                                      tmp_path: Path) -> None:
    tenant, session = ids
    token = f"tls-{uuid.uuid4().hex}"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256(token), "tenant_id": tenant,
                                   "rpcs": ["*"]}]))
    config = base_config().replace(dev_mode=False, auth_tokens_file=tokens,
                     tls_cert_file=pki.server_cert, tls_key_file=pki.server_key)
    server = ServerThread(config, database_url)
    try:
        with _secure(server.address, pki, client_cert=False) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as anonymous:
                pb_grpc.ContextEngineStub(channel).Plan(plan_request(tenant, session),
                                                        timeout=30)
            assert anonymous.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # as the README shows: TLS channel credentials composed with the bearer token
        creds = grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes()),
            grpc.access_token_call_credentials(token))
        with grpc.secure_channel(server.address, creds) as channel:
            plan = pb_grpc.ContextEngineStub(channel).Plan(plan_request(tenant, session),
                                                          timeout=30)
            assert plan.plan.epoch == 1
        plain = grpc.insecure_channel(server.address)
        assert _health_failure(plain) is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(database_url: str,
                                                              pki: Pki) -> None:
    config = base_config().replace(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                     tls_client_ca_file=pki.ca)
    server = ServerThread(config, database_url)
    try:
        with _secure(server.address, pki, client_cert=True) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        anonymous = _secure(server.address, pki, client_cert=False)
        assert _health_failure(anonymous) is grpc.StatusCode.UNAVAILABLE
        plain = grpc.insecure_channel(server.address)
        assert _health_failure(plain) is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def _served(address: str, pki: Pki, *, client_cert: bool = False) -> bytes:
    """The DER certificate the server presents on a new handshake, as Python's ssl module
    reads it (verified against the test CA for the name localhost, as a client would)."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=pki.ca)
    context.set_alpn_protocols(["h2"])
    if client_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def _install(cert: Path, key: Path, pair: tuple[Path, Path]) -> None:
    """Renew into the mounted files in place, as cert-manager's writers do: certificate first."""
    cert.write_bytes(pair[0].read_bytes())
    key.write_bytes(pair[1].read_bytes())


def _rejections(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [getattr(r, "fields", {}) for r in caplog.records
            if r.getMessage() == "tls_files_rejected"]


def test_a_renewed_certificate_is_served_without_a_restart(
        database_url: str, pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    renewed = issue_server_cert(pki, tmp_path, name="renewed",
                                server_alt_names="IP:127.0.0.1,DNS:localhost")
    third = issue_server_cert(pki, tmp_path, name="third",
                              server_alt_names="IP:127.0.0.1,DNS:localhost")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(cert, key, (pki.server_cert, pki.server_key))
    caplog.set_level(logging.INFO, logger="context_engine")
    server = ServerThread(base_config().replace(tls_cert_file=cert, tls_key_file=key),
                          database_url)
    try:
        assert _served(server.address, pki) == _der(pki.server_cert)
        _install(cert, key, renewed)
        assert _served(server.address, pki) == _der(renewed[0])
        with _secure(server.address, pki, client_cert=False) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        # half-way through the next renewal: the new certificate, the old key
        cert.write_bytes(third[0].read_bytes())
        for _ in range(3):
            assert _served(server.address, pki) == _der(renewed[0])
        # a certificate cut short while it is written
        cert.write_bytes(third[0].read_bytes()[:700])
        for _ in range(3):
            assert _served(server.address, pki) == _der(renewed[0])
        with _secure(server.address, pki, client_cert=False) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        rejected = _rejections(caplog)
        assert len(rejected) == 2, rejected  # once per bad version, not once per handshake
        assert all(str(cert) in str(r["problem"]) and str(key) in str(r["problem"])
                   for r in rejected), rejected
        _install(cert, key, third)
        assert _served(server.address, pki) == _der(third[0])
        assert len(_rejections(caplog)) == 2
        reloaded = [getattr(r, "fields", {}).get("certificate_sha256") for r in caplog.records
                    if r.getMessage() == "tls_files_reloaded"]
        assert reloaded == [hashlib.sha256(_der(pem)).hexdigest()
                            for pem in (renewed[0], third[0])]
    finally:
        server.stop()


def test_a_renewed_certificate_under_mutual_tls_still_requires_client_certificates(
        database_url: str, pki: Pki, tmp_path: Path) -> None:
    renewed = issue_server_cert(pki, tmp_path, name="renewed",
                                server_alt_names="IP:127.0.0.1,DNS:localhost")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(cert, key, (pki.server_cert, pki.server_key))
    server = ServerThread(base_config().replace(tls_cert_file=cert, tls_key_file=key,
                                                tls_client_ca_file=pki.ca), database_url)
    try:
        assert _served(server.address, pki, client_cert=True) == _der(pki.server_cert)
        _install(cert, key, renewed)
        assert _served(server.address, pki, client_cert=True) == _der(renewed[0])
        with _secure(server.address, pki, client_cert=True) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        anonymous = _secure(server.address, pki, client_cert=False)
        assert _health_failure(anonymous) is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


# ---------------------------------------------------------------- the serve command


def test_a_dev_mode_server_says_so_on_its_first_log_line(database_url: str) -> None:
    server = ServerProcess({"DATABASE_URL": database_url, "CE_DEV_MODE": "1"})
    try:
        first = server.log[0]
        assert first["event"] == "dev_mode" and first["credentials"] == "none"
        with grpc.insecure_channel(server.address) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert server.terminate() == 0


@pytest.mark.parametrize(("args", "fragment"), [
    (["--grpc-addr", "0.0.0.0:0"], "without credentials"),
    (["--grpc-addr", "127.0.0.1:0"], "--dev"),
    (["--dev", "--grpc-addr", "0.0.0.0:0"], "loopback"),
])
def test_serve_without_credentials_exits_with_a_configuration_error(args: list[str],
                                                                    fragment: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CE_DEV_MODE", "CE_AUTH_TOKENS_FILE", "CE_AUTH_DB_TOKENS")}
    out = subprocess.run([sys.executable, "-m", "context_engine", "serve", *args],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "configuration error" in out.stderr and fragment in out.stderr
    assert out.stdout == ""  # nothing started, nothing logged
