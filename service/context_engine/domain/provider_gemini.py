"""The request as a Google Gemini ``generateContent`` body (``gemini_generate_content``, the
REST JSON of ``models/{model}:generateContent``, camelCase), its structural validator, and the
explicit context cache of its pinned prefix.

- The model is not in the body: it is the URL's (``BuildResponse.model_id``).
- ``systemInstruction``: the prefix blocks as one text part, joined by a blank line as the
  OpenAI bodies join them. ``tools``: one ``functionDeclarations`` list. Both hold the pinned
  prefix, byte-identical on every request, and Gemini reads them before ``contents``, so its
  implicit caching applies to them (and to the stable start of the history) with no marker.
- ``contents``: roles ``user`` and ``model``; consecutive messages of one role merge into one
  turn. The model's calls are ``functionCall`` parts (``id``, ``name``, ``args``); each result is
  a ``functionResponse`` part (``id``, ``name``, ``response: {"output": text}``, the key Gemini
  reads as the function's output) and moves to the start of the user turn right after its
  call's turn, with every other response of the batch, in the order of the calls: Gemini wants
  as many response parts there as the call turn had calls, and pairs them by position. A
  history that opens with the model's turn gets the fixed leading user line, as for Anthropic:
  Gemini's first content must be the user's.
- Tool names: Gemini accepts ``[A-Za-z_][A-Za-z0-9_.:-]{0,63}``, dots included, so our names
  go as they are (no "." -> "__" mapping: calls come back under our own names), except that a
  name starting with a digit, "-" or "." gets one leading "_" (Gemini wants a letter or an
  underscore first). Two names that map to one, or a name too long once mapped, fail the
  render; the map is one-to-one, so an adapter inverts it over the plan's tool names.
- Tool schemas: ``parametersJsonSchema`` (JSON Schema, which google-genai's
  ``FunctionDeclaration`` takes and sends), not ``parameters`` (an OpenAPI 3.0 subset without
  ``additionalProperties``, ``$ref``/``$defs`` or ``const``, which would have to be dropped or
  inlined): the schema goes as every other provider gets it (:func:`provider_schema`) and no
  validation keyword is lost.
- Reasoning: only Google reasoning items are replayed. Their payload is the JSON object
  ``{"thoughtSignature": "<base64>"}``: the signature the model returned on the part the item
  precedes, as the REST JSON carries it (a payload of another shape fails the render); the
  signature goes back on the next part of the same model turn (Gemini 3 refuses a function call
  of the current turn without its signature). Other providers' reasoning means nothing here.
- ``generationConfig.maxOutputTokens`` is the output reserve.

:func:`gemini_cached_content` describes the explicit cache of the prefix (``cachedContents``):
what to create once per epoch and the body to send with ``cachedContent`` set.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from context_engine.domain.builder import BuildResult
from context_engine.domain.canonical import parse_json_object, sha256_hex
from context_engine.domain.errors import AssemblyError
from context_engine.domain.provider_common import (
    GEMINI_GENERATE_CONTENT,
    JSON,
    LEADING_USER_TEXT,
    Turns,
    call_names,
    joined_prefix,
    message_key,
    pair_problems,
    provider_tool_names,
    reasoning_object,
    request_tool_names,
    tool_schemas,
    unreplayable,
)
from context_engine.domain.provider_formats import gemini_tool_name as gemini_tool_name
from context_engine.domain.request import Message, Role

GEMINI_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}")
GEMINI_REASONING = "google"
SIGNATURE = "thoughtSignature"
# What an explicit cached content holds: the request fields Gemini refuses beside
# ``cachedContent`` (we set no toolConfig; it would be held too).
CACHED_FIELDS = ("systemInstruction", "tools", "toolConfig")
TTL_SECONDS = {"5m": "300s", "1h": "3600s"}
# Gemini's largest documented minimum for explicit caching (2.5 Pro, 3 Pro): used for a model
# the catalog gives none, so a runtime never creates a cache Gemini would refuse.
DEFAULT_MIN_CACHEABLE_TOKENS = 4096
DATA_FIELDS = ("text", "functionCall", "functionResponse", "inlineData", "fileData")


def gemini_tool_names(result: BuildResult) -> dict[str, str]:
    return provider_tool_names(request_tool_names(result), GEMINI_GENERATE_CONTENT,
                               mapping=gemini_tool_name, pattern=GEMINI_TOOL_NAME,
                               rule="a letter or an underscore, then up to 63 characters of "
                                    "[A-Za-z0-9_.:-]")


def is_base64(text: str) -> bool:
    """Standard base64 with its padding: how the REST JSON carries bytes."""
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return bool(text)


def _signature(m: Message) -> str:
    value = reasoning_object(m)
    signature = value.get(SIGNATURE) if value is not None and set(value) == {SIGNATURE} \
        else None
    if not isinstance(signature, str) or not is_base64(signature):
        raise unreplayable(m, GEMINI_GENERATE_CONTENT,
                           'a JSON object {"thoughtSignature": "<base64 signature>"}')
    return signature


def gemini_generate_content(result: BuildResult) -> JSON:
    """The request as a Gemini generateContent body (see the module docstring)."""
    names = gemini_tool_names(result)
    tool_of = call_names(result)
    req = result.request
    turns = Turns(model_role="model")
    signature = ""  # a replayed thought signature waiting for its part
    for m in req.messages:
        key = message_key(m)
        if m.role is Role.TOOL:
            signature = ""
            called = tool_of.get(m.call_id)
            if called is None:
                raise AssemblyError(f"tool result for {m.call_id!r} has no earlier call")
            turns.add("user", {"functionResponse": {
                "id": m.call_id, "name": names[called],
                "response": {"output": m.text}}}, key, result_of=m.call_id)
            continue
        role = "user" if m.role is Role.USER else "model"
        if m.reasoning_provider:
            if m.reasoning_provider == GEMINI_REASONING and role == "model":
                signature = _signature(m)
            continue
        parts: list[tuple[JSON, str]] = []
        if m.text:
            parts.append(({"text": m.text}, ""))
        for c in m.tool_calls:
            parts.append(({"functionCall": {
                "id": c.call_id, "name": names[c.name],
                "args": parse_json_object(c.arguments_json) or {}}}, c.call_id))
        if role == "user":
            signature = ""
        for part, call_id in parts:
            if signature:
                part[SIGNATURE] = signature
                signature = ""
            turns.add(role, part, key, call_id=call_id)
    turns.lead({"text": LEADING_USER_TEXT})
    # Gemini pairs the responses of a turn with the calls of the turn before by position
    # (by id too, where both carry one): they go in the calls' order.
    for before, turn in itertools.pairwise(turns.turns):
        if turn.results:
            order = {p["functionCall"]["id"]: k for k, p in enumerate(before.blocks)
                     if "functionCall" in p}
            turn.results.sort(key=lambda p: order[p["functionResponse"]["id"]])

    body: JSON = {}
    system = joined_prefix(result)
    if system:
        body["systemInstruction"] = {"parts": [{"text": system}]}
    declarations: list[JSON] = []
    for t, schema in zip(req.tools, tool_schemas(result), strict=True):
        declaration: JSON = {"name": names[t.name]}
        if t.description:
            declaration["description"] = t.description
        declaration["parametersJsonSchema"] = schema
        declarations.append(declaration)
    if declarations:
        body["tools"] = [{"functionDeclarations": declarations}]
    body["contents"] = [{"role": t.role, "parts": t.content()} for t in turns.turns]
    body["generationConfig"] = {"maxOutputTokens": result.output_reserve}
    return body


# ----------------------------------------------------------------------------- cached content

@dataclass(frozen=True, kw_only=True, slots=True)
class GeminiCachedContent:
    """Gemini's explicit cache of the pinned prefix (``BuildResponse.gemini_cached_content``).
    Once per epoch the runtime creates it (``cachedContents.create`` with ``create_body``;
    ``display_name`` finds one already made), then sends ``cached_body`` with ``cachedContent``
    set to the created resource's name. Below ``min_cacheable_tokens`` Gemini refuses to create
    it, and implicit caching of the whole body is what remains."""

    display_name: str
    ttl: str
    create_body: JSON
    cached_body: JSON
    holds: tuple[str, ...]
    estimated_tokens: int
    min_cacheable_tokens: int


def cached_content_display_name(session_key: str, prefix_sha256: str, epoch: int) -> str:
    """``ce-<first 16 hex of SHA-256 over "<session_key>:<prefix_sha256>">-e<epoch>``: unique
    to the session, its prefix and its epoch. The runtime finds a cached content by this name,
    so it holds the session key: two tenants or two sessions with the same prefix never find,
    patch or make again each other's. At most 31 characters (Gemini takes 128)."""
    return f"ce-{sha256_hex(f'{session_key}:{prefix_sha256}')[:16]}-e{epoch}"


