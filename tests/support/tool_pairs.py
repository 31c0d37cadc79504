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
    return [f"a provider body for format {provider_format}"]


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
