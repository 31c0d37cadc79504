"""Who may call what: bearer tokens bound to one tenant and a set of RPCs, checked by a server
interceptor before a request reaches the servicer; and the server's TLS credentials.

* A token travels as ``authorization: Bearer <token>`` metadata. The server knows only its
  SHA-256 (a tokens file, ``CE_AUTH_TOKENS_FILE``, and/or the ``api_tokens`` table when
  ``CE_AUTH_DB_TOKENS=1``), so neither a leaked configuration nor a database dump can be
  replayed. Hashes are compared in constant time.
* Missing, malformed, unknown or revoked token: ``UNAUTHENTICATED``. A known token calling an RPC
  it is not granted: ``PERMISSION_DENIED`` (``RPC_NOT_ALLOWED``). A request whose ``tenant_id``
  is not the token's tenant: ``PERMISSION_DENIED`` (``TENANT_MISMATCH``), checked on the
  deserialized request before the servicer reads or writes anything. A request whose bytes do
  not decode names no tenant: once its caller is authenticated, the servicer refuses it
  (``INVALID_ARGUMENT``) without reading anything.
* While PostgreSQL is away, a table token is answered from the last grant this process read
  for it, if that is at most ``STALE_GRANT_SECONDS`` old, so Build keeps serving cached plans;
  a token seen revoked stays refused, and any other token is ``UNAVAILABLE``. Any other
  failure of the check (a database error that is no outage, e.g. the service's role denied
  the table) is ``INTERNAL`` (``internal error``), logged with its type, as in the servicer.
* Health and reflection stay open: probes and tooling carry no credentials.
* The token itself never reaches a log line, a span or an error; only its RPC and tenant do.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import asyncpg
import grpc
from opentelemetry.trace import Tracer

from context_engine.adapters.postgres.errors import translated
from context_engine.api.rpc_metrics import cancelled_code
from context_engine.api.servicer import CALLER, Undecodable
from context_engine.api.status import ended, internal_status, refuse, status_for, timed_call
from context_engine.clock import SYSTEM_CLOCK, Clock, time_ns
from context_engine.config import Config, ConfigError
from context_engine.domain.errors import StoreUnavailable
from context_engine.domain.identifiers import erasable_identifier_problem, identifier_problem
from context_engine.telemetry.logs import log
from context_engine.telemetry.metrics import Metrics
from context_engine.v1 import context_engine_pb2 as pb

SERVICE_PREFIX = "/context_engine.v1.ContextEngine/"
# Services every caller may reach without credentials.
OPEN_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
ALL_RPCS = "*"
RPC_NAMES = frozenset(pb.DESCRIPTOR.services_by_name["ContextEngine"].methods_by_name)
# matched whole (``fullmatch``): "$" would also take a hash followed by a line break
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# How long an unknown token's miss is remembered: short, so a token inserted after a failed
# attempt works soon, yet a flood of bad tokens does not become a flood of queries.
NEGATIVE_TTL_SECONDS = 2.0
# How old a table grant may be and still answer while the database is unreachable: long enough
# to ride out a failover or a restart, short enough that a token revoked just before an outage
# (and not yet seen revoked here) does not outlive it by much.
STALE_GRANT_SECONDS = 600.0
_CACHE_ENTRIES = 10_000

# The one query of the token table (hash lookup; a revoked row says so).
LOOKUP_TOKEN = """
SELECT token_sha256, tenant_id, rpcs, revoked_at IS NOT NULL AS revoked FROM api_tokens
WHERE token_sha256 = $1"""


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a token's UTF-8 bytes: what the server stores and compares."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class Grant:
    """What one token may do: RPCs (``*`` for all) of exactly one tenant."""

    tenant_id: str
    rpcs: frozenset[str]

    def allows(self, rpc: str) -> bool:
        return ALL_RPCS in self.rpcs or rpc in self.rpcs


class TokenSource(Protocol):
    async def grant(self, digest: str) -> Grant | None:
        """The grant of the token whose SHA-256 hex is ``digest``; None if unknown/revoked."""
        ...


def _grant(tenant_id: Any, rpcs: Any, where: str) -> Grant:
    if not isinstance(tenant_id, str) or not tenant_id:
        raise ConfigError(f"{where}: tenant_id must be a non-empty string")
    problem = erasable_identifier_problem(tenant_id)
    if problem is not None:  # every request naming it would be refused
        raise ConfigError(f"{where}: tenant_id {problem}")
    if identifier_problem(tenant_id) is not None:
        # a tenant id the releases before the current rule took: its sessions may be stored,
        # and DeleteSession (which keeps that rule) can still erase them with this token;
        # every other request naming it is refused
        log("token_tenant_refused_by_requests", logging.WARNING, where=where,
            note="the tenant id holds a control, format or line-separator character: this "
                 "token can erase its sessions (DeleteSession), and no other request names it")
    if (not isinstance(rpcs, list) or not rpcs
            or not all(isinstance(r, str) for r in rpcs)):
        raise ConfigError(f"{where}: rpcs must be a non-empty list of RPC names or [\"*\"]")
    unknown = sorted(set(rpcs) - RPC_NAMES - {ALL_RPCS})
    if unknown:  # a typo would silently grant nothing
        raise ConfigError(f"{where}: unknown RPC names {unknown}; known: {sorted(RPC_NAMES)}")
    return Grant(tenant_id=tenant_id, rpcs=frozenset(rpcs))


def parse_tokens(document: Any, where: str) -> list[tuple[str, Grant]]:
    """``[{"sha256": "<hex>", "tenant_id": "...", "rpcs": ["*"]}, ...]`` -> (digest, grant)."""
    if not isinstance(document, list):
        raise ConfigError(f"{where}: expected a JSON list of token entries")
    entries: list[tuple[str, Grant]] = []
    seen: set[str] = set()
    for index, entry in enumerate(document):
        at = f"{where}[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: expected an object with sha256, tenant_id and rpcs")
        extra = sorted(set(entry) - {"sha256", "tenant_id", "rpcs", "description"})
        if extra:
            raise ConfigError(f"{at}: unknown keys {extra} (a plaintext token never belongs "
                              "here: store its sha256)")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.lower()):
            raise ConfigError(f"{at}: sha256 must be 64 hex characters")
        digest = digest.lower()
        if digest in seen:
            raise ConfigError(f"{at}: the same token hash appears twice")
        seen.add(digest)
        entries.append((digest, _grant(entry.get("tenant_id"), entry.get("rpcs"), at)))
    return entries


class FileTokens:
    """Tokens from a JSON file, read once at start-up."""

    def __init__(self, entries: Iterable[tuple[str, Grant]]) -> None:
        self._entries = [(bytes.fromhex(d), g) for d, g in entries]

    @classmethod
    def load(cls, path: Path) -> FileTokens:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"CE_AUTH_TOKENS_FILE={str(path)!r} cannot be read: "
                              f"{exc.strerror}") from exc
        except ValueError as exc:
            raise ConfigError(f"CE_AUTH_TOKENS_FILE={str(path)!r} is not valid JSON") from exc
        return cls(parse_tokens(document, "CE_AUTH_TOKENS_FILE"))

    def __len__(self) -> int:
        return len(self._entries)

    async def grant(self, digest: str) -> Grant | None:
        presented = bytes.fromhex(digest)
        found: Grant | None = None
        for stored, grant in self._entries:  # every entry, no early exit: constant time
            if hmac.compare_digest(stored, presented):
                found = grant
        return found


def _remember(entries: dict[str, tuple[Any, float]], digest: str, value: Any,
              now: float) -> None:
    entries.pop(digest, None)
    if len(entries) >= _CACHE_ENTRIES:  # drop the oldest entry (insertion order)
        entries.pop(next(iter(entries)))
    entries[digest] = (value, now)


class DatabaseTokens:
    """Tokens from the ``api_tokens`` table, cached per hash for ``ttl`` seconds: a revocation
    (``revoked_at`` set, or the row deleted) takes effect within ``ttl`` on every replica.

    When the lookup fails because the database is unreachable, the last grant read for the
    hash answers if it is at most ``stale`` seconds old (logged once per outage); a hash last
    seen revoked stays refused; anything else raises ``StoreUnavailable``. Grants and misses
    are kept apart, so a flood of unknown tokens cannot push the known grants out.

    A lookup waits at most ``command_timeout`` for a connection of the pool, and its query as
    long, as the store's calls do: past it, ``StoreUnavailable``. Lookups of hashes this
    process has never granted (every bad token's) run at most ``lookups`` at once, their wait
    for a turn within that same deadline: a flood of distinct bad tokens, which the miss cache
    cannot answer, holds at most ``lookups`` connections of the pool, never all of it. A hash
    granted here before (its grant's TTL passed) is read again without waiting for a turn, so
    such a flood never delays a token in use."""

    def __init__(self, pool: asyncpg.Pool, *, ttl: float, command_timeout: float = 5.0,
                 lookups: int = 1, stale: float = STALE_GRANT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._turns = asyncio.Semaphore(lookups)  # lookups of hashes never granted here
        self._ttl = ttl
        self._negative_ttl = min(ttl, NEGATIVE_TTL_SECONDS)
        self._timeout = command_timeout
        self._stale = stale
        self._clock = clock
        # hash -> (grant, when it was read) / (revoked?, when the miss was read)
        self._grants: dict[str, tuple[Grant, float]] = {}
        self._misses: dict[str, tuple[bool, float]] = {}
        self._serving_stale = False  # an outage is being ridden out on stale grants

    async def grant(self, digest: str) -> Grant | None:
        now = self._clock()
        known = self._grants.get(digest)
        if known is not None and now - known[1] < self._ttl:
            return known[0]
        miss = self._misses.get(digest)
        if miss is not None and now - miss[1] < self._negative_ttl:
            return None
        try:
            async with translated():
                row = await self._lookup(digest, granted_before=known is not None)
        except StoreUnavailable:
            return self._while_unavailable(digest, known, miss, now)
        self._serving_stale = False
        if row is not None and hmac.compare_digest(str(row["token_sha256"]), digest):
            if not row["revoked"]:
                found = Grant(tenant_id=row["tenant_id"], rpcs=frozenset(row["rpcs"]))
                self._misses.pop(digest, None)
                _remember(self._grants, digest, found, now)
                return found
            revoked = True
        else:
            revoked = False
        self._grants.pop(digest, None)
        _remember(self._misses, digest, revoked, now)
        return None

    async def _lookup(self, digest: str, *, granted_before: bool) -> Any:
        async with contextlib.AsyncExitStack() as held:
            async with asyncio.timeout(self._timeout):  # a turn and a connection, in time
                if not granted_before:
                    await held.enter_async_context(self._turns)
                conn = await held.enter_async_context(self._pool.acquire())
            return await conn.fetchrow(LOOKUP_TOKEN, digest, timeout=self._timeout)

    def _while_unavailable(self, digest: str, known: tuple[Grant, float] | None,
                           miss: tuple[bool, float] | None, now: float) -> Grant | None:
        if miss is not None and miss[0]:
            return None  # seen revoked: an outage never brings a token back
        if known is None or now - known[1] > self._stale:
            raise StoreUnavailable("database unavailable and no recent grant for this token")
        if not self._serving_stale:
            self._serving_stale = True
            log("auth_stale_grants", logging.WARNING, max_age_seconds=self._stale,
                why="the token table cannot be read: answering from grants read before")
        return known[0]


class Denied(Exception):
    """An authentication or authorization failure, carried to the caller as a rich status."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str,
                 metadata: dict[str, str]) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.metadata = code, reason, message, metadata


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the ``authorization: Bearer <token>`` entry; None when absent or another
    scheme. More than one authorization entry is ambiguous and counts as none."""
    values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if len(values) != 1:
        return None
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class Authenticator:
    def __init__(self, sources: Sequence[TokenSource]) -> None:
        self._sources = tuple(sources)

    async def grant_for(self, rpc: str, metadata: Sequence[tuple[str, str | bytes]] | None
                        ) -> Grant:
        """The caller's grant for ``rpc``; raises Denied. The token is never part of it."""
        token = bearer_token(metadata)
        if token is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED",
                         "missing credentials: send 'authorization: Bearer <token>' metadata",
                         {"rpc": rpc})
        digest = token_sha256(token)
        grant = None
        for source in self._sources:
            grant = await source.grant(digest)
            if grant is not None:
                break
        if grant is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED",
                         "unknown or revoked token", {"rpc": rpc})
        if not grant.allows(rpc):
            raise Denied(grpc.StatusCode.PERMISSION_DENIED, "RPC_NOT_ALLOWED",
                         f"this token may not call {rpc}",
                         {"rpc": rpc, "tenant_id": grant.tenant_id})
        return grant


