"""Provider bodies of a ``BuildResponse``, parsed and typed.

``Build`` renders the request as one provider's JSON body when asked
(``BuildRequest.provider_format``; unset: the model's default format, when the catalog knows
the model): ``BuildResponse.provider_body_json`` is what the runtime sends to the provider as
it is, ``BuildResponse.provider_format`` the format rendered. These helpers parse it and check
the format::

    from context_engine_client import ProviderFormat, bedrock_converse_body, pb

    built = engine.build(request=pb.BuildRequest(
        ..., provider_format=ProviderFormat.PROVIDER_FORMAT_BEDROCK_CONVERSE))
    answer = boto3.client("bedrock-runtime").converse(**bedrock_converse_body(built))

Every accessor returns a new ``dict`` (a :class:`~typing.TypedDict` naming the top-level keys
the service renders; nested values are the provider's own JSON) and raises
:class:`ProviderBodyError` (a :class:`ValueError`) when the response holds no body, or a body of
another format than the accessor's (the message names both).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NotRequired, TypedDict, cast

from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as pb

#: The enum of ``BuildRequest.provider_format`` and ``BuildResponse.provider_format``
#: (``ProviderFormat.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT``; the type of a value is
#: ``ProviderFormat.ValueType``).
ProviderFormat = pb.ProviderFormat

#: The formats with a body, by their short names (those the service logs and the examples'
#: ``--print-body`` take), in the enum's order.
FORMAT_NAMES: Mapping[str, pb.ProviderFormat.ValueType] = MappingProxyType({
    "anthropic_messages": pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES,
    "openai_responses": pb.PROVIDER_FORMAT_OPENAI_RESPONSES,
    "openai_chat_completions": pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS,
    "gemini_generate_content": pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT,
    "bedrock_converse": pb.PROVIDER_FORMAT_BEDROCK_CONVERSE,
})
_PREFIX = "PROVIDER_FORMAT_"
_BY_NAME = ProviderFormat.DESCRIPTOR.values_by_name
_BY_NUMBER = ProviderFormat.DESCRIPTOR.values_by_number

JSONObject = dict[str, Any]


class ProviderBodyError(ValueError):
    """The response holds no provider body (``actual`` is ``PROVIDER_FORMAT_UNSPECIFIED``), or
    one of another format than ``expected``; or its JSON is not an object."""

    def __init__(self, message: str, *, expected: pb.ProviderFormat.ValueType | None,
                 actual: pb.ProviderFormat.ValueType) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


def parse_provider_format(name: str | int) -> pb.ProviderFormat.ValueType:
    """A format from its short name (``"gemini_generate_content"``), its enum name
    (``"PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT"``, any case) or its number; ``ValueError``
    listing the short names otherwise."""
    if isinstance(name, int):
        if name in _BY_NUMBER:
            return pb.ProviderFormat.ValueType(name)
    else:
        key = _PREFIX + name.strip().upper().removeprefix(_PREFIX)
        if key in _BY_NAME:
            return ProviderFormat.Value(key)
    raise ValueError(f"unknown provider format {name!r}: one of {', '.join(FORMAT_NAMES)} "
                     "(or none)")


def provider_format_name(value: pb.ProviderFormat.ValueType | int) -> str:
    """The short name of a format: ``"gemini_generate_content"``, ``"none"``,
    ``"unspecified"`` (``str(value)`` for a number this build does not know)."""
    if value in _BY_NUMBER:
        return ProviderFormat.Name(pb.ProviderFormat.ValueType(value)).removeprefix(
            _PREFIX).lower()
    return str(value)


def _described(value: pb.ProviderFormat.ValueType | int) -> str:
    if value in _BY_NUMBER:
        enum_name = ProviderFormat.Name(pb.ProviderFormat.ValueType(value))
        return f"{provider_format_name(value)} ({enum_name})"
    return f"an unknown provider format ({value})"


def _object(text: str, what: str, *, expected: pb.ProviderFormat.ValueType | None,
            actual: pb.ProviderFormat.ValueType) -> JSONObject:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProviderBodyError(f"{what} is not JSON: {err}", expected=expected,
                                actual=actual) from err
    if not isinstance(value, dict):
        raise ProviderBodyError(f"{what} is not a JSON object", expected=expected, actual=actual)
    return value


def provider_body(response: pb.BuildResponse) -> JSONObject:
    """``response.provider_body_json`` parsed, of whatever format ``response.provider_format``
    says. :class:`ProviderBodyError` when the response holds none (the request asked for
    ``PROVIDER_FORMAT_NONE``, or named no format for a model without a default one)."""
    actual = response.provider_format
    if not response.provider_body_json:
        raise ProviderBodyError(
            f"the BuildResponse holds no provider body (provider_format {_enum_name(actual)}): "
            "set BuildRequest.provider_format to the format to render", expected=None,
            actual=actual)
    return _object(response.provider_body_json, "provider_body_json", expected=None,
                   actual=actual)


def _enum_name(value: pb.ProviderFormat.ValueType | int) -> str:
    return (ProviderFormat.Name(pb.ProviderFormat.ValueType(value)) if value in _BY_NUMBER
            else str(value))


def _body_of(response: pb.BuildResponse, expected: pb.ProviderFormat.ValueType) -> JSONObject:
    actual = response.provider_format
    if actual != expected or not response.provider_body_json:
        held = (f"a body of format {_described(actual)}" if response.provider_body_json
                else f"no provider body (provider_format {_enum_name(actual)})")
        raise ProviderBodyError(
            f"expected a body of format {_described(expected)}, but the BuildResponse holds "
            f"{held}: ask Build for it with BuildRequest.provider_format = "
            f"{_enum_name(expected)}", expected=expected, actual=actual)
    return _object(response.provider_body_json, "provider_body_json", expected=expected,
                   actual=actual)


# ------------------------------------------------------------------------------ the formats

class AnthropicMessagesBody(TypedDict):
    """An Anthropic Messages API body (``client.messages.create(**body)``): ``system`` text
    blocks, ``messages`` (user and assistant turns; ``tool_use`` and ``tool_result`` blocks),
    ``tools``, with ``cache_control`` at the plan's cache markers."""

    model: str
    max_tokens: int
    system: list[JSONObject]
    messages: list[JSONObject]
    tools: NotRequired[list[JSONObject]]


