"""What both clients share: the retry policy, channel options and metadata."""

from __future__ import annotations

import ipaddress
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import grpc
from google.protobuf.message import Message

from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as pb
from context_engine_client.errors import DeadlineExceeded

SERVICE = "context_engine.v1.ContextEngine"
DEFAULT_TIMEOUT = 10.0
# Compact calls an LLM summarizer, at most twice: the service gives each call 20 s by default
# (CE_SUMMARIZER_TIMEOUT_SECONDS), so its default deadline leaves room for both.
DEFAULT_COMPACT_TIMEOUT = 60.0
# The service accepts 64 MiB by default; a 1,000-item conversation is about 3 MB.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024



# Retried only when the request carries an idempotency key: the plain channel's service config
# does not retry them; a second channel whose config lists them too carries the keyed requests.
KEYED = frozenset({"Rotate", "ReportUsage", "Compact"})
_SERVICE = pb.DESCRIPTOR.services_by_name["ContextEngine"]


def check_request(method: str, request: Message) -> None:
    """A TypeError unless ``request`` is the request message of ``method`` (the generated
    stubs would serialize any message)."""
    expected = _SERVICE.methods_by_name[method].input_type
    if request.DESCRIPTOR is not expected:
        raise TypeError(f"{method} takes a {expected.name}, not a {type(request).__name__}")


def has_idempotency_key(request: Message) -> bool:
    return bool(getattr(request, "idempotency_key", ""))


def _seconds(duration: str) -> float:
    if not duration.endswith("s"):
        raise ValueError(f"not a service config duration: {duration!r}")
    return float(duration[:-1])


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """The service config's retry policy, as gRPC applies it: attempts (the first included),
    exponential backoff with full jitter, only the listed codes."""

    max_attempts: int
    initial_backoff: float
    max_backoff: float
    backoff_multiplier: float
    retryable_codes: frozenset[grpc.StatusCode]


def service_config_text() -> str:
    """The packaged copy of ``clients/retry_service_config.json``."""
    return (resources.files("context_engine_client") / "retry_service_config.json").read_text(
        encoding="utf-8")


def retry_policy(config_text: str) -> RetryPolicy | None:
    """The retry policy of the service config (one policy for every retried method; it is
    also the keyed writes' policy), or None when the config retries nothing."""
    config = json.loads(config_text)
    policies = [m["retryPolicy"] for m in config.get("methodConfig", ()) if "retryPolicy" in m]
    if len(policies) > 1:
        raise ValueError("the service config must hold at most one retryPolicy: it is also the "
                         "policy of the writes that carry an idempotency key")
    if not policies:
        return None
    p = policies[0]
    return RetryPolicy(max_attempts=int(p["maxAttempts"]),
                       initial_backoff=_seconds(p["initialBackoff"]),
                       max_backoff=_seconds(p["maxBackoff"]),
                       backoff_multiplier=float(p["backoffMultiplier"]),
                       retryable_codes=frozenset(grpc.StatusCode[c]
                                                 for c in p["retryableStatusCodes"]))


def _is_keyed(name: dict[str, Any]) -> bool:
    return name.get("service") == SERVICE and name.get("method") in KEYED


def _covers_keyed(name: dict[str, Any]) -> int:
    """How an entry's name covers the keyed RPCs without naming them: 2 for the service (every
    method of it), 1 for every service (the default), 0 not at all."""
    if name.get("method"):
        return 0
    return 2 if name.get("service") == SERVICE else 1 if not name.get("service") else 0


def _split_keyed(entries: list[dict[str, Any]],
                 settings: Callable[[dict[str, Any]], dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], set[str]]:
    """``entries`` with the keyed RPCs each names in an entry of their own, holding
    ``settings`` of it (gRPC refuses a config naming a method twice), the other names as they
    were; and which keyed RPCs are named."""
    method_config: list[dict[str, Any]] = []
    named: set[str] = set()
    for entry in entries:
        names = entry.get("name", [])
        keyed = [n for n in names if _is_keyed(n)]
        others = [n for n in names if not _is_keyed(n)]
        if others:
            method_config.append({**entry, "name": others})
        if keyed:
            method_config.append({**settings(entry), "name": keyed})
            named.update(n["method"] for n in keyed)
    return method_config, named


