"""Credentials without a server: token files, bearer parsing, grants, the token-table cache,
and the configuration that decides whether a server may start."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from context_engine import cli
from context_engine.api.auth import (
    Authenticator,
    DatabaseTokens,
    Denied,
    FileTokens,
    Grant,
    TlsFiles,
    bearer_token,
    caller_of,
    check_tenant,
    parse_tokens,
    token_lookups,
    token_sha256,
)
from context_engine.api.servicer import Undecodable
from context_engine.config import Config, ConfigError, is_loopback
from context_engine.domain.errors import StoreUnavailable
from context_engine.v1 import context_engine_pb2 as pb

from tests.support.certs import issue_server_cert, make_pki
from tests.support.logs import Captured

TOKEN_A = "tok-a-6f1c0e9b"
TOKEN_BUILD = "tok-build-2d7e"


def entry(token: str, tenant: str, rpcs: list[str]) -> dict[str, Any]:
    return {"sha256": token_sha256(token), "tenant_id": tenant, "rpcs": rpcs}


def authenticator() -> Authenticator:
    return Authenticator([FileTokens(parse_tokens(
        [entry(TOKEN_A, "acme", ["*"]), entry(TOKEN_BUILD, "acme", ["Build", "GetPlan"])],
        "test"))])


def grant_for(auth: Authenticator, rpc: str, metadata: Any) -> Grant:
    result: Grant = asyncio.run(auth.grant_for(rpc, metadata))
    return result


def denied(auth: Authenticator, rpc: str, metadata: Any) -> Denied:
    with pytest.raises(Denied) as err:
        grant_for(auth, rpc, metadata)
    return err.value


def test_token_hash_is_the_sha256_hex_of_the_utf8_bytes() -> None:
    assert token_sha256("abc") == ("ba7816bf8f01cfea414140de5dae2223"
                                   "b00361a396177a9cb410ff61f20015ad")
    assert token_sha256("ä") == hashlib.sha256("ä".encode()).hexdigest()


@pytest.mark.parametrize(("metadata", "expected"), [
    ((), None),
    ((("authorization", "Bearer abc"),), "abc"),
    ((("authorization", "bearer   abc  "),), "abc"),
    ((("authorization", b"Bearer abc"),), "abc"),
    ((("authorization", "Basic abc"),), None),
    ((("authorization", "Bearer"),), None),
    ((("authorization", "Bearer a"), ("authorization", "Bearer b")), None),
    ((("x-other", "Bearer abc"),), None),
])
def test_bearer_token_is_read_from_one_authorization_entry(metadata: Any,
                                                           expected: str | None) -> None:
    assert bearer_token(metadata) == expected


def test_a_known_token_grants_its_tenant_and_rpcs() -> None:
    auth = authenticator()
    grant = grant_for(auth, "Plan", (("authorization", f"Bearer {TOKEN_A}"),))
    assert grant == Grant(tenant_id="acme", rpcs=frozenset({"*"}))
    limited = grant_for(auth, "Build", (("authorization", f"Bearer {TOKEN_BUILD}"),))
    assert limited.allows("GetPlan") and not limited.allows("Plan")


def test_missing_unknown_and_disallowed_tokens_are_refused_without_echoing_the_token() -> None:
    auth = authenticator()
    missing = denied(auth, "Plan", ())
    assert (missing.code, missing.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    unknown = denied(auth, "Plan", (("authorization", "Bearer not-a-known-token-77"),))
    assert (unknown.code, unknown.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert "not-a-known-token-77" not in unknown.message + json.dumps(unknown.metadata)
    narrow = denied(auth, "Plan", (("authorization", f"Bearer {TOKEN_BUILD}"),))
    assert (narrow.code, narrow.reason) == (grpc.StatusCode.PERMISSION_DENIED, "RPC_NOT_ALLOWED")
    assert narrow.metadata == {"rpc": "Plan", "tenant_id": "acme"}
    assert TOKEN_BUILD not in narrow.message + json.dumps(narrow.metadata)


def test_a_request_for_another_tenant_is_refused() -> None:
    grant = Grant(tenant_id="acme", rpcs=frozenset({"*"}))
    check_tenant("GetPlan", pb.GetPlanRequest(tenant_id="acme", session_id="s"), grant)
    for tenant in ("globex", "", "ACME"):
        with pytest.raises(Denied) as err:
            check_tenant("GetPlan", pb.GetPlanRequest(tenant_id=tenant, session_id="s"), grant)
        assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert err.value.reason == "TENANT_MISMATCH"
        assert err.value.metadata["tenant_id"] == tenant
        assert err.value.metadata["token_tenant_id"] == "acme"


def test_a_request_that_did_not_decode_is_left_to_the_servicer() -> None:
    grant = Grant(tenant_id="acme", rpcs=frozenset({"*"}))
    check_tenant("GetPlan", Undecodable("context_engine.v1.GetPlanRequest", "truncated"), grant)


@pytest.mark.parametrize(("document", "fragment"), [
    ({"sha256": "x"}, "JSON list"),
    (["nope"], "expected an object"),
    ([{"sha256": "ab", "tenant_id": "t", "rpcs": ["*"]}], "64 hex"),
    ([{"sha256": "a" * 64, "tenant_id": "", "rpcs": ["*"]}], "tenant_id"),
    ([{"sha256": "a" * 64, "tenant_id": "t" * 257, "rpcs": ["*"]}], "tenant_id is 257 char"),
    ([{"sha256": "a" * 64, "tenant_id": " t", "rpcs": ["*"]}], "tenant_id must not contain"),
    ([{"sha256": "a" * 64, "tenant_id": "t", "rpcs": []}], "rpcs"),
    ([{"sha256": "a" * 64, "tenant_id": "t", "rpcs": ["Plna"]}], "unknown RPC names"),
    ([{"sha256": "a" * 64, "tenant_id": "t", "rpcs": ["*"], "token": "plain"}], "unknown keys"),
    ([{"sha256": "a" * 64, "tenant_id": "t", "rpcs": ["*"]},
      {"sha256": "A" * 64, "tenant_id": "u", "rpcs": ["*"]}], "twice"),
    # a hash followed by a line break (a regex "$" takes it, and bytes.fromhex ignores it):
    # the same token as the first entry's, for another tenant and every RPC
    ([{"sha256": "a" * 64, "tenant_id": "t", "rpcs": ["GetPlan"]},
      {"sha256": "a" * 64 + "\n", "tenant_id": "u", "rpcs": ["*"]}], "64 hex"),
    ([{"sha256": " " + "a" * 64, "tenant_id": "t", "rpcs": ["*"]}], "64 hex"),
])
def test_malformed_token_files_are_configuration_errors(document: Any, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_tokens(document, "CE_AUTH_TOKENS_FILE")


def test_token_file_hashes_are_case_insensitive_and_loaded_from_disk(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    digest = token_sha256(TOKEN_A).upper()
    path.write_text(json.dumps([{"sha256": digest, "tenant_id": "acme", "rpcs": ["Plan"]}]))
    tokens = FileTokens.load(path)
    assert asyncio.run(tokens.grant(token_sha256(TOKEN_A))) == Grant(
        tenant_id="acme", rpcs=frozenset({"Plan"}))
    assert asyncio.run(tokens.grant(token_sha256("other"))) is None
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        FileTokens.load(path)


class FakePool:
    """The asyncpg calls DatabaseTokens makes (a connection of the pool, one query on it),
    over rows held in memory; ``down`` makes the query fail as an unreachable server does."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.queries = 0
        self.down = False

    @contextlib.asynccontextmanager
    async def acquire(self, *, timeout: float | None = None) -> AsyncIterator[FakePool]:
        yield self

    async def fetchrow(self, sql: str, digest: str, *, timeout: float) -> Any:
        self.queries += 1
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        return self.rows.get(digest)