class OpenAIResponsesBody(TypedDict):
    """An OpenAI Responses API body (``client.responses.create(**body)``): ``instructions``,
    ``input`` items (messages, ``function_call``, ``function_call_output``), ``tools``,
    ``prompt_cache_key`` (the session key), stateless (``store`` false); ``include`` asks a
    model that reasons (o-series, gpt-5 but gpt-5-chat) for its encrypted reasoning back, and
    is absent for any other (OpenAI refuses it there)."""

    model: str
    instructions: str
    input: list[JSONObject]
    prompt_cache_key: str
    max_output_tokens: int
    store: bool
    include: NotRequired[list[str]]
    tools: NotRequired[list[JSONObject]]


class ChatCompletionsBody(TypedDict):
    """An OpenAI Chat Completions body (``client.chat.completions.create(**body)``; vLLM,
    Ollama and other compatible servers take it too): ``messages`` (system, user, assistant
    with ``tool_calls``, a ``tool`` message answering each call), ``tools``,
    ``prompt_cache_key`` (the session key), ``max_completion_tokens`` (the output reserve)."""

    model: str
    messages: list[JSONObject]
    prompt_cache_key: str
    max_completion_tokens: int
    tools: NotRequired[list[JSONObject]]


class GeminiGenerateContentBody(TypedDict):
    """A Gemini ``models/{model}:generateContent`` body (REST, camelCase; the model is in the
    URL, ``BuildResponse.model_id``): ``systemInstruction`` (the prefix), ``contents`` (user and
    model turns; paired ``functionCall`` and ``functionResponse`` parts), ``tools`` (one
    ``functionDeclarations`` list, schemas as ``parametersJsonSchema``),
    ``generationConfig.maxOutputTokens`` (the output reserve). With explicit caching,
    :meth:`GeminiCachedContentBodies.cached_body_for` gives the body to send instead (without
    what the cached content holds, with ``cachedContent``)."""

    contents: list[JSONObject]
    generationConfig: JSONObject
    systemInstruction: NotRequired[JSONObject]
    tools: NotRequired[list[JSONObject]]
    toolConfig: NotRequired[JSONObject]
    cachedContent: NotRequired[str]


class BedrockConverseBody(TypedDict):
    """An Amazon Bedrock Converse request, the keyword arguments of boto3's
    ``client("bedrock-runtime").converse(**body)``: ``modelId``, ``system`` and ``messages``
    (paired ``toolUse`` and ``toolResult`` blocks), ``toolConfig``, ``inferenceConfig``
    (``maxTokens``: the output reserve), ``cachePoint`` blocks at the plan's breakpoints within
    Bedrock's limits."""

    modelId: str
    messages: list[JSONObject]
    inferenceConfig: JSONObject
    system: NotRequired[list[JSONObject]]
    toolConfig: NotRequired[JSONObject]


def anthropic_messages_body(response: pb.BuildResponse) -> AnthropicMessagesBody:
    """The response's Anthropic Messages body; :class:`ProviderBodyError` for another format."""
    return cast(AnthropicMessagesBody,
                _body_of(response, pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES))


def openai_responses_body(response: pb.BuildResponse) -> OpenAIResponsesBody:
    """The response's OpenAI Responses body; :class:`ProviderBodyError` for another format."""
    return cast(OpenAIResponsesBody, _body_of(response, pb.PROVIDER_FORMAT_OPENAI_RESPONSES))


def chat_completions_body(response: pb.BuildResponse) -> ChatCompletionsBody:
    """The response's OpenAI Chat Completions body; :class:`ProviderBodyError` for another
    format."""
    return cast(ChatCompletionsBody,
                _body_of(response, pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS))


