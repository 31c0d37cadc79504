"""An independent check of tool pairing in what Build returned, for tests.

Shares no code with ``context_engine.domain.pairs`` or ``context_engine.domain.providers``: it
reads only the wire forms a caller receives, the ``ModelRequest`` proto and the provider bodies
(``provider_body_json``), and states the rules the providers enforce:

* ``ModelRequest``: every tool call has exactly one result after it, every result has a call
  before it, no call id is called twice, none is empty.
* Anthropic Messages: every ``tool_use`` of an assistant turn is answered by a ``tool_result``
  in the user turn right after it, those results come first in that turn, and no result answers
  anything else; ids are unique.
* OpenAI Responses: every ``function_call`` has exactly one ``function_call_output`` after it,
  every output a call before it; call ids are unique.
* OpenAI Chat Completions: system (or developer) messages only lead; an assistant message
  with ``tool_calls`` is followed at once by one ``tool`` message per call (its
  ``tool_call_id``), nothing else between them, and a ``tool`` message answers only the
  assistant message right before that run of tool messages; ids are unique; an assistant
  message has content or calls.
* Gemini generateContent: contents alternate ``user`` / ``model`` from a ``user`` turn;
  ``functionCall`` parts only in ``model`` turns, ``functionResponse`` parts only in ``user``
  turns; the turn right after a call turn answers it with exactly as many
  ``functionResponse`` parts, the k-th answering the k-th call by name and, where both carry
  one, by id ("Please ensure that the number of function response parts is equal to the
  number of function call parts of the function call turn"); responses answer only the turn
  right before; ids, where present, are unique.
* Bedrock Converse: messages alternate ``user`` / ``assistant`` from a ``user`` message;
  every ``toolUse`` of an assistant message is answered by a ``toolResult`` in the user
  message right after it, those results come first in that message (``cachePoint`` markers
  aside), and no result answers anything else; ``toolUseId`` values are unique.

Each function returns a list of problems, empty when the request is well paired.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from context_engine.v1 import context_engine_pb2 as pb


def request_problems(request: pb.ModelRequest) -> list[str]:
    """Pairing problems of the proto request's messages."""
    problems: list[str] = []
    called_at: dict[str, int] = {}
    results: Counter[str] = Counter()
    for index, message in enumerate(request.messages):
        for call in message.tool_calls:
            cid = call.call_id
            if not cid:
                problems.append(f"message {index}: a tool call without an id")
            if cid in called_at:
                problems.append(f"message {index}: call {cid!r} called again "
                                f"(first in message {called_at[cid]})")
            else:
                called_at[cid] = index
        if message.role == pb.ROLE_TOOL:
            cid = message.call_id
            if message.tool_calls:
                problems.append(f"message {index}: a tool result that also calls tools")
            if cid not in called_at:
                problems.append(f"message {index}: result for {cid!r} without an earlier call")
            results[cid] += 1
            if results[cid] == 2:
                problems.append(f"message {index}: call {cid!r} answered twice")
        elif message.call_id:
            problems.append(f"message {index}: a {pb.Role.Name(message.role)} message names "
                            f"call {message.call_id!r}")
    for cid, index in called_at.items():
        if results[cid] == 0:
            problems.append(f"message {index}: call {cid!r} has no result")
    return problems


def body_problems(body_json: str, provider_format: int) -> list[str]:
    """Pairing problems of a provider body (``provider_body_json``) of ``provider_format``."""
    try:
        body = json.loads(body_json)
    except ValueError as exc:
        return [f"provider body is not JSON: {exc}"]
    if not isinstance(body, dict):
        return ["provider body is not a JSON object"]
    if provider_format == pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES:
        return anthropic_problems(body)
    if provider_format == pb.PROVIDER_FORMAT_OPENAI_RESPONSES:
        return openai_problems(body)
    if provider_format == pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS:
        return chat_completions_problems(body)
    if provider_format == pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT:
        return gemini_problems(body)
    if provider_format == pb.PROVIDER_FORMAT_BEDROCK_CONVERSE:
        return bedrock_problems(body)
    return [f"a provider body for format {provider_format}"]