def test_table_tokens_are_cached_for_the_ttl_so_a_revocation_lands_within_it() -> None:
    pool = FakePool()
    now = [100.0]
    digest = token_sha256(TOKEN_A)
    pool.rows[digest] = {"token_sha256": digest, "tenant_id": "acme", "rpcs": ["*"],
                         "revoked": False}
    tokens = DatabaseTokens(pool, ttl=30.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert asyncio.run(tokens.grant(digest)) == Grant(tenant_id="acme", rpcs=frozenset({"*"}))
    pool.rows[digest]["revoked"] = True
    now[0] += 29.0
    assert asyncio.run(tokens.grant(digest)) is not None  # still cached
    assert pool.queries == 1
    now[0] += 1.5
    assert asyncio.run(tokens.grant(digest)) is None  # re-read: revoked
    assert pool.queries == 2


def test_unknown_table_tokens_are_remembered_only_briefly() -> None:
    pool = FakePool()
    now = [0.0]
    digest = token_sha256("minted-later")
    tokens = DatabaseTokens(pool, ttl=30.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert asyncio.run(tokens.grant(digest)) is None
    assert asyncio.run(tokens.grant(digest)) is None
    assert pool.queries == 1
    pool.rows[digest] = {"token_sha256": digest, "tenant_id": "acme", "rpcs": ["Plan"],
                         "revoked": False}
    now[0] += 3.0
    assert asyncio.run(tokens.grant(digest)) == Grant(tenant_id="acme",
                                                       rpcs=frozenset({"Plan"}))


def test_during_an_outage_recent_grants_answer_and_everything_else_is_unavailable() -> None:
    pool = FakePool()
    now = [0.0]
    known, revoked, minted = (token_sha256(t) for t in ("known", "revoked", "minted"))
    for digest in (known, revoked):
        pool.rows[digest] = {"token_sha256": digest, "tenant_id": "acme", "rpcs": ["Build"],
                             "revoked": False}
    tokens = DatabaseTokens(pool, ttl=1.0, stale=600.0,  # type: ignore[arg-type]
                            clock=lambda: now[0])
    grant = Grant(tenant_id="acme", rpcs=frozenset({"Build"}))
    assert asyncio.run(tokens.grant(known)) == grant
    assert asyncio.run(tokens.grant(revoked)) == grant
    pool.rows[revoked]["revoked"] = True
    now[0] += 2.0
    assert asyncio.run(tokens.grant(revoked)) is None  # seen revoked
    handler = Captured()
    logger = logging.getLogger("context_engine")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        pool.down = True
        pool.rows[minted] = {"token_sha256": minted, "tenant_id": "acme", "rpcs": ["*"],
                             "revoked": False}
        queries = pool.queries
        for step in (5.0, 100.0, 300.0):
            now[0] += step
            assert asyncio.run(tokens.grant(known)) == grant  # stale, from before the outage
            assert asyncio.run(tokens.grant(revoked)) is None  # stays refused
            with pytest.raises(StoreUnavailable):  # never seen: no answer without the table
                asyncio.run(tokens.grant(minted))
        assert pool.queries == queries + 9  # every expired lookup still asks the database
        now[0] += 200.0  # the grant is now more than 600 s old
        with pytest.raises(StoreUnavailable):
            asyncio.run(tokens.grant(known))
        assert handler.events.count("auth_stale_grants") == 1  # once per outage

        pool.down = False
        assert asyncio.run(tokens.grant(known)) == grant
        assert asyncio.run(tokens.grant(minted)) == Grant(tenant_id="acme",
                                                           rpcs=frozenset({"*"}))
        assert asyncio.run(tokens.grant(revoked)) is None
        pool.down = True
        now[0] += 2.0
        assert asyncio.run(tokens.grant(minted)) is not None
        assert handler.events.count("auth_stale_grants") == 2  # the next outage logs again
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_flood_of_unknown_tokens_does_not_evict_known_grants() -> None:
    pool = FakePool()
    known = token_sha256("known")
    pool.rows[known] = {"token_sha256": known, "tenant_id": "acme", "rpcs": ["*"],
                        "revoked": False}
    now = [0.0]
    tokens = DatabaseTokens(pool, ttl=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert asyncio.run(tokens.grant(known)) is not None

    async def flood() -> None:
        for i in range(12_000):
            assert await tokens.grant(token_sha256(f"bad-{i}")) is None
    asyncio.run(flood())
    pool.down = True
    now[0] += 5.0
    assert asyncio.run(tokens.grant(known)) == Grant(tenant_id="acme", rpcs=frozenset({"*"}))


class GatedPool(FakePool):
    """A FakePool whose queries wait for ``gate`` and that counts the queries running at
    once, as a database with slow lookups would."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.running = 0
        self.most = 0
        self.started = 0

    async def fetchrow(self, sql: str, digest: str, *, timeout: float) -> Any:
        self.started += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.wait_for(self.gate.wait(), timeout)
            return await super().fetchrow(sql, digest, timeout=timeout)
        finally:
            self.running -= 1


def test_lookups_of_never_granted_tokens_run_a_bounded_few_at_once() -> None:
    """Distinct bad tokens take turns (two here) and never more of the pool; a token granted
    before is read again at once beside them; a new good token waits its turn and is served;
    a turn not had within the database timeout is StoreUnavailable, as a connection not had."""
    pool = GatedPool()
    now = [0.0]
    known, minted = token_sha256("known"), token_sha256("minted")
    for digest in (known, minted):
        pool.rows[digest] = {"token_sha256": digest, "tenant_id": "acme", "rpcs": ["*"],
                             "revoked": False}
    grant = Grant(tenant_id="acme", rpcs=frozenset({"*"}))

    async def scenario() -> None:
        tokens = DatabaseTokens(pool, ttl=1.0, command_timeout=5.0,  # type: ignore[arg-type]
                                lookups=2, clock=lambda: now[0])
        pool.gate.set()
        assert await tokens.grant(known) == grant
        pool.gate.clear()
        now[0] += 2.0  # its grant's TTL passed: the next call reads it again
        bad = [asyncio.ensure_future(tokens.grant(token_sha256(f"bad-{i}"))) for i in range(20)]
        new = asyncio.ensure_future(tokens.grant(minted))
        await asyncio.sleep(0.05)
        assert (pool.running, pool.started) == (2, 3)  # two turns; 19 calls wait, no query
        again = asyncio.ensure_future(tokens.grant(known))
        await asyncio.sleep(0.05)
        assert pool.running == 3  # the granted hash did not wait for a turn
        pool.gate.set()
        assert await again == grant
        assert await asyncio.gather(*bad) == [None] * 20
        assert await new == grant  # the new good token waited its turn
        assert pool.most == 3 and pool.started == 23

        pool.gate.clear()
        short = DatabaseTokens(pool, ttl=1.0, command_timeout=0.2,  # type: ignore[arg-type]
                               lookups=1, clock=lambda: now[0])
        first = asyncio.ensure_future(short.grant(token_sha256("slow")))
        await asyncio.sleep(0.05)
        sent = time.perf_counter()
        with pytest.raises(StoreUnavailable):  # no turn within 0.2 s
            await short.grant(token_sha256("behind"))
        assert 0.15 <= time.perf_counter() - sent < 1.0
        with pytest.raises(StoreUnavailable):  # its query timed out
            await first

    asyncio.run(scenario())


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False), ("example.com", False),
])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def serving(env: dict[str, str]) -> Config:
    config = Config.from_env(env)
    config.validate_serving()
    return config


def test_dev_mode_is_read_from_the_environment_and_allowed_on_loopback() -> None:
    assert serving({"CE_DEV_MODE": "1"}).dev_mode
    assert serving({"CE_DEV_MODE": "true", "CE_GRPC_ADDR": "[::1]:0"}).dev_mode
    assert not Config.from_env({"CE_DEV_MODE": "0"}).dev_mode
    with pytest.raises(ConfigError, match="CE_DEV_MODE"):
        Config.from_env({"CE_DEV_MODE": "maybe"})


@pytest.mark.parametrize(("env", "fragment"), [
    ({"CE_DEV_MODE": "1", "CE_GRPC_ADDR": "0.0.0.0:50051"}, "loopback"),
    ({"CE_DEV_MODE": "1", "CE_GRPC_ADDR": ":50051"}, "has no host"),
    ({"CE_DEV_MODE": "1", "CE_AUTH_DB_TOKENS": "1"}, "choose one"),
    ({}, "--dev"),
    ({"CE_GRPC_ADDR": "0.0.0.0:50051"}, "refusing to serve '0.0.0.0:50051' without credentials"),
    ({"CE_GRPC_ADDR": "[::]:50051"}, "without credentials"),
])
def test_a_server_without_credentials_refuses_to_start(env: dict[str, str],
                                                       fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        serving(env)


def test_any_token_source_makes_a_public_bind_acceptable(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[]")
    public = {"CE_GRPC_ADDR": "0.0.0.0:50051"}
    assert serving({**public, "CE_AUTH_DB_TOKENS": "1"}).auth_db_tokens
    assert serving({**public, "CE_AUTH_TOKENS_FILE": str(tokens)}).auth_tokens_file == tokens
    assert serving({"CE_AUTH_DB_TOKENS": "yes", "CE_AUTH_CACHE_SECONDS": "5"}
                   ).auth_cache_seconds == 5.0


def test_tls_files_come_in_pairs_and_must_exist(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    with pytest.raises(ConfigError, match="set together"):
        Config.from_env({"CE_TLS_CERT_FILE": str(cert)})
    with pytest.raises(ConfigError, match="mutual TLS"):
        Config.from_env({"CE_TLS_CLIENT_CA_FILE": str(cert)})
    with pytest.raises(ConfigError, match="CE_TLS_KEY_FILE"):
        Config.from_env({"CE_TLS_CERT_FILE": str(cert),
                         "CE_TLS_KEY_FILE": str(tmp_path / "missing.pem")})
    both = Config.from_env({"CE_TLS_CERT_FILE": str(cert), "CE_TLS_KEY_FILE": str(key),
                            "CE_TLS_CLIENT_CA_FILE": str(cert)})
    assert (both.tls_cert_file, both.tls_key_file, both.tls_client_ca_file) == (cert, key, cert)


def test_cli_serve_exits_2_with_a_clear_message(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    for name in ("CE_DEV_MODE", "CE_AUTH_TOKENS_FILE", "CE_AUTH_DB_TOKENS", "CE_GRPC_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["serve", "--grpc-addr", "0.0.0.0:0"]) == 2
    assert "without credentials" in capsys.readouterr().err
    assert cli.main(["serve", "--dev", "--grpc-addr", "0.0.0.0:0"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert cli.main(["serve"]) == 2
    assert "--dev" in capsys.readouterr().err
    bad = tmp_path / "tokens.json"
    bad.write_text(json.dumps([{"sha256": "00", "tenant_id": "t", "rpcs": ["*"]}]))
    monkeypatch.setenv("CE_AUTH_TOKENS_FILE", str(bad))
    assert cli.main(["serve"]) == 2
    assert "64 hex" in capsys.readouterr().err
    # a file of no token admitted no one, silently; with the token table on, it may. A
    # database nothing answers for: a serve that got past the check ends there, exit 1
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("DATABASE_URL", f"postgresql://ce@127.0.0.1:{port}/ce")
    monkeypatch.setenv("CE_GRPC_ADDR", "127.0.0.1:0")
    monkeypatch.setenv("CE_METRICS_ADDR", "")
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    monkeypatch.setenv("CE_AUTH_TOKENS_FILE", str(empty))
    assert cli.main(["serve"]) == 2
    assert "holds no token and CE_AUTH_DB_TOKENS is off" in capsys.readouterr().err
    monkeypatch.setenv("CE_AUTH_DB_TOKENS", "1")
    assert cli.main(["serve"]) == 1
    assert "holds no token" not in capsys.readouterr().err


def test_cli_hash_token_reads_stdin_and_mints_entries(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret-token\n"))
    assert cli.main(["hash-token"]) == 0
    assert capsys.readouterr().out.strip() == token_sha256("s3cret-token")
    assert cli.main(["hash-token", "--tenant-id", "acme", "--rpc", "Build",
                     "--rpc", "GetPlan"]) == 0
    minted = json.loads(capsys.readouterr().out)
    assert minted["entry"] == {"sha256": token_sha256(minted["token"]), "tenant_id": "acme",
                               "rpcs": ["Build", "GetPlan"]}
    assert len(minted["token"]) >= 40
    # the entry is exactly what a tokens file accepts
    assert parse_tokens([minted["entry"]], "minted")[0][1].allows("Build")
    assert cli.main(["hash-token", "--tenant-id", "acme", "--rpc", "Plna"]) == 2


@pytest.mark.parametrize(("args", "said"), [
    (["--rpc", "Build"], "--rpc goes with --tenant-id"),
    (["--tenant-id", " acme "], "--tenant-id must not contain control, format or line-sep"),
    (["--tenant-id", "acme\t"], "--tenant-id must not contain control, format or line-sep"),
    # no request could name it: minted, the token could call nothing
    (["--tenant-id", "t" * 257], "--tenant-id is 257 characters; at most 256"),
    (["--tenant-id", "acme", "--rpc", "*", "--rpc", "Build"], "goes alone"),
])
def test_cli_hash_token_refuses_what_it_would_have_ignored_or_minted_wrong(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        args: list[str], said: str) -> None:
    """--rpc without --tenant-id was dropped (the command hashed stdin instead), a padded
    tenant id was minted (purge-tenant refuses such an id), and "*" beside a name was kept."""
    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret-token\n"))
    assert cli.main(["hash-token", *args]) == 2
    out, err = capsys.readouterr()
    assert not out and said in err, err


def test_cli_hash_token_names_an_rpc_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["hash-token", "--tenant-id", "acme", "--rpc", "Build", "--rpc", "Build",
                     "--rpc", "GetPlan"]) == 0
    assert json.loads(capsys.readouterr().out)["entry"]["rpcs"] == ["Build", "GetPlan"]


LEGACY_TENANT = "acme\u200bcorp"  # a zero-width space: taken by the releases before


def test_a_tokens_file_naming_a_tenant_the_earlier_rule_took_still_loads(
        caplog: pytest.LogCaptureFixture) -> None:
    """Its sessions may be stored, and DeleteSession (which keeps that rule) erases them with
    this token: a serve that refused the file could not start after an upgrade."""
    caplog.set_level(logging.WARNING, logger="context_engine")
    ((_, grant),) = parse_tokens([{"sha256": "a" * 64, "tenant_id": LEGACY_TENANT,
                                   "rpcs": ["*"]}], "CE_AUTH_TOKENS_FILE")
    assert grant.tenant_id == LEGACY_TENANT
    warned = [r for r in caplog.records if r.getMessage() == "token_tenant_refused_by_requests"]
    assert len(warned) == 1
    check_tenant("DeleteSession", pb.DeleteSessionRequest(tenant_id=LEGACY_TENANT,
                                                          session_id="s"), grant)
    with pytest.raises(ConfigError, match="tenant_id must not contain C0"):  # never taken
        parse_tokens([{"sha256": "a" * 64, "tenant_id": "acme\x01", "rpcs": ["*"]}], "f")


def test_cli_hash_token_mints_an_erasing_token_for_a_tenant_the_earlier_rule_took(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["hash-token", "--tenant-id", LEGACY_TENANT, "--rpc", "DeleteSession"]) == 0
    minted = json.loads(capsys.readouterr().out)
    assert minted["entry"]["tenant_id"] == LEGACY_TENANT
    assert cli.main(["hash-token", "--tenant-id", LEGACY_TENANT, "--rpc", "Plan"]) == 2
    assert "--tenant-id must not contain" in capsys.readouterr().err


def test_tls_files_are_read_only_when_their_stat_changes(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC asks the fetcher on every handshake: unchanged files cost a stat, not a read."""
    import context_engine.api.auth as auth

    pki = make_pki(tmp_path, ca_name="test CA", server_alt_names="DNS:localhost")
    renewed = issue_server_cert(pki, tmp_path, name="renewed", server_alt_names="DNS:localhost")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    reads: list[Path] = []
    read_bytes = Path.read_bytes

    def counted(path: Path) -> bytes:
        if path in (cert, key):
            reads.append(path)
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", counted)
    monkeypatch.setattr(auth, "TLS_SETTLING_SECONDS", 0.0)  # no coarse-timestamp doubt here
    files = TlsFiles(Config().replace(tls_cert_file=cert, tls_key_file=key))
    reads.clear()
    assert [files.fetch() for _ in range(50)] == [None] * 50
    assert reads == []
    cert.write_bytes(renewed[0].read_bytes())
    key.write_bytes(renewed[1].read_bytes())
    assert isinstance(files.fetch(), grpc.ServerCertificateConfiguration)
    assert files.served.cert == renewed[0].read_bytes()
    reads.clear()
    assert [files.fetch() for _ in range(50)] == [None] * 50
    assert reads == []
    # a file just written may be rewritten within one timestamp tick: read until it settles
    monkeypatch.setattr(auth, "TLS_SETTLING_SECONDS", 3600.0)
    key.write_bytes(renewed[1].read_bytes())
    per_fetch = []
    for _ in range(3):
        reads.clear()
        assert files.fetch() is None  # the same pair: nothing new to serve
        per_fetch.append(reads.count(key))
    assert all(per_fetch), per_fetch


def test_grants_answer_for_their_ages_bounds_and_not_past_them() -> None:
    """A table grant is cached for ``ttl`` seconds (at exactly ``ttl`` old it is read again);
    while the table cannot be read, a grant at most ``stale`` seconds old answers, one older
    does not."""
    pool = FakePool()
    now = [0.0]
    digest = token_sha256("known")
    pool.rows[digest] = {"token_sha256": digest, "tenant_id": "acme", "rpcs": ["Build"],
                         "revoked": False}
    tokens = DatabaseTokens(pool, ttl=30.0, stale=600.0,  # type: ignore[arg-type]
                            clock=lambda: now[0])
    grant = Grant(tenant_id="acme", rpcs=frozenset({"Build"}))
    assert asyncio.run(tokens.grant(digest)) == grant and pool.queries == 1
    now[0] = 29.75
    assert asyncio.run(tokens.grant(digest)) == grant and pool.queries == 1  # cached
    now[0] = 30.0
    assert asyncio.run(tokens.grant(digest)) == grant and pool.queries == 2  # read again
    pool.down = True
    now[0] = 630.0  # the grant read at 30.0 is exactly 600 s old: at most stale, answered
    assert asyncio.run(tokens.grant(digest)) == grant
    now[0] = 630.25
    with pytest.raises(StoreUnavailable):
        asyncio.run(tokens.grant(digest))


def test_never_granted_lookups_take_a_quarter_of_the_pool() -> None:
    assert [token_lookups(n) for n in (1, 3, 4, 7, 8, 20, 40)] == [1, 1, 1, 1, 2, 5, 10]


def test_the_caller_an_erasure_records_is_the_token_hash_s_first_12_hex() -> None:
    # sha256(b"abc"), the FIPS 180-2 test vector: ba7816bf8f01cfea...
    assert caller_of([("authorization", "Bearer abc")]) == "token:ba7816bf8f01"
    assert caller_of([]) == "token:unknown"


def test_each_token_cache_holds_10000_hashes_and_drops_the_oldest() -> None:
    """The README's bound: grants and misses are each kept for at most 10,000 hashes per
    process, the oldest dropped first (a flood of misses cannot grow the process without
    limit). 10,001 hashes remembered leave the last 10,000."""
    from context_engine.api import auth

    entries: dict[str, tuple[object, float]] = {}
    digests = [hashlib.sha256(str(n).encode()).hexdigest() for n in range(10_001)]
    for n, digest in enumerate(digests):
        auth._remember(entries, digest, True, float(n))
    assert len(entries) == 10_000
    assert digests[0] not in entries
    assert digests[1] in entries and digests[-1] in entries
    # remembering a hash again moves it to the newest end: the next one pushes out digests[2]
    auth._remember(entries, digests[1], False, 10_001.0)
    auth._remember(entries, hashlib.sha256(b"another").hexdigest(), True, 10_002.0)
    assert digests[1] in entries and digests[2] not in entries and len(entries) == 10_000