def gemini_cached_content(result: BuildResult, body: Mapping[str, Any], *,
                          min_cacheable_tokens: int = 0) -> GeminiCachedContent:
    """The cached content of a generateContent ``body`` rendered from ``result``: unique to
    the session, the prefix and the epoch (:func:`cached_content_display_name`), kept for the
    plan's cache TTL, holding what the body holds of the prefix. ``min_cacheable_tokens`` is
    the catalog's for the model (0: unknown, then :data:`DEFAULT_MIN_CACHEABLE_TOKENS`); the
    estimate is the prefix as the plan measured it."""
    display_name = cached_content_display_name(result.session_key, result.prefix_sha256,
                                               result.epoch)
    ttl = TTL_SECONDS[result.cache_ttl]
    holds = tuple(k for k in CACHED_FIELDS if k in body)
    model = result.model_id if result.model_id.startswith("models/") \
        else f"models/{result.model_id}"
    create: JSON = {"model": model, "displayName": display_name, "ttl": ttl}
    create.update({k: body[k] for k in holds})
    cached: JSON = {k: v for k, v in body.items() if k not in holds}
    return GeminiCachedContent(
        display_name=display_name, ttl=ttl, create_body=create, cached_body=cached,
        holds=holds, estimated_tokens=result.prefix_tokens,
        min_cacheable_tokens=min_cacheable_tokens or DEFAULT_MIN_CACHEABLE_TOKENS)


