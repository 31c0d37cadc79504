"""Typed Python client of the context-engine gRPC service.

:class:`Client` blocks, :class:`AsyncClient` runs on asyncio; both take the request messages of
``context_engine.v1`` (``from context_engine_client import pb``) as keyword arguments and raise
:class:`ContextEngineError` subclasses::

    from context_engine_client import Client, pb

    with Client(target="127.0.0.1:50051", token="...") as engine:
        plan = engine.plan(request=pb.PlanRequest(tenant_id="acme", session_id="s-1", ...)).plan

:mod:`context_engine_client.formats` parses the provider body a ``BuildResponse`` carries
(``provider_body``, ``chat_completions_body``, ``gemini_body``, ``bedrock_converse_body``...).

``build`` is incremental by default: it sends only the checkpoint items that changed since the
session's last Build and reads the response back whole; ``build_stats`` (a :class:`BuildStats`)
says what that saved.
"""

from context_engine_client._channel import DEFAULT_COMPACT_TIMEOUT, DEFAULT_TIMEOUT, RetryPolicy
from context_engine_client._incremental import BuildStats
from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as pb
from context_engine_client.aio import AsyncClient
from context_engine_client.client import Client
from context_engine_client.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    ClientClosed,
    ContextEngineError,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from context_engine_client.formats import (
    FORMAT_NAMES,
    AnthropicMessagesBody,
    BedrockConverseBody,
    ChatCompletionsBody,
    GeminiCachedContentBodies,
    GeminiGenerateContentBody,
    OpenAIResponsesBody,
    ProviderBodyError,
    ProviderFormat,
    anthropic_messages_body,
    bedrock_converse_body,
    chat_completions_body,
    gemini_body,
    gemini_cached_content,
    openai_responses_body,
    parse_provider_format,
    provider_body,
    provider_format_name,
)

__all__ = [
    "DEFAULT_COMPACT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "FORMAT_NAMES",
    "Aborted",
    "AlreadyExists",
    "AnthropicMessagesBody",
    "AsyncClient",
    "BedrockConverseBody",
    "BuildStats",
    "Cancelled",
    "ChatCompletionsBody",
    "Client",
    "ClientClosed",
    "ContextEngineError",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "GeminiCachedContentBodies",
    "GeminiGenerateContentBody",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OpenAIResponsesBody",
    "OutOfRange",
    "PermissionDenied",
    "ProviderBodyError",
    "ProviderFormat",
    "ResourceExhausted",
    "RetryPolicy",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "anthropic_messages_body",
    "bedrock_converse_body",
    "chat_completions_body",
    "gemini_body",
    "gemini_cached_content",
    "openai_responses_body",
    "parse_provider_format",
    "pb",
    "provider_body",
    "provider_format_name",
]
