"""Provider-ready request bodies and their structural validators.

A ``BuildResult`` rendered as one provider's request body: Anthropic Messages and OpenAI
Responses here, OpenAI Chat Completions (``provider_chat.py``), Google Gemini generateContent
(``provider_gemini.py``) and Amazon Bedrock Converse (``provider_bedrock.py``); what they share
is in ``provider_common.py``. :func:`render` renders and then runs the format's own structural
validator: a body it rejects is a defect, never returned. Pure: standard library and domain
only, no I/O. The renderers never author, summarize or reorder what the model reads beyond what
a provider's wire format requires:

- Anthropic (spec: "The history cache window"): consecutive messages of one role merge into one
  turn; tool results move to the start of the user turn that follows their call's turn, all
  results of a batch together; a prefix block of white space alone (a plan stored before
  ``Plan`` refused blank agent instructions) is left out of ``system``, since Anthropic refuses
  it; ``cache_control`` sits on the last tool (after_tools), the last system block
  (after_system) and, for each history marker, the last cacheable block of the conversation
  through its ``through_item`` as the body lays it out (a moved result never stops it short) —
  at most four, never on thinking blocks or empty text, and no longer TTL after a shorter one.
  Only Anthropic reasoning items are replayed, verbatim. A history that opens with the model's
  own turn (a cut without a summary yet) gets one fixed platform line as its first user turn,
  since Anthropic's first message must be the user's.
- OpenAI: one input item per message and per call; ``prompt_cache_key`` is the session key
  (spec: "Session identity and OpenAI history lookback"); only OpenAI reasoning items are
  replayed, verbatim (the builder already limits them to the active run, ADR-0007); the
  request is stateless (``store: false``) and asks a model that reasons (``openai_reasons``)
  for its encrypted reasoning back.

Tool names: providers accept ``[A-Za-z0-9_-]{1,64}``; ours may contain dots. Each "." becomes
"__" (the same mapping for definitions and for replayed calls); two names that map to one, or a
name that cannot be mapped, fail the render with :class:`ProviderFormatError`. Gemini accepts
dots and takes our names as they are (``provider_gemini.py``).

Tool schemas: every body sends :func:`provider_schema` of each definition's input schema,
without ``title`` annotations and empty ``default`` values (spec: "Only history scales with the
window", the token side of the tool-definition cap); every validation keyword stays.

Attachments travel as the text labels the builder already put in their message; sending the
files themselves is the provider adapter's job (request.py), so no file block is rendered here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from context_engine.domain.breakpoints import DEFAULT_TTL
from context_engine.domain.builder import BuildResult
from context_engine.domain.canonical import parse_json_object
from context_engine.domain.errors import AssemblyError, FieldViolation, InvalidInput
from context_engine.domain.model import ToolSpec
from context_engine.domain.plan import PlanSpec
from context_engine.domain.provider_bedrock import bedrock_converse as bedrock_converse
from context_engine.domain.provider_bedrock import validate_bedrock as validate_bedrock
from context_engine.domain.provider_chat import (
    openai_chat_completions as openai_chat_completions,
)
from context_engine.domain.provider_chat import validate_chat as validate_chat
from context_engine.domain.provider_common import ANTHROPIC_MESSAGES as ANTHROPIC_MESSAGES
from context_engine.domain.provider_common import BEDROCK_CONVERSE as BEDROCK_CONVERSE
from context_engine.domain.provider_common import FORMATS as FORMATS
from context_engine.domain.provider_common import (
    GEMINI_GENERATE_CONTENT as GEMINI_GENERATE_CONTENT,
)
from context_engine.domain.provider_common import JSON as JSON
from context_engine.domain.provider_common import LEADING_USER_TEXT as LEADING_USER_TEXT
from context_engine.domain.provider_common import LONG_TTL as LONG_TTL
from context_engine.domain.provider_common import MAX_BREAKPOINTS as MAX_BREAKPOINTS
from context_engine.domain.provider_common import (
    OPENAI_CHAT_COMPLETIONS as OPENAI_CHAT_COMPLETIONS,
)
from context_engine.domain.provider_common import OPENAI_RESPONSES as OPENAI_RESPONSES
from context_engine.domain.provider_common import PROVIDER_TOOL_NAME as PROVIDER_TOOL_NAME
from context_engine.domain.provider_common import TTL_RANK as TTL_RANK
from context_engine.domain.provider_common import ProviderFormatError as ProviderFormatError
from context_engine.domain.provider_common import (
    Turns,
    check_call_ids,
    claude_system_texts,
    claude_tool_schemas,
    marked_blocks,
    message_key,
    reasoning_payload,
    tool_names,
    tool_schemas,
    top_level_refusal,
)
from context_engine.domain.provider_common import generated_title as generated_title
from context_engine.domain.provider_common import provider_schema as provider_schema
from context_engine.domain.provider_common import provider_tool_name as provider_tool_name
from context_engine.domain.provider_common import provider_tool_names as provider_tool_names
from context_engine.domain.provider_formats import gemini_tool_name
from context_engine.domain.provider_gemini import GEMINI_TOOL_NAME
from context_engine.domain.provider_gemini import GeminiCachedContent as GeminiCachedContent
from context_engine.domain.provider_gemini import gemini_cached_content as gemini_cached_content
from context_engine.domain.provider_gemini import (
    gemini_generate_content as gemini_generate_content,
)
from context_engine.domain.provider_gemini import validate_gemini as validate_gemini
from context_engine.domain.request import Role

UNCACHEABLE_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# What an Anthropic reasoning item may replay: a thinking or redacted_thinking block as the API
# returned it, field by field (no cache_control, which Anthropic refuses on a thinking block).
ANTHROPIC_REASONING = {"thinking": ("thinking", "signature"), "redacted_thinking": ("data",)}
OPENAI_REASONING = frozenset({"reasoning"})
OPENAI_INCLUDE = ("reasoning.encrypted_content",)
# The OpenAI models that reason: the o-series and gpt-5, but gpt-5-chat. OpenAI refuses a
# request that asks any other model for its encrypted reasoning (400 "Encrypted content is
# not supported with this model.", param ``include``), so only these are asked.
OPENAI_REASONING_PREFIXES = ("o1", "o3", "o4", "gpt-5", "codex-mini")
OPENAI_NON_REASONING_PREFIXES = ("gpt-5-chat",)


def openai_reasons(model_id: str) -> bool:
    """Whether an OpenAI model reasons, and so takes ``include``'s encrypted reasoning (a
    fine-tuned model, ``ft:<base>:...``, as its base does)."""
    base = model_id.removeprefix("ft:")
    return (base.startswith(OPENAI_REASONING_PREFIXES)
            and not base.startswith(OPENAI_NON_REASONING_PREFIXES))
RESPONSES_CALL_ID_MAX = 64  # "Invalid 'input[i].call_id': ... maximum length 64"


# ----------------------------------------------------------------------------- Anthropic

def _cache_control(ttl: str) -> JSON:
    return {"type": "ephemeral", "ttl": LONG_TTL} if ttl == LONG_TTL else {"type": "ephemeral"}


ANTHROPIC_TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_-]+")


def _cacheable(block: JSON) -> bool:
    if block.get("type") in UNCACHEABLE_BLOCKS:
        return False
    return not (block.get("type") == "text" and not str(block.get("text", "")).strip())


def anthropic_messages(result: BuildResult) -> JSON:
    """The request as an Anthropic Messages API body (see the module docstring)."""
    fmt = ANTHROPIC_MESSAGES
    names = tool_names(result, fmt)
    # Anthropic refuses a tool_use id outside ^[a-zA-Z0-9_-]+$ (an OpenAI-style
    # "functions.web_fetch:0" of a session routed from another provider, say)
    check_call_ids(result, fmt, limit=256, pattern=ANTHROPIC_TOOL_USE_ID,
                   rule="made of [a-zA-Z0-9_-] only (a tool_use id)")
    req = result.request
    tools: list[JSON] = []
    for t, schema in zip(req.tools, claude_tool_schemas(result, fmt), strict=True):
        tool: JSON = {"name": names[t.name], "input_schema": schema}
        if t.description:
            tool["description"] = t.description
        tools.append(tool)
    system: list[JSON] = [{"type": "text", "text": t} for t in claude_system_texts(result)]
    if not tools and any(m.tool_calls for m in req.messages):
        # 400 "Requests which include `tool_use` or `tool_result` blocks must define tools."
        raise ProviderFormatError(fmt, [FieldViolation(
            "checkpoint.items", "Anthropic takes tool_use and tool_result blocks only in a "
            "request that defines tools, and the plan pins none")])

    turns = Turns(model_role="assistant")
    for m in req.messages:
        key = message_key(m)
        if m.role is Role.TOOL:
            # Anthropic: a result sits in the user turn right after its call's turn.
            turns.add("user", {"type": "tool_result", "tool_use_id": m.call_id,
                               "content": m.text}, key, result_of=m.call_id)
            continue
        role = "user" if m.role is Role.USER else "assistant"
        if m.reasoning_provider:
            if m.reasoning_provider == "anthropic":
                turns.add(role, reasoning_payload(m, fmt, ANTHROPIC_REASONING), key)
            continue  # another provider's reasoning means nothing here
        if m.text.strip():  # Anthropic refuses a text block of white space only
            turns.add(role, {"type": "text", "text": m.text}, key)
        for c in m.tool_calls:
            turns.add(role, {"type": "tool_use", "id": c.call_id, "name": names[c.name],
                             "input": parse_json_object(c.arguments_json) or {}}, key,
                      call_id=c.call_id)
    turns.lead({"type": "text", "text": LEADING_USER_TEXT})
    messages: list[JSON] = [{"role": t.role, "content": t.content()} for t in turns.turns]
    for block, ttl in marked_blocks(result, tools=tools, system=system, turns=turns,
                                    cacheable=_cacheable):
        block["cache_control"] = _cache_control(ttl)

    body: JSON = {"model": result.model_id, "max_tokens": result.output_reserve,
                  "system": system, "messages": messages}
    if tools:
        body["tools"] = tools
    return body


# ----------------------------------------------------------------------------- OpenAI

def openai_responses(result: BuildResult) -> JSON:
    """The request as an OpenAI Responses API body (see the module docstring)."""
    fmt = OPENAI_RESPONSES
    names = tool_names(result, fmt)
    check_call_ids(result, fmt, limit=RESPONSES_CALL_ID_MAX)
    req = result.request
    items: list[JSON] = []
    for m in req.messages:
        if m.role is Role.TOOL:
            items.append({"type": "function_call_output", "call_id": m.call_id,
                          "output": m.text})
            continue
        if m.reasoning_provider:
            if m.reasoning_provider == "openai":
                items.append(reasoning_payload(m, fmt, OPENAI_REASONING))
            continue
        if m.text:
            if m.role is Role.USER:
                part: JSON = {"type": "input_text", "text": m.text}
            else:
                part = {"type": "output_text", "text": m.text, "annotations": []}
            items.append({"type": "message", "role": m.role.value, "content": [part]})
        for c in m.tool_calls:
            items.append({"type": "function_call", "call_id": c.call_id,
                          "name": names[c.name], "arguments": c.arguments_json})
    tools: list[JSON] = []
    for t, schema in zip(req.tools, tool_schemas(result), strict=True):
        tool: JSON = {"type": "function", "name": names[t.name],
                      "parameters": schema, "strict": False}
        if t.description:
            tool["description"] = t.description
        tools.append(tool)
    body: JSON = {
        "model": result.model_id,
        "instructions": "\n\n".join(b.text for b in req.prefix_blocks if b.text),
        "input": items,
        "prompt_cache_key": result.session_key,
        "max_output_tokens": result.output_reserve,
        "store": False,
    }
    if openai_reasons(result.model_id):
        body["include"] = list(OPENAI_INCLUDE)
    if tools:
        body["tools"] = tools
    return body


# ----------------------------------------------------------------------------- dispatch

RENDERERS: Mapping[str, Callable[[BuildResult], JSON]] = {
    ANTHROPIC_MESSAGES: anthropic_messages,
    OPENAI_RESPONSES: openai_responses,
    OPENAI_CHAT_COMPLETIONS: openai_chat_completions,
    GEMINI_GENERATE_CONTENT: gemini_generate_content,
    BEDROCK_CONVERSE: bedrock_converse,
}


def render(result: BuildResult, provider_format: str, *, long_ttl: bool = False) -> JSON:
    """Render and validate: a body our own validator rejects is a defect, never returned.
    ``long_ttl``: the model takes a one-hour cache TTL in a Bedrock body (the catalog entry's,
    which Build passes); the other formats send the plan's TTL as it is."""
    renderer = RENDERERS.get(provider_format)
    if renderer is None:
        raise InvalidInput.one("provider_format", f"unknown provider format {provider_format!r}")
    body = (bedrock_converse(result, long_ttl=long_ttl) if provider_format == BEDROCK_CONVERSE
            else renderer(result))
    problems = validate(body, provider_format)
    if problems:
        raise AssemblyError(f"rendered {provider_format} body is invalid: {problems}")
    return body