def problems_of(body: dict[str, Any], provider_format: str) -> list[str]:
    """Pairing problems of a parsed body, by the format's name (``providers.FORMATS``)."""
    checks = {"anthropic_messages": anthropic_problems, "openai_responses": openai_problems,
              "openai_chat_completions": chat_completions_problems,
              "gemini_generate_content": gemini_problems,
              "bedrock_converse": bedrock_problems}
    if provider_format not in checks:
        return [f"no pairing check for format {provider_format!r}"]
    return checks[provider_format](body)


def _content(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content if isinstance(content, list) else []


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else None


def anthropic_problems(body: dict[str, Any]) -> list[str]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ["anthropic body has no messages list"]
    problems: list[str] = []
    seen_uses: set[str] = set()
    seen_results: set[str] = set()
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        blocks = _content(message)
        uses = [str(b.get("id", "")) for b in blocks if _kind(b) == "tool_use"]
        results = [str(b.get("tool_use_id", "")) for b in blocks if _kind(b) == "tool_result"]
        if uses and role != "assistant":
            problems.append(f"messages[{index}]: tool_use in a {role!r} turn")
        if results and role != "user":
            problems.append(f"messages[{index}]: tool_result in a {role!r} turn")
        for cid in uses:
            if not cid:
                problems.append(f"messages[{index}]: tool_use without an id")
            if cid in seen_uses:
                problems.append(f"messages[{index}]: tool_use id {cid!r} used twice")
            seen_uses.add(cid)
        for cid in results:
            if cid in seen_results:
                problems.append(f"messages[{index}]: {cid!r} answered twice")
            seen_results.add(cid)
        # results lead their turn: nothing but tool_result before the last one
        kinds = [_kind(b) for b in blocks]
        if "tool_result" in kinds:
            last = len(kinds) - 1 - kinds[::-1].index("tool_result")
            if any(k != "tool_result" for k in kinds[:last]):
                problems.append(f"messages[{index}]: tool_result after other content {kinds}")
        # each result answers a tool_use of the assistant turn right before
        before = messages[index - 1] if index > 0 else None
        asked = ({str(b.get("id", "")) for b in _content(before) if _kind(b) == "tool_use"}
                 if isinstance(before, dict) and before.get("role") == "assistant" else set())
        for cid in results:
            if cid not in asked:
                problems.append(f"messages[{index}]: result for {cid!r} does not follow its "
                                "tool_use in the turn before")
        # each tool_use is answered in the turn right after
        if uses:
            after = messages[index + 1] if index + 1 < len(messages) else None
            answered = ({str(b.get("tool_use_id", "")) for b in _content(after)
                         if _kind(b) == "tool_result"}
                        if isinstance(after, dict) and after.get("role") == "user" else set())
            for cid in uses:
                if cid not in answered:
                    problems.append(f"messages[{index}]: tool_use {cid!r} is not answered in "
                                    "the next user turn")
    return problems


def openai_problems(body: dict[str, Any]) -> list[str]:
    items = body.get("input")
    if not isinstance(items, list):
        return ["openai body has no input list"]
    problems: list[str] = []
    called: set[str] = set()
    answered: Counter[str] = Counter()
    for index, entry in enumerate(items):
        kind = _kind(entry)
        if kind == "function_call":
            cid = str(entry.get("call_id", ""))
            if not cid:
                problems.append(f"input[{index}]: function_call without a call_id")
            if cid in called:
                problems.append(f"input[{index}]: call_id {cid!r} called twice")
            called.add(cid)
        elif kind == "function_call_output":
            cid = str(entry.get("call_id", ""))
            if cid not in called:
                problems.append(f"input[{index}]: output for {cid!r} without an earlier call")
            answered[cid] += 1
            if answered[cid] == 2:
                problems.append(f"input[{index}]: {cid!r} answered twice")
    problems += [f"function_call {cid!r} has no output" for cid in sorted(called)
                 if not answered[cid]]
    return problems


# ----------------------------------------------------------------------- Chat Completions

def chat_completions_problems(body: dict[str, Any]) -> list[str]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ["chat completions body has no messages list"]
    problems: list[str] = []
    seen_calls: set[str] = set()
    answered: Counter[str] = Counter()
    open_calls: list[str] = []  # the calls of the assistant message the tool run answers
    open_at = -1
    conversation_started = False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            problems.append(f"messages[{index}]: not an object")
            continue
        role = message.get("role")
        if role in ("system", "developer"):
            if conversation_started:
                problems.append(f"messages[{index}]: a {role} message after the conversation "
                                "started (system text mid-conversation reads as instructions)")
            continue
        conversation_started = True
        if role != "tool" and open_calls:
            problems.append(f"messages[{open_at}]: tool_calls {sorted(open_calls)} are not "
                            f"all answered before messages[{index}] ({role})")
            open_calls = []
        if role == "tool":
            cid = message.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                problems.append(f"messages[{index}]: a tool message without a tool_call_id")
                continue
            answered[cid] += 1
            if answered[cid] == 2:
                problems.append(f"messages[{index}]: {cid!r} answered twice")
            elif cid in open_calls:
                open_calls.remove(cid)
            elif cid in seen_calls:
                problems.append(f"messages[{index}]: result for {cid!r} is not in the run of "
                                "tool messages right after its assistant message")
            else:
                problems.append(f"messages[{index}]: result for {cid!r} without an earlier "
                                "call")
            if message.get("tool_calls"):
                problems.append(f"messages[{index}]: a tool message that also calls tools")
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                problems.append(f"messages[{index}].tool_calls: not a list")
                calls = []
            if not calls and not _has_text(message.get("content")):
                problems.append(f"messages[{index}]: an assistant message with neither "
                                "content nor tool_calls")
            for k, call in enumerate(calls):
                cid = call.get("id") if isinstance(call, dict) else None
                if not isinstance(cid, str) or not cid:
                    problems.append(f"messages[{index}].tool_calls[{k}]: without an id")
                    continue
                if cid in seen_calls:
                    problems.append(f"messages[{index}]: call id {cid!r} used twice")
                seen_calls.add(cid)
                open_calls.append(cid)
            open_at = index
        elif role == "user":
            pass
        else:
            problems.append(f"messages[{index}]: role {role!r} is not a chat role")
    if open_calls:  # every call was open until answered: none is left out of this
        problems.append(f"messages[{open_at}]: tool_calls {sorted(open_calls)} have no tool "
                        "message")
    return problems


def _has_text(content: Any) -> bool:
    if isinstance(content, str):
        return bool(content)
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("text") for p in content)