# what sends a call more than once: retries, and hedging (grpc-js hedges)
_SENT_AGAIN = frozenset({"retryPolicy", "hedgingPolicy"})


def _wide_entry(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The entry gRPC applies to the keyed RPCs where none names them: the most specific one
    naming their service, or every service."""
    wide: tuple[int, dict[str, Any]] | None = None
    for entry in entries:
        cover = max((_covers_keyed(n) for n in entry.get("name", [])), default=0)
        if cover and (wide is None or cover > wide[0]):
            wide = (cover, entry)
    return None if wide is None else wide[1]


def unkeyed_service_config(config_text: str) -> str:
    """The service config of the channel for every other request: the RPCs in :data:`KEYED`,
    sent there without their key, never retried nor hedged, whatever the config (a keyed RPC
    named with a retry or hedging policy, or a service-wide or default entry holding one: gRPC
    applies that to every method the config names nowhere else). Each keeps the entry's other
    settings."""
    config = json.loads(config_text)
    entries = config.get("methodConfig", [])
    method_config, named = _split_keyed(
        entries, lambda entry: {k: v for k, v in entry.items() if k not in _SENT_AGAIN})
    wide = _wide_entry(entries)
    missing = sorted(KEYED - named)
    if missing and wide is not None and _SENT_AGAIN & set(wide):
        method_config.append({**{k: v for k, v in wide.items() if k not in _SENT_AGAIN},
                              "name": [{"service": SERVICE, "method": m} for m in missing]})
    config["methodConfig"] = method_config
    return json.dumps(config)


def keyed_service_config(config_text: str) -> str:
    """The service config of the channel for keyed requests: the RPCs in :data:`KEYED` under
    the config's retry policy (an entry that names one keeps its other settings: gRPC refuses a
    config naming a method twice; those no entry names keep the settings of the service-wide
    or default entry that covers them). Unchanged when the config retries nothing."""
    config = json.loads(config_text)
    entries = config.get("methodConfig", [])
    policy = next((m["retryPolicy"] for m in entries if "retryPolicy" in m), None)
    if policy is None:
        return json.dumps(config)
    # a keyed write named with a hedging policy is hedged (its key makes that safe): gRPC
    # refuses an entry holding both policies
    method_config, named = _split_keyed(
        entries, lambda entry: entry if "hedgingPolicy" in entry
        else {**entry, "retryPolicy": entry.get("retryPolicy", policy)})
    missing = sorted(KEYED - named)
    if missing:  # with the settings of the entry gRPC would apply to them (a deadline, a size)
        wide = _wide_entry(entries) or {}
        method_config.append({**{k: v for k, v in wide.items() if k not in _SENT_AGAIN},
                              "name": [{"service": SERVICE, "method": m} for m in missing],
                              "retryPolicy": wide.get("retryPolicy", policy)})
    config["methodConfig"] = method_config
    return json.dumps(config)


def channel_options(*, config_text: str, max_message_bytes: int,
                    server_name: str | None) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", json.dumps(json.loads(config_text))),
        ("grpc.enable_retries", 1),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A request is retried only while it is still buffered; Build requests are large.
        ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def is_loopback(target: str) -> bool:
    """Whether every address ``target`` names is on this machine: a Unix socket, localhost, or
    a loopback IP (``127.0.0.0/8``, ``::1``), with or without a ``dns:``/``ipv4:``/``ipv6:``
    scheme. Anything else, a name resolved elsewhere included, is not."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    rest = target
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme):]
            break
    if not rest:
        return False
    for address in rest.split(","):
        if address.startswith("["):  # [v6]:port
            host = address[1:address.find("]")] if "]" in address else ""
        elif address.count(":") > 1:  # a bare IPv6 address (ipv6: scheme), no port
            host = address
        else:
            host = address.rpartition(":")[0] if ":" in address else address
        if host.lower() == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return True