# ----------------------------------------------------------------------------- plan time

def sent_name_violations(names: Sequence[str], provider_format: str,
                         catalog: Sequence[ToolSpec]) -> list[FieldViolation]:
    """What a drafted plan's tool definitions (``names``, control tools included) break when
    sent in ``provider_format``, the model's own: a name over the 64 characters the provider
    takes once mapped (dots as "__"; Gemini's "_" before a leading digit, "-" or "."), or two
    names that map to one. Every Build of the plan in that format would be unrenderable; a
    Build asking another format is judged when it asks (PROVIDER_FORMAT_UNRENDERABLE)."""
    if not provider_format:
        return []
    gemini = provider_format == GEMINI_GENERATE_CONTENT
    sent, taken = ((gemini_tool_name, GEMINI_TOOL_NAME) if gemini
                   else (provider_tool_name, PROVIDER_TOOL_NAME))
    where = {t.name: i for i, t in enumerate(catalog)}
    # the service's own tools first: a catalog name colliding with one is the one named
    ordered = sorted(names, key=lambda n: (n in where, where.get(n, 0)))
    mapped: dict[str, str] = {}
    found = []
    for name in ordered:
        theirs = sent(name)
        other = mapped.setdefault(theirs, name)
        field = f"tool_catalog[{where[name]}].name" if name in where else "tool_catalog"
        if other != name:
            found.append(FieldViolation(field, f"{name!r} and {other!r} are the same tool name "
                                        f"to {provider_format} ({theirs!r})"))
        elif not taken.fullmatch(theirs):
            found.append(FieldViolation(field, f"{name!r} is sent to {provider_format} as "
                                        f"{theirs!r}, {len(theirs)} characters: over the 64 it "
                                        "takes"))
    return found


