"""What both clients share: the RPC table, the retry policy, channel options and metadata."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as pb

SERVICE = "context_engine.v1.ContextEngine"
DEFAULT_TIMEOUT = 10.0
# The service accepts 64 MiB by default; a 1,000-item conversation is about 3 MB.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


@dataclass(frozen=True, kw_only=True)
class Rpc(Generic[Req, Resp]):
    """One RPC of the service. ``keyed``: retried only when the request carries an
    idempotency key (the channel's service config retries the others)."""

    name: str
    request: type[Req]
    response: type[Resp]
    keyed: bool = False

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"

    def serialize(self, request: Req) -> bytes:
        return request.SerializeToString()

    @property
    def deserialize(self) -> Callable[[bytes], Resp]:
        return self.response.FromString


PLAN = Rpc(name="Plan", request=pb.PlanRequest, response=pb.PlanResponse)
GET_PLAN = Rpc(name="GetPlan", request=pb.GetPlanRequest, response=pb.GetPlanResponse)
BUILD = Rpc(name="Build", request=pb.BuildRequest, response=pb.BuildResponse)
ROTATE = Rpc(name="Rotate", request=pb.RotateRequest, response=pb.RotateResponse, keyed=True)
REPORT_USAGE = Rpc(name="ReportUsage", request=pb.ReportUsageRequest,
                   response=pb.ReportUsageResponse, keyed=True)
UPDATE_WORKING_STATE = Rpc(name="UpdateWorkingState", request=pb.UpdateWorkingStateRequest,
                           response=pb.UpdateWorkingStateResponse)
CARRY_WORKING_STATE = Rpc(name="CarryWorkingState", request=pb.CarryWorkingStateRequest,
                          response=pb.CarryWorkingStateResponse)
COMPACT = Rpc(name="Compact", request=pb.CompactRequest, response=pb.CompactResponse,
              keyed=True)


def has_idempotency_key(request: Message) -> bool:
    return bool(getattr(request, "idempotency_key", ""))


def _seconds(duration: str) -> float:
    if not duration.endswith("s"):
        raise ValueError(f"not a service config duration: {duration!r}")
    return float(duration[:-1])


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """gRPC's retry policy: attempts (the first included) and exponential backoff with full
    jitter, retrying only the listed codes."""

    max_attempts: int
    initial_backoff: float
    max_backoff: float
    backoff_multiplier: float
    retryable_codes: frozenset[grpc.StatusCode]

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based), as gRPC computes it."""
        ceiling = min(self.initial_backoff * self.backoff_multiplier ** (retry - 1),
                      self.max_backoff)
        return (rng or random).uniform(0, ceiling)


def service_config_text() -> str:
    """The packaged copy of ``clients/retry_service_config.json``."""
    return (resources.files("context_engine_client") / "retry_service_config.json").read_text(
        encoding="utf-8")


def retry_policy(config_text: str) -> RetryPolicy:
    """The retry policy of the service config (one policy for every retried method)."""
    config = json.loads(config_text)
    policies = [m["retryPolicy"] for m in config.get("methodConfig", ()) if "retryPolicy" in m]
    if len(policies) != 1:
        raise ValueError("the service config must hold exactly one retryPolicy")
    p = policies[0]
    return RetryPolicy(max_attempts=int(p["maxAttempts"]),
                       initial_backoff=_seconds(p["initialBackoff"]),
                       max_backoff=_seconds(p["maxBackoff"]),
                       backoff_multiplier=float(p["backoffMultiplier"]),
                       retryable_codes=frozenset(grpc.StatusCode[c]
                                                 for c in p["retryableStatusCodes"]))


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


def credentials(*, tls: bool, root_certificates: bytes | None,
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


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    if token is None:
        return ()
    if not token or any(c in token for c in "\r\n"):
        raise ValueError("the token must be one non-empty line")
    return (("authorization", f"Bearer {token}"),)


def check_timeout(timeout: float) -> float:
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    return float(timeout)