# ----------------------------------------------------------------------- Gemini

def gemini_problems(body: dict[str, Any]) -> list[str]:
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        return ["gemini body has no contents list"]
    problems: list[str] = []
    turns: list[tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]] = []
    for index, content in enumerate(contents):
        role = content.get("role") if isinstance(content, dict) else None
        parts = content.get("parts") if isinstance(content, dict) else None
        if not isinstance(parts, list):
            problems.append(f"contents[{index}]: no parts list")
            parts = []
        calls = [p["functionCall"] for p in parts
                 if isinstance(p, dict) and isinstance(p.get("functionCall"), dict)]
        results = [p["functionResponse"] for p in parts
                   if isinstance(p, dict) and isinstance(p.get("functionResponse"), dict)]
        turns.append((role, calls, results))
        if role not in ("user", "model"):
            problems.append(f"contents[{index}]: role {role!r} is not user or model")
        if calls and role != "model":
            problems.append(f"contents[{index}]: functionCall in a {role!r} turn")
        if results and role != "user":
            problems.append(f"contents[{index}]: functionResponse in a {role!r} turn")
    if turns and turns[0][0] != "user":
        problems.append("contents[0]: the first turn must be the user's")
    for index in range(1, len(turns)):
        if turns[index][0] == turns[index - 1][0]:
            problems.append(f"contents[{index}]: two {turns[index][0]!r} turns in a row")
    seen_ids: set[str] = set()
    for index, (_, calls, results) in enumerate(turns):
        for call in calls:
            cid = call.get("id")
            if cid is not None:
                if not isinstance(cid, str) or not cid:
                    problems.append(f"contents[{index}]: a functionCall with an empty id")
                elif cid in seen_ids:
                    problems.append(f"contents[{index}]: functionCall id {cid!r} used twice")
                seen_ids.add(str(cid))
            if not isinstance(call.get("name"), str) or not call.get("name"):
                problems.append(f"contents[{index}]: a functionCall without a name")
        if calls:
            after = turns[index + 1] if index + 1 < len(turns) else (None, [], [])
            if not after[2]:
                problems.append(f"contents[{index}]: function calls "
                                f"{[_call_key(c) for c in calls]} are not answered in the "
                                "next turn")
            elif len(after[2]) != len(calls):
                problems.append(f"contents[{index + 1}]: {len(after[2])} function responses "
                                f"for the {len(calls)} calls of the turn before")
            for k, (call, result) in enumerate(zip(calls, after[2], strict=False)):
                if result.get("name") != call.get("name"):
                    problems.append(f"contents[{index + 1}]: response {k} is named "
                                    f"{result.get('name')!r}, call {k} {call.get('name')!r}")
                if (call.get("id") is not None or result.get("id") is not None) \
                        and result.get("id") != call.get("id"):
                    problems.append(f"contents[{index + 1}]: response {k} has id "
                                    f"{result.get('id')!r}, call {k} {call.get('id')!r}")
        if results:
            before = turns[index - 1] if index > 0 else (None, [], [])
            if not before[1]:
                problems.append(f"contents[{index}]: function responses "
                                f"{[_call_key(r) for r in results]} do not follow a function "
                                "call turn")
    return problems