def unsendable_definitions(spec: PlanSpec, provider_format: str, catalog: Sequence[ToolSpec],
                           model_id: str) -> list[FieldViolation]:
    """What a drafted plan's tool definitions break in ``provider_format``, the model's own:
    their names (:func:`sent_name_violations`) and their schemas
    (:func:`sent_schema_violations`)."""
    return (sent_name_violations(spec.tool_names, provider_format, catalog)
            + sent_schema_violations(spec.tools, provider_format, catalog, model_id))


def sent_schema_violations(tools: Sequence[ToolSpec], provider_format: str,
                           catalog: Sequence[ToolSpec], model_id: str) -> list[FieldViolation]:
    """What a drafted plan's tool definitions break in ``provider_format``, the model's own,
    by their input schemas: alternatives at the top level, which Claude refuses
    (:func:`top_level_refusal`). Like :func:`sent_name_violations`, every Build of the plan in
    that format would be unrenderable; another format is judged when a Build asks it."""
    where = {t.name: i for i, t in enumerate(catalog)}
    found = []
    for t in tools:
        why = top_level_refusal(t.name, t.input_schema, provider_format, model_id)
        if why is not None:
            field = (f"tool_catalog[{where[t.name]}].input_schema_json" if t.name in where
                     else "tool_catalog")
            found.append(FieldViolation(field, why))
    return found