# ----------------------------------------------------------------------------- validator

def validate_gemini(body: Mapping[str, Any]) -> list[str]:
    """Structural problems of a generateContent body (a whole one, or the body sent beside a
    ``cachedContent``); empty when it is valid: parts and roles, the first content the user's,
    roles alternating, tool names, and pairing: every model turn's calls answered, each exactly
    once and under its call's name, by the response parts of the user turn right after it."""
    problems: list[str] = []
    if "cachedContent" in body:
        if not isinstance(body["cachedContent"], str) or not body["cachedContent"]:
            problems.append("cachedContent: must be a cached content's name")
        problems += [f"{k}: not allowed beside cachedContent (the cached content holds it)"
                     for k in CACHED_FIELDS if k in body]
    config = body.get("generationConfig")
    if config is not None:
        limit = config.get("maxOutputTokens") if isinstance(config, dict) else None
        if not isinstance(config, dict) or (limit is not None and (
                not isinstance(limit, int) or isinstance(limit, bool) or limit < 1)):
            problems.append("generationConfig.maxOutputTokens: must be a positive integer")
    system = body.get("systemInstruction")
    if system is not None:
        parts = system.get("parts") if isinstance(system, dict) else None
        if not isinstance(parts, list) or not parts or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]
                for p in parts):
            problems.append("systemInstruction: must be {\"parts\": [non-empty text parts]}")
    problems += _declarations(body.get("tools"))

    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        return [*problems, "contents: must be a non-empty list"]
    turns: list[tuple[str, list[JSON]]] = []
    for i, c in enumerate(contents):
        parts = c.get("parts") if isinstance(c, dict) else None
        role = c.get("role") if isinstance(c, dict) else None
        if role not in ("user", "model") or not isinstance(parts, list) or not parts \
                or not all(isinstance(p, dict) for p in parts):
            problems.append(f"contents[{i}]: must have role user or model and a non-empty "
                            "list of parts")
            turns.append(("", []))
            continue
        turns.append((str(role), list(parts)))
        for j, p in enumerate(parts):
            problems += _part(p, f"contents[{i}].parts[{j}]", str(role))
    if turns[0][0] != "user":
        problems.append("contents[0]: the first content must have the user role")
    for i in range(1, len(turns)):
        if turns[i][0] and turns[i][0] == turns[i - 1][0]:
            problems.append(f"contents[{i}]: two {turns[i][0]} turns in a row; they merge")
    problems += _pairs(turns)
    return problems