def gemini_body(response: pb.BuildResponse) -> GeminiGenerateContentBody:
    """The response's Gemini generateContent body (the whole request, prefix first, so Gemini's
    implicit caching applies); :class:`ProviderBodyError` for another format."""
    return cast(GeminiGenerateContentBody,
                _body_of(response, pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT))


def bedrock_converse_body(response: pb.BuildResponse) -> BedrockConverseBody:
    """The response's Bedrock Converse body, ready for boto3's ``converse(**body)``:
    a replayed ``redactedContent`` blob (``messages[*].content[*].reasoningContent``), which the
    JSON body carries as base64 text, is decoded to bytes (botocore encodes blobs itself);
    nothing else is, so a tool's arguments or schema with a key of that name stay as they are.
    :class:`ProviderBodyError` for another format."""
    body = _body_of(response, pb.PROVIDER_FORMAT_BEDROCK_CONVERSE)
    return cast(BedrockConverseBody, _blobs_as_bytes(body))


def _blobs_as_bytes(body: JSONObject) -> JSONObject:
    """The body (parsed just now, so changed in place) with each reasoning block's
    ``redactedContent`` decoded: the one blob of a Converse body. A key of that name anywhere
    else (a tool call's input, a tool's schema) is the model's or the caller's text."""
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            reasoning = block.get("reasoningContent") if isinstance(block, dict) else None
            if isinstance(reasoning, dict) and isinstance(reasoning.get("redactedContent"), str):
                reasoning["redactedContent"] = base64.b64decode(reasoning["redactedContent"],
                                                                validate=True)
    return body


@dataclass(frozen=True, kw_only=True)
class GeminiCachedContentBodies:
    """``BuildResponse.gemini_cached_content`` with its bodies parsed: how to cache the pinned
    prefix with Gemini's explicit context caching.

    Once per epoch, create the cached content (``cachedContents.create`` with
    :attr:`create_body`; look for an existing one by :attr:`display_name` first), then send
    what :meth:`cached_body_for` returns for the created resource's name instead of the whole
    body. Below :attr:`min_cacheable_tokens` Gemini refuses to create it (:attr:`cacheable` is
    false): send the whole body and rely on implicit caching."""

    display_name: str
    ttl: str
    #: The ``cachedContents.create`` body: model, displayName, ttl and what it holds.
    create_body: JSONObject
    #: The generateContent body without what the cached content holds (``holds``), its
    #: ``cachedContent`` not set yet: see :meth:`cached_body_for`.
    cached_body: JSONObject
    holds: tuple[str, ...]
    estimated_tokens: int
    min_cacheable_tokens: int

    @property
    def cacheable(self) -> bool:
        """Whether the content reaches Gemini's minimum for the model."""
        return self.estimated_tokens >= self.min_cacheable_tokens

    def cached_body_for(self, cached_content_name: str) -> GeminiGenerateContentBody:
        """The generateContent body that uses the created cached content
        (``cachedContents/...``, the ``name`` ``cachedContents.create`` returned)."""
        if not cached_content_name:
            raise ValueError("cached_content_name: the name of the created cached content")
        body = json.loads(json.dumps(self.cached_body))  # a deep copy
        body["cachedContent"] = cached_content_name
        return cast(GeminiGenerateContentBody, body)


def gemini_cached_content(response: pb.BuildResponse) -> GeminiCachedContentBodies:
    """The response's explicit-caching plan for Gemini; :class:`ProviderBodyError` for another
    format or a response without it."""
    expected = pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT
    _body_of(response, expected)
    actual = response.provider_format
    cached = response.gemini_cached_content
    if not response.HasField("gemini_cached_content") or not cached.create_body_json:
        raise ProviderBodyError("the BuildResponse holds a gemini_generate_content body but no "
                                "gemini_cached_content", expected=expected, actual=actual)
    return GeminiCachedContentBodies(
        display_name=cached.display_name, ttl=cached.ttl,
        create_body=_object(cached.create_body_json, "gemini_cached_content.create_body_json",
                            expected=expected, actual=actual),
        cached_body=_object(cached.cached_body_json, "gemini_cached_content.cached_body_json",
                            expected=expected, actual=actual),
        holds=tuple(cached.holds), estimated_tokens=cached.estimated_tokens,
        min_cacheable_tokens=cached.min_cacheable_tokens)


__all__ = [
    "FORMAT_NAMES",
    "AnthropicMessagesBody",
    "BedrockConverseBody",
    "ChatCompletionsBody",
    "GeminiCachedContentBodies",
    "GeminiGenerateContentBody",
    "OpenAIResponsesBody",
    "ProviderBodyError",
    "ProviderFormat",
    "anthropic_messages_body",
    "bedrock_converse_body",
    "chat_completions_body",
    "gemini_body",
    "gemini_cached_content",
    "openai_responses_body",
    "parse_provider_format",
    "provider_body",
    "provider_format_name",
]