# ----------------------------------------------------------------------------- validators

def validate(body: Mapping[str, Any], provider_format: str) -> list[str]:
    """Structural problems of a ``provider_format`` body; empty when it is valid."""
    validator = VALIDATORS.get(provider_format)
    if validator is None:
        return [f"unknown provider format {provider_format!r}"]
    return validator(body)


def _tool_defs(tools: object, name_key: str, problems: list[str]) -> list[JSON]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        problems.append("tools: not a list")
        return []
    seen: set[str] = set()
    out: list[JSON] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            problems.append(f"tools[{i}]: not an object")
            continue
        out.append(t)
        name = t.get(name_key)
        if not isinstance(name, str) or PROVIDER_TOOL_NAME.fullmatch(name) is None:
            problems.append(f"tools[{i}].name: {name!r} is not 1-64 characters of "
                            "[A-Za-z0-9_-]")
        elif name in seen:
            problems.append(f"tools[{i}].name: duplicate {name!r}")
        else:
            seen.add(name)
    return out


def _blocks(content: object) -> list[JSON] | None:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return list(content)
    return None


def validate_anthropic(body: Mapping[str, Any]) -> list[str]:
    """Structural problems of an Anthropic Messages body; empty when it is valid."""
    problems: list[str] = []
    if not isinstance(body.get("model"), str) or not body.get("model"):
        problems.append("model: must be a non-empty string")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        problems.append("max_tokens: must be a positive integer")
    tools = _tool_defs(body.get("tools"), "name", problems)
    for i, t in enumerate(tools):
        schema = t.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            problems.append(f"tools[{i}].input_schema: must be a JSON schema of type object")
    system_blocks = _blocks(body.get("system", []))
    if system_blocks is None:
        problems.append("system: must be a string or a list of text blocks")
        system_blocks = []
    for i, b in enumerate(system_blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            problems.append(f"system[{i}]: must be a text block")
        elif not b["text"].strip():  # Anthropic refuses text blocks of white space only
            problems.append(f"system[{i}]: text blocks must hold more than white space")

    # Breakpoints, in request order: tools -> system -> messages.
    marked: list[tuple[str, JSON]] = []
    if isinstance(body.get("cache_control"), dict):
        marked.append(("cache_control", body["cache_control"]))
    marked += [(f"tools[{i}]", t) for i, t in enumerate(tools)]
    marked += [(f"system[{i}]", b) for i, b in enumerate(system_blocks)]

    messages = body.get("messages")
    turns: list[tuple[str, list[JSON]]] = []
    if not isinstance(messages, list) or not messages:
        problems.append("messages: must be a non-empty list")
        messages = []
    for i, m in enumerate(messages):
        blocks = _blocks(m.get("content")) if isinstance(m, dict) else None
        role = m.get("role") if isinstance(m, dict) else None
        if blocks is None or role not in ("user", "assistant"):
            problems.append(f"messages[{i}]: must have role user or assistant and content")
            turns.append(("", []))
            continue
        turns.append((str(role), blocks))
        if not blocks:
            problems.append(f"messages[{i}].content: must not be empty")
        marked += [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(blocks)]
    if turns and turns[0][0] != "user":
        problems.append("messages[0]: the first message must have the user role")
    for i in range(1, len(turns)):
        if turns[i][0] and turns[i][0] == turns[i - 1][0]:
            problems.append(f"messages[{i}]: two {turns[i][0]} turns in a row; roles alternate")

    problems += _anthropic_pairs(turns)
    problems += _anthropic_blocks(turns)
    problems += _anthropic_breakpoints(marked)
    return problems


def _anthropic_blocks(turns: Sequence[tuple[str, list[JSON]]]) -> list[str]:
    problems: list[str] = []
    allowed = {"user": {"text", "image", "document", "tool_result", "search_result"},
               "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}
    for i, (role, blocks) in enumerate(turns):
        for j, b in enumerate(blocks):
            kind = b.get("type")
            where = f"messages[{i}].content[{j}]"
            if role and kind not in allowed[role]:
                problems.append(f"{where}: a {kind!r} block is not allowed in a {role} turn")
            if kind == "text" and (not isinstance(b.get("text"), str) or not b["text"].strip()):
                problems.append(f"{where}: text blocks must hold more than white space")
            if kind == "tool_use":
                name = b.get("name")
                if not isinstance(name, str) or PROVIDER_TOOL_NAME.fullmatch(name) is None:
                    problems.append(f"{where}.name: {name!r} is not a valid tool name")
                if not isinstance(b.get("input"), dict):
                    problems.append(f"{where}.input: must be an object")
    return problems


def _anthropic_pairs(turns: Sequence[tuple[str, list[JSON]]]) -> list[str]:
    """Every tool_use is answered in the next user turn, results first; every tool_result
    answers a tool_use of the turn right before it; no id twice."""
    problems: list[str] = []
    used: set[str] = set()
    for i, (role, blocks) in enumerate(turns):
        calls = [str(b.get("id", "")) for b in blocks if b.get("type") == "tool_use"]
        results = [str(b.get("tool_use_id", "")) for b in blocks
                   if b.get("type") == "tool_result"]
        for c in calls:
            if not c:
                problems.append(f"messages[{i}]: a tool_use without an id")
            elif c in used:
                problems.append(f"messages[{i}]: tool_use id {c!r} used twice")
            used.add(c)
        if results:
            kinds = [b.get("type") for b in blocks]
            first_other = next((k for k, t in enumerate(kinds) if t != "tool_result"),
                               len(kinds))
            if "tool_result" in kinds[first_other:]:
                problems.append(f"messages[{i}]: tool_result blocks must come before any "
                                "other content of the turn")
            before = turns[i - 1] if i > 0 else ("", [])
            called = {str(b.get("id", "")) for b in before[1] if b.get("type") == "tool_use"}
            if role != "user" or before[0] != "assistant":
                problems.append(f"messages[{i}]: tool_result blocks belong in the user turn "
                                "right after the tool_use turn")
            seen: set[str] = set()
            for r in results:
                if r in seen:
                    problems.append(f"messages[{i}]: tool_use {r!r} answered twice")
                seen.add(r)
                if r not in called:
                    problems.append(f"messages[{i}]: tool_result {r!r} answers no tool_use "
                                    "of the previous turn")
        if calls:
            after = turns[i + 1] if i + 1 < len(turns) else ("", [])
            answered = {str(b.get("tool_use_id", "")) for b in after[1]
                        if b.get("type") == "tool_result"}
            for c in calls:
                if c and (after[0] != "user" or c not in answered):
                    problems.append(f"messages[{i}]: tool_use {c!r} has no tool_result in "
                                    "the next user turn")
    return problems


def _anthropic_breakpoints(marked: Sequence[tuple[str, JSON]]) -> list[str]:
    problems: list[str] = []
    count = 0
    shortest: str | None = None
    for where, block in marked:
        cc = block.get("cache_control")
        if cc is None:
            continue
        count += 1
        if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
            problems.append(f"{where}.cache_control: must be {{\"type\": \"ephemeral\"}}")
            continue
        ttl = cc.get("ttl", DEFAULT_TTL)
        if ttl not in TTL_RANK:
            problems.append(f"{where}.cache_control.ttl: {ttl!r} is not 5m or 1h")
            continue
        if where.startswith("messages") and not _cacheable(block):
            problems.append(f"{where}: cache_control is not allowed on a "
                            f"{block.get('type')!r} block or empty text")
        if shortest is not None and TTL_RANK[ttl] > TTL_RANK[shortest]:
            problems.append(f"{where}: a {ttl} breakpoint after a {shortest} one; longer TTLs "
                            "must come first")
        if shortest is None or TTL_RANK[ttl] < TTL_RANK[shortest]:
            shortest = ttl
    if count > MAX_BREAKPOINTS:
        problems.append(f"{count} cache_control breakpoints; at most {MAX_BREAKPOINTS}")
    return problems


def validate_openai(body: Mapping[str, Any]) -> list[str]:
    """Structural problems of an OpenAI Responses body; empty when it is valid."""
    problems: list[str] = []
    if not isinstance(body.get("model"), str) or not body.get("model"):
        problems.append("model: must be a non-empty string")
    if "instructions" in body and not isinstance(body["instructions"], str):
        problems.append("instructions: must be a string")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or limit < 1):
        problems.append("max_output_tokens: must be a positive integer")
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not key):
        problems.append("prompt_cache_key: must be a non-empty string")
    include = body.get("include")
    if (isinstance(include, list) and OPENAI_INCLUDE[0] in include
            and not openai_reasons(str(body.get("model") or ""))):
        problems.append(f"include: {OPENAI_INCLUDE[0]} asked of a model that does not reason "
                        "(OpenAI refuses it)")
    for i, t in enumerate(_tool_defs(body.get("tools"), "name", problems)):
        if t.get("type") != "function":
            problems.append(f"tools[{i}].type: must be 'function'")
        if not isinstance(t.get("parameters"), dict):
            problems.append(f"tools[{i}].parameters: must be a JSON schema object")
    items = body.get("input")
    if not isinstance(items, list):
        return [*problems, "input: must be a list of items"]
    content_types = {"user": {"input_text", "input_image", "input_file"},
                     "system": {"input_text"}, "developer": {"input_text"},
                     "assistant": {"output_text", "refusal"}}
    called: dict[str, int] = {}
    answered: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: not an object")
            continue
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            parts = item.get("content")
            if role not in content_types:
                problems.append(f"{where}.role: {role!r} is not a message role")
            elif isinstance(parts, list):
                for j, p in enumerate(parts):
                    ptype = p.get("type") if isinstance(p, dict) else None
                    if ptype not in content_types[str(role)]:
                        problems.append(f"{where}.content[{j}]: a {ptype!r} part is not "
                                        f"allowed in a {role} message")
            elif not isinstance(parts, str):
                problems.append(f"{where}.content: must be a string or a list of parts")
        elif kind == "function_call":
            call_id = item.get("call_id")
            name = item.get("name")
            if not isinstance(call_id, str) or not call_id:
                problems.append(f"{where}.call_id: must be a non-empty string")
            elif len(call_id) > RESPONSES_CALL_ID_MAX:
                problems.append(f"{where}.call_id: longer than {RESPONSES_CALL_ID_MAX}")
            elif call_id in called:
                problems.append(f"{where}.call_id: {call_id!r} called twice")
            else:
                called[call_id] = i
            if not isinstance(name, str) or PROVIDER_TOOL_NAME.fullmatch(name) is None:
                problems.append(f"{where}.name: {name!r} is not a valid tool name")
            args = item.get("arguments")
            if not isinstance(args, str) or parse_json_object(args) is None:
                problems.append(f"{where}.arguments: must be JSON object text")
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in called:
                problems.append(f"{where}: output for {call_id!r} without an earlier "
                                "function_call")
            elif call_id in answered:
                problems.append(f"{where}: {call_id!r} answered twice")
            else:
                answered.add(call_id)
            if not isinstance(item.get("output"), (str, list)):
                problems.append(f"{where}.output: must be a string or a list of parts")
        elif not isinstance(kind, str):
            problems.append(f"{where}.type: must be a string")
    for call_id, i in called.items():
        if call_id not in answered:
            problems.append(f"input[{i}]: function_call {call_id!r} has no "
                            "function_call_output")
    return problems


VALIDATORS: Mapping[str, Callable[[Mapping[str, Any]], list[str]]] = {
    ANTHROPIC_MESSAGES: validate_anthropic,
    OPENAI_RESPONSES: validate_openai,
    OPENAI_CHAT_COMPLETIONS: validate_chat,
    GEMINI_GENERATE_CONTENT: validate_gemini,
    BEDROCK_CONVERSE: validate_bedrock,
}
