"""The frozen settings both clients are built from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from context_engine_client._channel import (
    RetryPolicy,
    call_metadata,
    channel_options,
    check_timeout,
    credentials,
    keyed_service_config,
    retry_policy,
    service_config_text,
    token_transport_options,
    unkeyed_service_config,
)


@dataclass(frozen=True, kw_only=True)
class Settings:
    target: str
    credentials: grpc.ChannelCredentials | None
    options: tuple[tuple[str, Any], ...]
    keyed_options: tuple[tuple[str, Any], ...]  # the channel for requests with a key
    metadata: tuple[tuple[str, str], ...]
    timeout: float
    compact_timeout: float
    policy: RetryPolicy | None  # None: the service config retries nothing


def settings(*, target: str, token: str | None, tls: bool | None, root_certificates: bytes | None,
             client_certificate_chain: bytes | None, client_private_key: bytes | None,
             server_name: str | None, timeout: float, compact_timeout: float,
             max_message_bytes: int,
             service_config: str | None,
             channel_options_extra: Sequence[tuple[str, Any]]) -> Settings:
    if not target:
        raise ValueError("target is required (host:port)")
    config_text = service_config_text() if service_config is None else service_config
    options = channel_options(config_text=unkeyed_service_config(config_text),
                              max_message_bytes=max_message_bytes, server_name=server_name)
    keyed = channel_options(config_text=keyed_service_config(config_text),
                            max_message_bytes=max_message_bytes, server_name=server_name)
    channel_credentials = credentials(tls=tls, root_certificates=root_certificates,
                                      client_certificate_chain=client_certificate_chain,
                                      client_private_key=client_private_key)
    direct = token_transport_options(target=target, token=token, tls=tls,
                                     encrypted=channel_credentials is not None)
    return Settings(
        target=target,
        credentials=channel_credentials,
        options=(*options, *direct, *channel_options_extra),
        keyed_options=(*keyed, *direct, *channel_options_extra),
        metadata=call_metadata(token),
        timeout=check_timeout(timeout),
        compact_timeout=check_timeout(compact_timeout),
        policy=retry_policy(config_text))