def token_transport_options(*, target: str, token: str | None, tls: bool | None,
                            encrypted: bool) -> tuple[tuple[str, Any], ...]:
    """A token is sent in plaintext off this machine only when asked for by ``tls=False``:
    left unset, ``tls`` means plaintext to a loopback target and refuses a token anywhere
    else. In plaintext to a loopback target the channel goes straight (no proxy of the
    environment: it would carry the token elsewhere). The channel options that rule needs."""
    if token is None or encrypted:
        return ()
    if is_loopback(target):
        # neither the proxy of http_proxy/https_proxy/grpc_proxy nor grpc's address-level one
        # (GRPC_ADDRESS_HTTP_PROXY: enabled here for no address; an empty proxy address
        # instead would be logged as an unparsable GRPC_ADDRESS_HTTP_PROXY on every channel)
        return (("grpc.enable_http_proxy", 0), ("grpc.address_http_proxy_enabled_addresses", ""))
    if tls is False:  # deliberate: a hop another layer encrypts, a service-mesh sidecar's
        return ()
    raise ValueError(
        f"the token would travel in plaintext to {target}, which is not on this machine: "
        "pass tls=True (or a certificate) for TLS, or tls=False to send it in plaintext "
        "deliberately (e.g. to a service-mesh sidecar that encrypts the hop)")


def credentials(*, tls: bool | None, root_certificates: bytes | None,
                client_certificate_chain: bytes | None,
                client_private_key: bytes | None) -> grpc.ChannelCredentials | None:
    """Channel credentials, or None for plaintext. Any certificate turns TLS on; a client
    certificate needs its key (mutual TLS)."""
    if (client_certificate_chain is None) != (client_private_key is None):
        raise ValueError("client_certificate_chain and client_private_key go together")
    if not (tls or root_certificates or client_certificate_chain):
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates,
                                        private_key=client_private_key,
                                        certificate_chain=client_certificate_chain)


Metadata = Sequence[tuple[str, str | bytes]]


# What gRPC sends as a metadata key: lower-case letters, digits, "_", "." and "-" (and not
# its own "grpc-" keys); a value, unless the key ends in "-bin", is printable ASCII. Anything
# else fails the call inside gRPC, after the client has taken it: INTERNAL from the blocking
# client (which the service answers only for its own defects), an untyped error from asyncio.
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    if token is None:
        return ()
    if not token or not _printable_ascii(token):
        raise ValueError("the token must be one non-empty line of printable ASCII (it is sent "
                         "in the authorization header)")
    return (("authorization", f"Bearer {token}"),)


def merge_metadata(base: tuple[tuple[str, str], ...],
                   extra: Metadata | None) -> tuple[tuple[str, str | bytes], ...]:
    """The client's metadata (its token) followed by one call's own (trace context, request
    ids). A call cannot replace the client's credentials: ``authorization`` is refused there."""
    if not extra:
        return base
    for key, value in extra:
        name = key.lower()
        if name == "authorization":
            raise ValueError("pass the token to the client, not as call metadata")
        if not _METADATA_KEY.fullmatch(name) or name.startswith("grpc-"):
            raise ValueError(f"call metadata key {key!r}: letters, digits, '_', '.' and '-' "
                             "only, and not a 'grpc-' key")
        text = value if isinstance(value, str) else value.decode("latin-1")
        if not name.endswith("-bin") and not _printable_ascii(text):
            raise ValueError(f"call metadata {key!r}: a value is printable ASCII unless its "
                             "key ends in '-bin' (which takes any bytes)")
    return (*base, *((key.lower(), value) for key, value in extra))


# The longest timeout taken (about 31.7 years): gRPC takes an infinite one as none at all, and
# one past about 7e9 s overflows its clock into a deadline already passed, failing at once.
MAX_TIMEOUT = 1e9


def check_timeout(timeout: float) -> float:
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be positive, finite seconds, at most {MAX_TIMEOUT:.0e}, "
                         f"got {timeout!r}")
    return float(timeout)


def time_left(deadline: float) -> float:
    """The seconds until ``deadline`` (``time.monotonic()``), as a call's timeout; a deadline
    that has passed raises :class:`DeadlineExceeded` here, and the call is not made."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the call's deadline passed before it was sent")
    return left
