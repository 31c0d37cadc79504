"""The request as an Amazon Bedrock Converse body (``bedrock_converse``: the ``bedrock-runtime``
``Converse`` request as boto3's ``client.converse(**body)`` takes it) and its structural
validator.

- ``modelId`` is the model id (a foundation model id or an inference profile id).
- ``system``: one ``{"text"}`` block per prefix block, but one of white space alone (a plan
  stored before ``Plan`` refused blank agent instructions), which Bedrock refuses and which
  carries nothing. ``toolConfig.tools``: a ``toolSpec`` per
  definition (``inputSchema: {"json": schema}`` with :func:`provider_schema`). Tool names are
  mapped as for Anthropic and OpenAI: Bedrock takes ``[a-zA-Z0-9_-]{1,64}``.
- ``messages``: roles ``user`` and ``assistant``, alternating from a user turn, consecutive
  messages of one role merged (Bedrock refuses two turns of one role in a row). ``{"text"}``
  blocks, the model's calls as ``toolUse`` blocks (``toolUseId``, ``name``, ``input``), each
  result as a ``toolResult`` block (``toolUseId``, ``content: [{"text"}]``; no ``status``: the
  request does not say which results were errors) at the start of the user turn right after
  its call's turn, all results of a batch together. A history that opens with the model's turn
  gets the fixed leading user line, as for Anthropic.
- Cache markers are ``cachePoint`` blocks placed right after what the plan's breakpoints mark,
  as the Anthropic body places ``cache_control``: after the last tool (after_tools), after the
  last system block (after_system), and after the last cacheable block of the conversation
  through each history marker's item as the body lays it out (never after reasoning or empty
  text). At most four (Bedrock's limit of cache checkpoints per request), kept by priority;
  ``ttl: "1h"`` where the plan asks an hour and the model takes it (``long_ttl``: the catalog
  entry's, Claude Sonnet 4.5, Haiku 4.5, Opus 4.5 and later; an older model answers 400 to a
  ``ttl``), the five-minute default otherwise (for a model without ``long_ttl``, every point
  of the body), and never a longer TTL after a shorter one. A model Bedrock's prompt caching
  does not take gets no point: its catalog breakpoint budget is 0.
- Reasoning: only items whose provider is ``bedrock`` are replayed, verbatim: their payload is
  the Converse content block ``{"reasoningContent": {...}}`` the model returned (extended
  thinking must go back with the calls it led to): ``reasoningText`` (``text``, ``signature``)
  or ``redactedContent``, a blob, as base64 text since JSON has no bytes (a boto3 caller
  decodes it to bytes; botocore encodes blobs itself). Another shape fails the render. Other
  providers' reasoning means nothing here.
- ``inferenceConfig.maxTokens`` is the output reserve.
- A call id must be what Bedrock takes for ``toolUseId`` (``[a-zA-Z0-9_.:-]{1,64}``; Bedrock's
  own ids always are): another one fails the render, since renaming it would break the pair.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from typing import Any

from context_engine.domain.breakpoints import DEFAULT_TTL
from context_engine.domain.builder import BuildResult
from context_engine.domain.canonical import parse_json_object
from context_engine.domain.errors import FieldViolation
from context_engine.domain.provider_common import (
    BEDROCK_CONVERSE,
    JSON,
    LEADING_USER_TEXT,
    LONG_TTL,
    MAX_BREAKPOINTS,
    PROVIDER_TOOL_NAME,
    TTL_RANK,
    ProviderFormatError,
    Turns,
    check_call_ids,
    claude_system_texts,
    claude_tool_schemas,
    marked_blocks,
    message_key,
    pair_problems,
    reasoning_object,
    tool_names,
    unreplayable,
)
from context_engine.domain.request import Message, Role

TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_.:-]{1,64}")
BEDROCK_REASONING = "bedrock"
CONTENT_KINDS = ("text", "image", "document", "video", "audio", "toolUse", "toolResult",
                 "guardContent", "cachePoint", "reasoningContent", "citationsContent",
                 "searchResult")
UNCACHEABLE = frozenset({"reasoningContent", "cachePoint"})


def _cacheable(block: JSON) -> bool:
    if any(k in block for k in UNCACHEABLE):
        return False
    return not ("text" in block and not str(block["text"]).strip())


def _cache_point(ttl: str) -> JSON:
    point: JSON = {"type": "default"}
    if ttl == LONG_TTL:
        point["ttl"] = LONG_TTL
    return {"cachePoint": point}


def _reasoning(m: Message) -> JSON:
    value = reasoning_object(m)
    if value is None or set(value) != {"reasoningContent"} \
            or not _reasoning_block(value["reasoningContent"]):
        raise unreplayable(m, BEDROCK_CONVERSE, 'a JSON object {"reasoningContent": '
                           '{"reasoningText": {"text", "signature"}} or {"redactedContent": '
                           '"<base64>"}} (a Converse block)')
    return value


def _reasoning_block(content: object) -> bool:
    """A Converse ``ReasoningContentBlock``: reasoning text with its signature, or redacted
    content (a blob: base64 text in JSON)."""
    if not isinstance(content, dict) or len(content) != 1:
        return False
    text = content.get("reasoningText")
    if isinstance(text, dict):
        return isinstance(text.get("text"), str) and set(text) <= {"text", "signature"} \
            and isinstance(text.get("signature", ""), str)
    redacted = content.get("redactedContent")
    if not isinstance(redacted, str) or not redacted:
        return False
    try:
        base64.b64decode(redacted, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def bedrock_converse(result: BuildResult, *, long_ttl: bool = False) -> JSON:
    """The request as a Bedrock Converse body (see the module docstring); ``long_ttl``: the
    model takes a one-hour cachePoint (False: every point the five-minute default)."""
    fmt = BEDROCK_CONVERSE
    names = tool_names(result, fmt)
    check_call_ids(result, fmt, limit=64, pattern=TOOL_USE_ID,
                   rule="1-64 characters of [a-zA-Z0-9_.:-] (a toolUseId)")
    req = result.request
    tools: list[JSON] = []
    for t, schema in zip(req.tools, claude_tool_schemas(result, fmt), strict=True):
        spec: JSON = {"name": names[t.name]}
        if t.description:
            spec["description"] = t.description
        spec["inputSchema"] = {"json": schema}
        tools.append({"toolSpec": spec})
    system: list[JSON] = [{"text": t} for t in claude_system_texts(result)]
    if not tools and any(m.tool_calls for m in req.messages):
        raise ProviderFormatError(fmt, [FieldViolation(
            "checkpoint.items", "Bedrock takes toolUse and toolResult blocks only in a request "
            "that defines tools, and the plan pins none")])

    turns = Turns(model_role="assistant")
    for m in req.messages:
        key = message_key(m)
        if m.role is Role.TOOL:
            turns.add("user", {"toolResult": {"toolUseId": m.call_id,
                                              "content": [{"text": m.text}]}},
                      key, result_of=m.call_id)
            continue
        role = "user" if m.role is Role.USER else "assistant"
        if m.reasoning_provider:
            if m.reasoning_provider == BEDROCK_REASONING:
                turns.add(role, _reasoning(m), key)
            continue
        if m.text.strip():  # Bedrock refuses a blank text block
            turns.add(role, {"text": m.text}, key)
        for c in m.tool_calls:
            turns.add(role, {"toolUse": {"toolUseId": c.call_id, "name": names[c.name],
                                         "input": parse_json_object(c.arguments_json) or {}}},
                      key, call_id=c.call_id)
    turns.lead({"text": LEADING_USER_TEXT})
    marks = {id(block): ttl if long_ttl else DEFAULT_TTL for block, ttl in marked_blocks(
        result, tools=tools, system=system, turns=turns, cacheable=_cacheable)}

    def with_points(blocks: Sequence[JSON]) -> list[JSON]:
        out: list[JSON] = []
        for block in blocks:
            out.append(block)
            if id(block) in marks:
                out.append(_cache_point(marks[id(block)]))
        return out

    body: JSON = {
        "modelId": result.model_id,
        "messages": [{"role": t.role, "content": with_points(t.content())}
                     for t in turns.turns],
        "inferenceConfig": {"maxTokens": result.output_reserve},
    }
    if system:
        body["system"] = with_points(system)
    if tools:
        body["toolConfig"] = {"tools": with_points(tools)}
    return body


# ----------------------------------------------------------------------------- validator

def validate_bedrock(body: Mapping[str, Any]) -> list[str]:
    """Structural problems of a Converse body; empty when it is valid: blocks and roles, the
    first message the user's, roles alternating, tool names and ids, pairing (every toolUse
    answered, exactly once, by a toolResult of the next user turn, and every toolResult
    answering a toolUse of the turn right before it) and the cache points (at most four,
    each after a cacheable block, no longer TTL after a shorter one)."""
    problems: list[str] = []
    if not isinstance(body.get("modelId"), str) or not body.get("modelId"):
        problems.append("modelId: must be a non-empty string")
    config = body.get("inferenceConfig")
    if config is not None:
        limit = config.get("maxTokens") if isinstance(config, dict) else None
        if not isinstance(config, dict) or (limit is not None and (
                not isinstance(limit, int) or isinstance(limit, bool) or limit < 1)):
            problems.append("inferenceConfig.maxTokens: must be a positive integer")
    points: list[tuple[str, JSON, JSON | None]] = []  # where, the point, the block before it

    # in request order: tools -> system -> messages (the TTL order runs along it)
    tool_config = body.get("toolConfig")
    if tool_config is not None:
        tools = tool_config.get("tools") if isinstance(tool_config, dict) else None
        if not isinstance(tools, list) or not tools:
            problems.append("toolConfig.tools: must be a non-empty list")
            tools = []
        seen: set[str] = set()
        for i, t in enumerate(tools):
            where = f"toolConfig.tools[{i}]"
            if isinstance(t, dict) and "cachePoint" in t:
                before = tools[i - 1] if i and isinstance(tools[i - 1], dict) else None
                points.append((where, t, before))
                continue
            spec = t.get("toolSpec") if isinstance(t, dict) else None
            if not isinstance(spec, dict):
                problems.append(f"{where}: must be a toolSpec or a cachePoint")
                continue
            name = spec.get("name")
            if not isinstance(name, str) or PROVIDER_TOOL_NAME.fullmatch(name) is None:
                problems.append(f"{where}.toolSpec.name: {name!r} is not 1-64 characters of "
                                "[a-zA-Z0-9_-]")
            elif name in seen:
                problems.append(f"{where}.toolSpec.name: duplicate {name!r}")
            else:
                seen.add(name)
            schema = spec.get("inputSchema")
            if not isinstance(schema, dict) or not isinstance(schema.get("json"), dict) \
                    or schema["json"].get("type") != "object":
                problems.append(f"{where}.toolSpec.inputSchema: must be {{\"json\": a JSON "
                                "schema of type object}")
            if "description" in spec and (not isinstance(spec["description"], str)
                                          or not spec["description"]):
                problems.append(f"{where}.toolSpec.description: must not be empty")

    system = body.get("system", [])
    if not isinstance(system, list) or not all(isinstance(b, dict) for b in system):
        problems.append("system: must be a list of blocks")
        system = []
    for i, b in enumerate(system):
        if "cachePoint" in b:
            points.append((f"system[{i}]", b, system[i - 1] if i else None))
        elif not isinstance(b.get("text"), str) or not b["text"].strip():
            problems.append(f"system[{i}]: must be a text block holding more than white "
                            "space, or a cachePoint")

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return [*problems, "messages: must be a non-empty list"]
    turns: list[tuple[str, list[JSON]]] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant") or not isinstance(content, list) or not content \
                or not all(isinstance(b, dict) for b in content):
            problems.append(f"messages[{i}]: must have role user or assistant and a non-empty "
                            "list of blocks")
            turns.append(("", []))
            continue
        turns.append((str(role), list(content)))
        for j, b in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if "cachePoint" in b:
                points.append((where, b, content[j - 1] if j else None))
                continue
            problems += _block(b, where, str(role))
    if turns[0][0] != "user":
        problems.append("messages[0]: the first message must have the user role")
    for i in range(1, len(turns)):
        if turns[i][0] and turns[i][0] == turns[i - 1][0]:
            problems.append(f"messages[{i}]: two {turns[i][0]} turns in a row; roles alternate")
    if tool_config is None and any("toolUse" in b or "toolResult" in b
                                   for _, blocks in turns for b in blocks):
        problems.append("toolConfig: must be defined when messages hold toolUse or toolResult "
                        "blocks")
    problems += _pairs(turns)
    problems += _points(points)
    return problems


def _block(b: JSON, where: str, role: str) -> list[str]:
    kinds = [k for k in CONTENT_KINDS if k in b]
    if len(kinds) != 1:
        return [f"{where}: must hold exactly one of {', '.join(CONTENT_KINDS)}"]
    kind = kinds[0]
    problems: list[str] = []
    if kind == "text" and (not isinstance(b["text"], str) or not b["text"].strip()):
        problems.append(f"{where}.text: must not be blank")
    if kind == "toolUse":
        use = b["toolUse"]
        if role != "assistant":
            problems.append(f"{where}: a toolUse belongs in an assistant turn")
        if not isinstance(use, dict):
            return [*problems, f"{where}.toolUse: must be an object"]
        name = use.get("name")
        if not isinstance(name, str) or PROVIDER_TOOL_NAME.fullmatch(name) is None:
            problems.append(f"{where}.toolUse.name: {name!r} is not a valid tool name")
        if not isinstance(use.get("toolUseId"), str) \
                or TOOL_USE_ID.fullmatch(use["toolUseId"]) is None:
            problems.append(f"{where}.toolUse.toolUseId: must be 1-64 characters of "
                            "[a-zA-Z0-9_.:-]")
        if not isinstance(use.get("input"), dict):
            problems.append(f"{where}.toolUse.input: must be an object")
    if kind == "toolResult":
        result = b["toolResult"]
        if role != "user":
            problems.append(f"{where}: a toolResult belongs in a user turn")
        if not isinstance(result, dict):
            return [*problems, f"{where}.toolResult: must be an object"]
        content = result.get("content")
        if not isinstance(content, list) or not all(
                isinstance(c, dict) and len(c) == 1 for c in content):
            problems.append(f"{where}.toolResult.content: must be a list of blocks")
        if result.get("status", "success") not in ("success", "error"):
            problems.append(f"{where}.toolResult.status: must be success or error")
    if kind == "reasoningContent" and (role != "assistant"
                                       or not _reasoning_block(b["reasoningContent"])):
        problems.append(f"{where}: a reasoningContent block of an assistant turn, with "
                        "reasoningText or redactedContent")
    return problems


def _pairs(turns: Sequence[tuple[str, list[JSON]]]) -> list[str]:
    calls: list[tuple[int, list[str]]] = []
    answers: list[tuple[int, list[str]]] = []
    problems: list[str] = []
    for i, (role, blocks) in enumerate(turns):
        made = [str(b["toolUse"].get("toolUseId", "")) for b in blocks
                if isinstance(b.get("toolUse"), dict) and role == "assistant"]
        given = [str(b["toolResult"].get("toolUseId", "")) for b in blocks
                 if isinstance(b.get("toolResult"), dict) and role == "user"]
        if made:
            calls.append((i, made))
        if given:
            answers.append((i, given))
            kinds = ["toolResult" in b for b in blocks if "cachePoint" not in b]
            first_other = next((k for k, r in enumerate(kinds) if not r), len(kinds))
            if any(kinds[first_other:]):
                problems.append(f"messages[{i}]: toolResult blocks must come before any other "
                                "content of the turn")
    return problems + pair_problems(calls, answers, "messages")


def _points(points: Sequence[tuple[str, JSON, JSON | None]]) -> list[str]:
    problems: list[str] = []
    shortest: str | None = None
    for where, block, before in points:
        point = block.get("cachePoint")
        if not isinstance(point, dict) or point.get("type") != "default":
            problems.append(f"{where}.cachePoint: must be {{\"type\": \"default\"}}")
            continue
        ttl = point.get("ttl", DEFAULT_TTL)
        if ttl not in TTL_RANK:
            problems.append(f"{where}.cachePoint.ttl: {ttl!r} is not 5m or 1h")
            continue
        if before is None or not _cacheable(before):
            problems.append(f"{where}: a cachePoint must follow a cacheable block (not "
                            "reasoning, an empty text or another cachePoint)")
        if shortest is not None and TTL_RANK[ttl] > TTL_RANK[shortest]:
            problems.append(f"{where}: a {ttl} cachePoint after a {shortest} one; longer TTLs "
                            "must come first")
        if shortest is None or TTL_RANK[ttl] < TTL_RANK[shortest]:
            shortest = ttl
    if len(points) > MAX_BREAKPOINTS:
        problems.append(f"{len(points)} cachePoint blocks; at most {MAX_BREAKPOINTS}")
    return problems