def _call_key(part: dict[str, Any]) -> str:
    return f"{part.get('name')}#{part.get('id')}" if part.get("id") else str(part.get("name"))


# ----------------------------------------------------------------------- Bedrock Converse

def bedrock_problems(body: dict[str, Any]) -> list[str]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ["bedrock body has no messages list"]
    problems: list[str] = []
    turns: list[tuple[Any, list[dict[str, Any]]]] = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        if not isinstance(content, list) or not content:
            problems.append(f"messages[{index}]: no content blocks")
        if role not in ("user", "assistant"):
            problems.append(f"messages[{index}]: role {role!r} is not user or assistant")
        turns.append((role, blocks))
    if turns and turns[0][0] != "user":
        problems.append("messages[0]: the first message must be the user's")
    for index in range(1, len(turns)):
        if turns[index][0] == turns[index - 1][0]:
            problems.append(f"messages[{index}]: two {turns[index][0]!r} messages in a row")

    def uses(blocks: list[dict[str, Any]]) -> list[str]:
        return [str(b["toolUse"].get("toolUseId", "")) for b in blocks
                if isinstance(b.get("toolUse"), dict)]

    def results(blocks: list[dict[str, Any]]) -> list[str]:
        return [str(b["toolResult"].get("toolUseId", "")) for b in blocks
                if isinstance(b.get("toolResult"), dict)]

    seen: set[str] = set()
    answered: set[str] = set()
    for index, (role, blocks) in enumerate(turns):
        here_uses, here_results = uses(blocks), results(blocks)
        if here_uses and role != "assistant":
            problems.append(f"messages[{index}]: toolUse in a {role!r} message")
        if here_results and role != "user":
            problems.append(f"messages[{index}]: toolResult in a {role!r} message")
        for cid in here_uses:
            if not cid:
                problems.append(f"messages[{index}]: a toolUse without a toolUseId")
            if cid in seen:
                problems.append(f"messages[{index}]: toolUseId {cid!r} used twice")
            seen.add(cid)
        for cid in here_results:
            if cid in answered:
                problems.append(f"messages[{index}]: {cid!r} answered twice")
            answered.add(cid)
        kinds = ["toolResult" if "toolResult" in b else "other" for b in blocks
                 if "cachePoint" not in b]
        if "toolResult" in kinds:
            last = len(kinds) - 1 - kinds[::-1].index("toolResult")
            if "other" in kinds[:last]:
                problems.append(f"messages[{index}]: toolResult after other content")
        asked = set(uses(turns[index - 1][1])) if index > 0 else set()
        for cid in here_results:
            if cid not in asked:
                problems.append(f"messages[{index}]: result for {cid!r} does not follow its "
                                "toolUse in the message before")
        if here_uses:
            after = set(results(turns[index + 1][1])) if index + 1 < len(turns) else set()
            for cid in here_uses:
                if cid not in after:
                    problems.append(f"messages[{index}]: toolUse {cid!r} is not answered in "
                                    "the next user message")
    return problems