def caller_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """Who an authenticated call came from, as an erasure records it: ``token:`` and the first
    12 hex of the token's SHA-256 (``api_tokens.token_sha256`` and the tokens file hold it in
    full), never the token."""
    token = bearer_token(metadata)
    return "token:" + (token_sha256(token)[:12] if token is not None else "unknown")


def check_tenant(rpc: str, request: Any, grant: Grant) -> None:
    """The request names the token's tenant, or it is refused before anything is read. A
    request that did not decode names nothing: the servicer refuses it (INVALID_ARGUMENT)
    without reading anything, so it passes here once its caller is authenticated."""
    if isinstance(request, Undecodable):
        return
    fields = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    requested = request.tenant_id if "tenant_id" in fields else None
    if requested != grant.tenant_id:
        raise Denied(grpc.StatusCode.PERMISSION_DENIED, "TENANT_MISMATCH",
                     "the request's tenant_id is not the tenant of this token",
                     {"rpc": rpc, "tenant_id": str(requested or ""),
                      "token_tenant_id": grant.tenant_id})


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every ContextEngine RPC and binds it to the token's tenant. The handler is
    wrapped (not the servicer changed): the tenant check needs the deserialized request."""

    def __init__(self, authenticator: Authenticator, metrics: Metrics | None = None,
                 tracer: Tracer | None = None) -> None:
        self._auth = authenticator
        self._metrics = metrics
        self._tracer = tracer

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if handler.unary_unary is None:
            # Only unary RPCs can be tenant-checked before the servicer runs: refuse the rest
            # (answered UNIMPLEMENTED) rather than serve them unchecked.
            return None
        inner: Callable[..., Awaitable[Any]] = handler.unary_unary
        rpc = method.rsplit("/", 1)[-1]
        metadata = tuple(handler_call_details.invocation_metadata or ())

        async def authorized(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with timed_call():  # the lookup below is the call's time too
                return await checked(request, context)

        async def checked(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                grant = await self._auth.grant_for(rpc, metadata)
                check_tenant(rpc, request, grant)
            except asyncio.CancelledError:
                # its deadline passed, or its caller gave up, during the token lookup: ended
                # with that code in its log line and latency sample, as one cancelled under
                # the servicer is (the gRPC server metrics count it so too)
                code = cancelled_code(context)
                ended(context, self._metrics, method=rpc, code=code, reason=code.name,
                      tracer=self._tracer)
                raise
            except Denied as denied:
                await self._abort(context, rpc, denied.code, denied.reason, denied.message,
                                  denied.metadata)
            except StoreUnavailable as exc:
                code, status = status_for(exc)
                await self._abort(context, rpc, code, exc.reason, status.message, {})
            except Exception:
                # a defect, or a database error that is no outage (the service's role refused
                # the token table): answered as the servicer answers one, not as gRPC's UNKNOWN
                # carrying the exception's class and text, with no status and no log line
                logging.getLogger("context_engine").exception(
                    "unhandled error in %s (credentials check)", rpc)
                code, status = internal_status()
                await self._abort(context, rpc, code, "INTERNAL", status.message, {})
            caller = CALLER.set(caller_of(metadata))
            try:
                return await inner(request, context)
            finally:
                CALLER.reset(caller)

        return grpc.unary_unary_rpc_method_handler(
            authorized, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any], rpc: str,
                     code: grpc.StatusCode, reason: str, message: str,
                     metadata: dict[str, str]) -> None:
        await refuse(context, self._metrics, method=rpc, code=code, reason=reason,
                     message=message, metadata=metadata, tenant=metadata.get("tenant_id", ""),
                     tracer=self._tracer)


def token_lookups(pool_size: int) -> int:
    """How many lookups of token hashes never granted before one process runs at once: a
    quarter of its pool (at least one), so bad tokens leave the rest to authenticated calls."""
    return max(1, pool_size // 4)


def auth_interceptor(config: Config, pool: asyncpg.Pool, metrics: Metrics | None = None,
                     tracer: Tracer | None = None) -> AuthInterceptor | None:
    """None in dev mode (no credentials). Otherwise an interceptor over the configured token
    sources; with none configured every call is refused (the CLI refuses to start earlier)."""
    if config.dev_mode:
        return None
    sources: list[TokenSource] = []
    if config.auth_tokens_file is not None:
        sources.append(FileTokens.load(config.auth_tokens_file))
    if config.auth_db_tokens:
        sources.append(DatabaseTokens(pool, ttl=config.auth_cache_seconds,
                                      command_timeout=config.db_timeout_seconds,
                                      lookups=token_lookups(config.db_pool_size)))
    return AuthInterceptor(Authenticator(sources), metrics, tracer)


def _read(path: Path, name: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}={str(path)!r} cannot be read: {exc.strerror}") from exc


# A file written this recently may be written again within the same filesystem timestamp tick
# (same size, same mtime): until it is older, an unchanged stat does not vouch for its content,
# so the handshakes of these seconds read it again.
TLS_SETTLING_SECONDS = 2.0


@dataclass(frozen=True)
class TlsPems:
    """The contents of the TLS files: certificate chain, key, client CA (mutual TLS)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None


