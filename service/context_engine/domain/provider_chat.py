"""The request as an OpenAI Chat Completions body (``openai_chat_completions``), also what vLLM,
Ollama and other OpenAI-compatible servers take, and its structural validator.

- The prefix blocks are one ``system`` message, joined by a blank line as the Responses
  ``instructions`` are (the estimator counts one system message and one separator per join).
  ``system``, not ``developer``: OpenAI treats a system message as the developer message for its
  reasoning models, while compatible servers and their chat templates know only ``system``.
- One message per message of the request: user messages as text, the model's text and calls as
  assistant messages (``tool_calls`` of ``{"id", "type": "function", "function": {"name",
  "arguments"}}``, the arguments text verbatim), each result as a ``tool`` message. The API
  wants an assistant message's calls answered by the ``tool`` messages right after it, so a
  result moves up to follow its call's message (after the results already there, in the order
  they arrived), before anything that arrived while the call ran; nothing else moves.
- ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}`` with
  :func:`provider_schema` (no ``strict``: Chat Completions defaults it off, as the Responses
  body sets it). Tool names are mapped as for Responses ("." becomes "__").
- ``prompt_cache_key`` is the session key, as in the Responses body; OpenAI caches
  automatically, so there is no other cache marker.
- Reasoning items are never replayed: Chat Completions has no reasoning input, so a reasoning
  model re-reasons each step. Neither has it the Responses body's ``include``
  (``reasoning.encrypted_content``): there is no stateless reasoning to ask back. Its ``store``
  only keeps completions for evals and distillation and is off by default, so it is left unset:
  the request is stateless as it stands.
- ``max_completion_tokens`` is the output reserve (``max_tokens`` is deprecated and refused by
  OpenAI's reasoning models).
- A call id longer than OpenAI takes here (40 characters) fails the render.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from context_engine.domain.builder import BuildResult
from context_engine.domain.canonical import parse_json_object
from context_engine.domain.errors import AssemblyError
from context_engine.domain.provider_common import (
    JSON,
    OPENAI_CHAT_COMPLETIONS,
    PROVIDER_TOOL_NAME,
    check_call_ids,
    joined_prefix,
    tool_names,
    tool_schemas,
)
from context_engine.domain.request import Role

# "Invalid 'messages[i].tool_calls[k].id': string too long. Expected a string with maximum
# length 40": a longer call id fails the render (renaming it would break its pair).
CALL_ID_MAX = 40


def openai_chat_completions(result: BuildResult) -> JSON:
    """The request as an OpenAI Chat Completions body (see the module docstring)."""
    names = tool_names(result, OPENAI_CHAT_COMPLETIONS)
    check_call_ids(result, OPENAI_CHAT_COMPLETIONS, limit=CALL_ID_MAX)
    req = result.request
    messages: list[JSON] = []
    system = joined_prefix(result)
    if system:
        messages.append({"role": "system", "content": system})
    # Where each call's results go: right after its assistant message and the results
    # already placed there. The messages are built as a list of groups so a late result
    # is inserted without moving anything else.
    groups: list[list[JSON]] = []
    group_of: dict[str, int] = {}
    for m in req.messages:
        if m.role is Role.TOOL:
            at = group_of.get(m.call_id)
            if at is None:
                raise AssemblyError(f"tool result for {m.call_id!r} has no earlier call")
            groups[at].append({"role": "tool", "tool_call_id": m.call_id, "content": m.text})
            continue
        if m.reasoning_provider:
            continue  # no reasoning input in Chat Completions
        if m.role is Role.USER:
            if m.text:
                groups.append([{"role": "user", "content": m.text}])
            continue
        if not m.text and not m.tool_calls:
            continue
        message: JSON = {"role": "assistant"}
        if m.text:
            message["content"] = m.text
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function",
                 "function": {"name": names[c.name], "arguments": c.arguments_json}}
                for c in m.tool_calls]
            for c in m.tool_calls:
                group_of[c.call_id] = len(groups)
        groups.append([message])
    messages += [message for group in groups for message in group]
    body: JSON = {
        "model": result.model_id,
        "messages": messages,
        "prompt_cache_key": result.session_key,
        "max_completion_tokens": result.output_reserve,
    }
    tools: list[JSON] = []
    for t, schema in zip(req.tools, tool_schemas(result), strict=True):
        function: JSON = {"name": names[t.name]}
        if t.description:
            function["description"] = t.description
        function["parameters"] = schema
        tools.append({"type": "function", "function": function})
    if tools:
        body["tools"] = tools
    return body


ROLES = ("system", "developer", "user", "assistant", "tool")


def validate_chat(body: Mapping[str, Any]) -> list[str]:
    """Structural problems of a Chat Completions body; empty when it is valid: roles, content,
    tool definitions and names, and pairing: every assistant message's calls answered, each
    exactly once, by the ``tool`` messages right after it, and no ``tool`` message elsewhere."""
    problems: list[str] = []
    if not isinstance(body.get("model"), str) or not body.get("model"):
        problems.append("model: must be a non-empty string")
    limit = body.get("max_completion_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or limit < 1):
        problems.append("max_completion_tokens: must be a positive integer")
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not key):
        problems.append("prompt_cache_key: must be a non-empty string")
    problems += _tools(body.get("tools"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return [*problems, "messages: must be a non-empty list"]
    pending: dict[str, int] = {}  # calls of the last assistant message not yet answered
    used: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            problems.append(f"{where}: must be an object with role one of {', '.join(ROLES)}")
            continue
        role = m["role"]
        if role != "tool" and pending:
            problems += [f"messages[{at}]: tool call {c!r} has no tool message right after it"
                         for c, at in pending.items()]
            pending = {}
        content = m.get("content")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in pending:
                problems.append(f"{where}: tool message for {call_id!r} does not answer a call "
                                "of the assistant message right before it")
            else:
                del pending[call_id]
            if not isinstance(content, str):
                problems.append(f"{where}.content: must be a string")
            continue
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            if not isinstance(calls, list) or not calls:
                problems.append(f"{where}.tool_calls: must be a non-empty list")
                calls = []
            for j, c in enumerate(calls):
                problems += _call(c, f"{where}.tool_calls[{j}]", used, pending, i)
            if content is not None and not isinstance(content, str):
                problems.append(f"{where}.content: must be a string")
        elif not isinstance(content, str):
            problems.append(f"{where}.content: must be a string")
        elif role == "user" and not content:
            problems.append(f"{where}.content: must not be empty")
    problems += [f"messages[{at}]: tool call {c!r} has no tool message right after it"
                 for c, at in pending.items()]
    return problems


def _call(c: object, where: str, used: set[str], pending: dict[str, int],
          at: int) -> list[str]:
    if not isinstance(c, dict):
        return [f"{where}: not an object"]
    problems: list[str] = []
    call_id = c.get("id")
    if not isinstance(call_id, str) or not call_id:
        problems.append(f"{where}.id: must be a non-empty string")
    elif len(call_id) > CALL_ID_MAX:
        problems.append(f"{where}.id: longer than {CALL_ID_MAX} characters")
    elif call_id in used:
        problems.append(f"{where}.id: {call_id!r} called twice")
    else:
        used.add(call_id)
        pending[call_id] = at
    if c.get("type") != "function":
        problems.append(f"{where}.type: must be 'function'")
    function = c.get("function")
    if not isinstance(function, dict):
        return [*problems, f"{where}.function: must be an object"]
    name = function.get("name")
    if not isinstance(name, str) or PROVIDER_TOOL_NAME.fullmatch(name) is None:
        problems.append(f"{where}.function.name: {name!r} is not a valid tool name")
    args = function.get("arguments")
    if not isinstance(args, str) or parse_json_object(args) is None:
        problems.append(f"{where}.function.arguments: must be JSON object text")
    return problems


def _tools(tools: object) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        return ["tools: not a list"]
    problems: list[str] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        function = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" \
                or not isinstance(function, dict):
            problems.append(f"tools[{i}]: must be a function tool with a function object")
            continue
        name = function.get("name")
        if not isinstance(name, str) or PROVIDER_TOOL_NAME.fullmatch(name) is None:
            problems.append(f"tools[{i}].function.name: {name!r} is not 1-64 characters of "
                            "[A-Za-z0-9_-]")
        elif name in seen:
            problems.append(f"tools[{i}].function.name: duplicate {name!r}")
        else:
            seen.add(name)
        if not isinstance(function.get("parameters"), dict):
            problems.append(f"tools[{i}].function.parameters: must be a JSON schema object")
    return problems