def _part(p: JSON, where: str, role: str) -> list[str]:
    problems: list[str] = []
    data = [k for k in DATA_FIELDS if k in p]
    if len(data) != 1:
        return [f"{where}: must hold exactly one of {', '.join(DATA_FIELDS)}"]
    kind = data[0]
    if kind == "text" and (not isinstance(p["text"], str) or not p["text"]):
        problems.append(f"{where}.text: must be a non-empty string")
    if SIGNATURE in p and (role != "model" or not isinstance(p[SIGNATURE], str)
                           or not is_base64(p[SIGNATURE])):
        problems.append(f"{where}.thoughtSignature: only on a model part, base64 text")
    if kind == "functionCall":
        call = p["functionCall"]
        if role != "model":
            problems.append(f"{where}: a functionCall belongs in a model turn")
        if not isinstance(call, dict):
            return [*problems, f"{where}.functionCall: must be an object"]
        problems += _name(call.get("name"), f"{where}.functionCall.name")
        if not isinstance(call.get("args", {}), dict):
            problems.append(f"{where}.functionCall.args: must be an object")
        if "id" in call and (not isinstance(call["id"], str) or not call["id"]):
            problems.append(f"{where}.functionCall.id: must be a non-empty string")
    if kind == "functionResponse":
        response = p["functionResponse"]
        if role != "user":
            problems.append(f"{where}: a functionResponse belongs in a user turn")
        if not isinstance(response, dict):
            return [*problems, f"{where}.functionResponse: must be an object"]
        problems += _name(response.get("name"), f"{where}.functionResponse.name")
        if not isinstance(response.get("response"), dict):
            problems.append(f"{where}.functionResponse.response: must be an object")
    return problems


def _name(name: object, where: str) -> list[str]:
    if not isinstance(name, str) or GEMINI_TOOL_NAME.fullmatch(name) is None:
        return [f"{where}: {name!r} is not a valid Gemini function name"]
    return []


def _declarations(tools: object) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        return ["tools: not a list"]
    problems: list[str] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        declarations = tool.get("functionDeclarations") if isinstance(tool, dict) else None
        if not isinstance(declarations, list):
            problems.append(f"tools[{i}]: must be {{\"functionDeclarations\": [...]}}")
            continue
        for j, d in enumerate(declarations):
            where = f"tools[{i}].functionDeclarations[{j}]"
            if not isinstance(d, dict):
                problems.append(f"{where}: not an object")
                continue
            name = d.get("name")
            problems += _name(name, f"{where}.name")
            if isinstance(name, str):
                if name in seen:
                    problems.append(f"{where}.name: duplicate {name!r}")
                seen.add(name)
            if "parameters" in d and "parametersJsonSchema" in d:
                problems.append(f"{where}: parameters and parametersJsonSchema exclude each "
                                "other")
            schema = d.get("parametersJsonSchema", d.get("parameters"))
            if schema is not None and (not isinstance(schema, dict)
                                       or schema.get("type") not in ("object", "OBJECT")):
                problems.append(f"{where}: the parameters must describe an object")
    return problems


def _pairs(turns: Sequence[tuple[str, list[JSON]]]) -> list[str]:
    calls: list[tuple[int, list[str]]] = []
    answers: list[tuple[int, list[str]]] = []
    problems: list[str] = []
    names: dict[str, str] = {}
    for i, (role, parts) in enumerate(turns):
        made = [p["functionCall"] for p in parts
                if isinstance(p.get("functionCall"), dict) and role == "model"]
        given = [p["functionResponse"] for p in parts
                 if isinstance(p.get("functionResponse"), dict) and role == "user"]
        if made:
            calls.append((i, [_key(c) for c in made]))
            names.update({_key(c): str(c.get("name")) for c in made})
        if given:
            answers.append((i, [_key(r) for r in given]))
            asked = next((ids for at, ids in calls if at == i - 1), [])
            if sorted(asked) == sorted(_key(r) for r in given) \
                    and asked != [_key(r) for r in given]:
                problems.append(f"contents[{i}]: the responses are not in the order of the "
                                "calls they answer")
            for r in given:
                called = names.get(_key(r))
                if called is not None and called != r.get("name"):
                    problems.append(f"contents[{i}]: the response to {_key(r)!r} names "
                                    f"{r.get('name')!r}, its call {called!r}")
    return problems + pair_problems(calls, answers, "contents")


def _key(part: JSON) -> str:
    """A call's or response's pairing key: its id (Gemini 2.x+ echoes ids), else its name."""
    return str(part.get("id") or part.get("name") or "")