def certificate_sha256(cert: bytes) -> str:
    """SHA-256 of the first (leaf) certificate's DER in a PEM chain, in hex: what
    ``openssl x509 -noout -fingerprint -sha256`` prints, without colons."""
    text = cert.decode("ascii", "replace")
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    try:
        leaf = text[text.index(begin):text.index(end) + len(end)]
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(leaf)).hexdigest()
    except ValueError:
        return "unknown"


class TlsFiles:
    """The server's certificate, key and client CA as files that may be renewed in place
    (cert-manager, a Kubernetes Secret volume), served without a restart. ``fetch`` is gRPC's
    certificate configuration fetcher, called on every TLS handshake: it stats the files and
    reads nothing while they are unchanged; when they changed it reads and checks them as
    ``serve`` does at start (``Config.tls_problems``) and hands gRPC the new pair for that
    handshake and the next ones. A version that does not load (a file missing or cut short, a
    certificate written before its key) is never served: the last good one stays, and the
    version is logged once as ``tls_files_rejected``. Connections already open keep the
    certificate they shook hands with."""

    def __init__(self, config: Config, clock: Clock = SYSTEM_CLOCK) -> None:
        if config.tls_cert_file is None or config.tls_key_file is None:
            raise ValueError("TlsFiles needs CE_TLS_CERT_FILE and CE_TLS_KEY_FILE")
        self._config = config
        self._clock = clock
        self._paths = [config.tls_cert_file, config.tls_key_file,
                       *([config.tls_client_ca_file] if config.tls_client_ca_file else [])]
        self._lock = threading.Lock()
        stamp = self._stamp()
        self.served = TlsPems(
            cert=_read(config.tls_cert_file, "CE_TLS_CERT_FILE"),
            key=_read(config.tls_key_file, "CE_TLS_KEY_FILE"),
            client_ca=(None if config.tls_client_ca_file is None
                       else _read(config.tls_client_ca_file, "CE_TLS_CLIENT_CA_FILE")))
        # the version whose stat needs no further look (the served or a rejected one)
        self._unchanged = stamp if self._settled(stamp) else None
        self._rejected: object = None  # the last version logged as rejected

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """The served version as a gRPC configuration (a new one each time: gRPC takes it)."""
        return grpc.ssl_server_certificate_configuration(
            [(self.served.key, self.served.cert)], root_certificates=self.served.client_ca)

    def _stamp(self) -> tuple[tuple[int, ...], ...]:
        stamps: list[tuple[int, ...]] = []
        for path in self._paths:
            try:
                st = path.stat()
            except OSError as exc:
                stamps.append((-1, exc.errno or 0))
            else:
                stamps.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                               st.st_ctime_ns))
        return tuple(stamps)

    def _settled(self, stamp: tuple[tuple[int, ...], ...]) -> bool:
        now = time_ns(self._clock)  # the files' times are the wall clock's
        return all(s[0] == -1 or now - max(s[3], s[4]) >= TLS_SETTLING_SECONDS * 1e9
                   for s in stamp)

    def _read(self) -> TlsPems | None:
        try:
            contents = [path.read_bytes() for path in self._paths]
        except OSError:
            return None
        return TlsPems(cert=contents[0], key=contents[1],
                       client_ca=contents[2] if len(contents) > 2 else None)

    def _load(self) -> tuple[TlsPems | None, list[str]]:
        """(the files' contents, what keeps them from loading). No contents and no problem:
        they changed while checked, so the next handshake looks again."""
        before = self._read()
        problems = self._config.tls_problems()
        if before is None or before != self._read():
            return None, problems
        return before, problems

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files hold a new good version, None to
        keep serving the current one."""
        stamp = self._stamp()
        with self._lock:
            if stamp == self._unchanged:
                return None
            pems, problems = self._load()
            if pems is None and not problems:
                return None
            new = None
            if problems:
                version = (stamp, pems)
                if version != self._rejected:
                    self._rejected = version
                    log("tls_files_rejected", logging.WARNING, problem="; ".join(problems),
                        serving_sha256=certificate_sha256(self.served.cert))
            elif pems is not None and pems != self.served:
                self.served = pems
                new = self.configuration()
                log("tls_files_reloaded", certificate_sha256=certificate_sha256(pems.cert))
            if self._settled(stamp):
                self._unchanged = stamp
            return new


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS when a certificate is configured; mutual TLS (client certificates required and
    verified against the CA) when a client CA is configured too; None for plaintext. The files
    are watched (``TlsFiles``): a renewed certificate, key or CA is served from the next
    handshake on, without a restart."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    files = TlsFiles(config)
    return grpc.dynamic_ssl_server_credentials(
        files.configuration(),
        files.fetch,  # type: ignore[arg-type]  # None means unchanged to gRPC; not to its stub
        require_client_authentication=config.tls_client_ca_file is not None)
