"""What every provider body shares: the format names, tool-name mapping, tool schemas, replayed
reasoning payloads, the turn grouping of the formats that need alternating turns, and the
placement of cache markers on blocks (ARCHITECTURE.md "Cache breakpoints and provider bodies").

Format-neutral code only: a helper that grows ``if fmt == ...`` belongs in its format's module
(``providers.py`` for Anthropic Messages and OpenAI Responses, ``provider_chat.py``,
``provider_gemini.py``, ``provider_bedrock.py``). Pure: standard library and domain only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from context_engine.domain import ucd
from context_engine.domain.breakpoints import DEFAULT_TTL, PRIORITY, SUMMARY_ITEM
from context_engine.domain.builder import BuildResult
from context_engine.domain.canonical import parse_json_object
from context_engine.domain.errors import AssemblyError, FieldViolation, InvalidInput
from context_engine.domain.provider_formats import ANTHROPIC_MESSAGES as ANTHROPIC_MESSAGES
from context_engine.domain.provider_formats import BEDROCK_CONVERSE as BEDROCK_CONVERSE
from context_engine.domain.provider_formats import FORMATS as FORMATS
from context_engine.domain.provider_formats import (
    GEMINI_GENERATE_CONTENT as GEMINI_GENERATE_CONTENT,
)
from context_engine.domain.provider_formats import (
    OPENAI_CHAT_COMPLETIONS as OPENAI_CHAT_COMPLETIONS,
)
from context_engine.domain.provider_formats import OPENAI_RESPONSES as OPENAI_RESPONSES
from context_engine.domain.provider_formats import provider_tool_name as provider_tool_name
from context_engine.domain.request import LEADING_USER_TEXT as LEADING_USER_TEXT
from context_engine.domain.request import Message, Role

JSON = dict[str, Any]

# Anthropic, OpenAI and Bedrock tool names; Gemini's own rule is in provider_gemini.py.
PROVIDER_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_BREAKPOINTS = 4  # Anthropic, and Bedrock's cache checkpoints: a fifth is a 400
LONG_TTL = "1h"
TTL_RANK = {"1h": 2, "5m": 1}


class ProviderFormatError(InvalidInput):
    """The request cannot be rendered in the asked provider format (tool names that collide
    or cannot be mapped, a reasoning payload that is not a JSON object)."""

    reason = "PROVIDER_FORMAT_UNRENDERABLE"

    def __init__(self, provider_format: str, violations: list[FieldViolation]) -> None:
        self.provider_format = provider_format
        super().__init__(violations)

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "provider_format": self.provider_format}

    def located(self, positions: Mapping[str, int]) -> ProviderFormatError:
        """The same refusal with each :class:`ItemViolation` at its item's position in the
        checkpoint (``positions``: item id -> index), e.g.
        ``checkpoint.items[3].reasoning.opaque``; the render knows items by id only."""
        return ProviderFormatError(self.provider_format, [
            FieldViolation(f"checkpoint.items[{positions[v.item_id]}]{v.suffix}", v.description)
            if isinstance(v, ItemViolation) and v.item_id in positions else v
            for v in self.violations])


@dataclass(frozen=True)
class ItemViolation(FieldViolation):
    """A violation of one checkpoint item, known by its id: ``field`` is ``checkpoint.items``
    until :meth:`ProviderFormatError.located` puts the item's position and ``suffix`` in."""

    item_id: str = ""
    suffix: str = ""


# ----------------------------------------------------------------------------- tool names

def provider_tool_names(names: Iterable[str], provider_format: str = "", *,
                        mapping: Callable[[str], str] = provider_tool_name,
                        pattern: re.Pattern[str] = PROVIDER_TOOL_NAME,
                        rule: str = "1-64 characters of [A-Za-z0-9_-]") -> dict[str, str]:
    """Our name -> provider name for every distinct name; a collision or an unmappable name is
    a :class:`ProviderFormatError`. The map is one-to-one, so an adapter inverts it to read the
    model's calls back."""
    mapped: dict[str, str] = {}
    owners: dict[str, list[str]] = {}
    for name in names:
        if name not in mapped:
            mapped[name] = mapping(name)
            owners.setdefault(mapped[name], []).append(name)
    violations: list[FieldViolation] = []
    for ours, theirs in mapped.items():
        if pattern.fullmatch(theirs) is None:
            violations.append(FieldViolation(
                "provider_format", f"tool name {ours!r} maps to {theirs!r}, which is not {rule}"))
    for theirs, ours_list in owners.items():
        if len(ours_list) > 1:
            # the usual cause: a runtime stored the model's call under the provider's form
            hint = (f" ({theirs!r} is already the provider's form of "
                    + ", ".join(repr(n) for n in sorted(ours_list) if n != theirs)
                    + ": a checkpoint holds tool names as the plan defines them, so a runtime "
                    "maps the model's calls back before storing them)"
                    if theirs in ours_list else "")
            violations.append(FieldViolation(
                "provider_format", "tool names " + ", ".join(repr(n) for n in sorted(ours_list))
                + f" all map to the provider name {theirs!r}" + hint))
    if violations:
        raise ProviderFormatError(provider_format, violations)
    return mapped


def request_tool_names(result: BuildResult) -> list[str]:
    """Every tool name the request sends: its definitions, then every replayed call's."""
    req = result.request
    return [t.name for t in req.tools] + [c.name for m in req.messages for c in m.tool_calls]


def tool_names(result: BuildResult, provider_format: str) -> dict[str, str]:
    return provider_tool_names(request_tool_names(result), provider_format)


def check_call_ids(result: BuildResult, provider_format: str, *, limit: int,
                   pattern: re.Pattern[str] | None = None, rule: str = "") -> None:
    """Refuse the render when a replayed call id is one the provider does not take (a
    checkpoint takes ids up to 256 characters): renaming it would break its pair. Each call
    and each result of it is an :class:`ItemViolation`, located at its item's
    ``tool_calls.calls[j].call_id`` or ``tool_result.call_id``."""
    ids = {c.call_id for m in result.request.messages for c in m.tool_calls}
    bad = {i for i in ids if len(i) > limit
           or (pattern is not None and pattern.fullmatch(i) is None)}
    if not bad:
        return
    what = f"is not {rule or f'at most {limit} characters'}, what {provider_format} takes"
    violations: list[FieldViolation] = []
    for m in result.request.messages:
        violations += [ItemViolation(
            "checkpoint.items", f"call id {c.call_id!r} {what}", item_id=m.item_id,
            suffix=f".tool_calls.calls[{j}].call_id")
            for j, c in enumerate(m.tool_calls) if c.call_id in bad]
        if m.role is Role.TOOL and m.call_id in bad:
            violations.append(ItemViolation(
                "checkpoint.items", f"the result of call id {m.call_id!r}, which {what}",
                item_id=m.item_id, suffix=".tool_result.call_id"))
    raise ProviderFormatError(provider_format, violations)


def reasoning_payload(m: Message, provider_format: str,
                      types: Collection[str] | Mapping[str, Collection[str]]) -> JSON:
    """A reasoning item's opaque payload: the provider's own JSON object, replayed verbatim.
    Only reasoning types pass: a reasoning item never smuggles in a call or a message.
    ``types``: the types that pass, or each type's fields, checked key by key: every field is
    there and a string, and no other key is (``cache_control`` or any key the provider never
    returns would reach the provider as it is, or break the body's own rules)."""
    value = reasoning_object(m)
    kind = None if value is None else value.get("type")
    if value is None or not isinstance(kind, str) or kind not in types or (
            isinstance(types, Mapping) and not _fields_are(value, types[kind])):
        raise unreplayable(m, provider_format, _expected(types))
    return value


def _fields_are(value: JSON, fields: Collection[str]) -> bool:
    return set(value) == {"type", *fields} and all(isinstance(value[f], str) for f in fields)


def _expected(types: Collection[str] | Mapping[str, Collection[str]]) -> str:
    if not isinstance(types, Mapping):
        return f"a JSON object of type {' or '.join(sorted(types))}"
    return "a JSON object " + " or ".join(
        "{" + ", ".join([f'"type": "{t}"', *(f'"{f}": "..."' for f in types[t])]) + "}"
        for t in sorted(types)) + " with no other key"


def reasoning_object(m: Message) -> JSON | None:
    try:
        return parse_json_object(m.reasoning_opaque.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def unreplayable(m: Message, provider_format: str, expected: str) -> ProviderFormatError:
    return ProviderFormatError(provider_format, [ItemViolation(
        "checkpoint.items", f"reasoning item {m.item_id!r} ({m.reasoning_provider}) is not "
        f"{expected}: it cannot be replayed", item_id=m.item_id, suffix=".reasoning.opaque")])


# Claude refuses a tool whose input schema holds alternatives at its top level (400
# "input_schema does not support oneOf, allOf, or anyOf at the top level"), through Anthropic's
# API and Bedrock's alike; a union written by MCP servers and zod has that shape.
CLAUDE_FORMATS = frozenset({ANTHROPIC_MESSAGES, BEDROCK_CONVERSE})
TOP_LEVEL_ALTERNATIVES = ("allOf", "anyOf", "oneOf")


def top_level_refusal(name: str, schema: Mapping[str, Any], provider_format: str,
                      model_id: str) -> str | None:
    """Why ``provider_format`` cannot send tool ``name`` with this input schema to
    ``model_id``, or None: Claude's rule, in Anthropic's format and in Bedrock's for a Claude
    model (Bedrock serves other models, whose rules are theirs)."""
    if provider_format not in CLAUDE_FORMATS or (
            provider_format == BEDROCK_CONVERSE and "claude" not in model_id):
        return None
    found = [k for k in TOP_LEVEL_ALTERNATIVES if k in schema]
    if not found:
        return None
    return (f"tool {name!r} has {' and '.join(found)} at the top level of its input schema, "
            f"which Claude refuses in {provider_format} (\"input_schema does not support "
            "oneOf, allOf, or anyOf at the top level\"): put the alternatives under a "
            "property, or list their properties as optional ones")


def claude_tool_schemas(result: BuildResult, provider_format: str) -> list[JSON]:
    """Each definition's schema as a Claude body sends it (:func:`tool_schemas`), refusing
    the render when one holds alternatives at its top level (:func:`top_level_refusal`)."""
    schemas = tool_schemas(result)
    refusals = [why for t, s in zip(result.request.tools, schemas, strict=True)
                if (why := top_level_refusal(t.name, s, provider_format, result.model_id))
                is not None]
    if refusals:
        raise ProviderFormatError(provider_format,
                                  [FieldViolation("provider_format", r) for r in refusals])
    return schemas


def claude_system_texts(result: BuildResult) -> list[str]:
    """The prefix blocks a Claude body (Anthropic's, Bedrock's) sends as its system blocks, in
    order: every block but one of white space alone, which carries nothing and which Claude
    refuses (a text block of white space only; a cache marker on one is a 400 as well). Only
    a plan stored before ``Plan`` refused white-space agent instructions renders such a block
    (row 3); its pinned bytes stay as they are, so the body leaves the block out, on every
    Build alike. The formats that join the blocks into one text keep it (``joined_prefix``)."""
    return [b.text for b in result.request.prefix_blocks if b.text.strip()]


def tool_schema(text: str) -> JSON:
    """A definition's input schema, parsed (provider bodies send :func:`tool_schemas`)."""
    value = parse_json_object(text)
    if value is None:  # tool schemas are canonical JSON objects by construction
        raise AssemblyError("a tool definition's input schema is not a JSON object")
    return value


def tool_schemas(result: BuildResult) -> list[JSON]:
    """Each definition's input schema as ``result``'s provider bodies send it
    (:func:`provider_schema`): with the titles a person wrote, unless its plan was pinned
    before builder@9 (``BuildResult.keeps_schema_titles``)."""
    return [provider_schema(tool_schema(t.input_schema_json),
                            keep_titles=result.keeps_schema_titles)
            for t in result.request.tools]


# JSON Schema keywords (draft-07 and 2020-12) whose value is a subschema, a list of subschemas,
# or a map from names to subschemas. Every other keyword's value is data (enum, const, examples,
# required, a default...) or a scalar and is copied verbatim: a property named "title" or
# "default" is a name in a map, never an annotation, and is never dropped.
_ONE_SCHEMA = frozenset({
    "items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SCHEMA_MAPS = frozenset({
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
    "dependencies"})


def _empty_default(value: Any) -> bool:
    """``null``, ``""``, ``[]`` and ``{}`` say nothing; ``0`` and ``false`` are meaningful."""
    return value is None or (isinstance(value, (str, list, dict)) and not value)


# The maps whose entries' names a generated title repeats: a property's name (pydantic's
# "User Id" for user_id), a definition's key (its class name).
_NAMED_MAPS = frozenset({"properties", "$defs", "definitions"})
# A root title that is one identifier-like word: a class name ("SearchArgs"), as generators
# title the root.
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _bare(text: str) -> str:
    """``text`` lower-cased and stripped of all but letters and digits, by the service's own
    tables (``ucd``): the same on every replica whatever its interpreter's Unicode."""
    return "".join(ch for ch in ucd.lower(text) if ucd.category(ch)[0] in "LN")


def generated_title(title: Any, name: str | None) -> bool:
    """Whether ``title``, a subschema's ``title``, carries nothing beyond the subschema's
    place: the name it has in ``properties``, ``$defs`` or ``definitions`` (``name``), once
    both are lower-cased and stripped to letters and digits ("User Id" of ``user_id``), or at
    the root (``name`` None) one identifier-like word. Anything else a person wrote."""
    if not isinstance(title, str):
        return False
    if name is None:
        return _CLASS_NAME.fullmatch(title) is not None
    return _bare(title) == _bare(name)


def provider_schema(schema: JSON, *, keep_titles: bool = True) -> JSON:
    """A tool's input schema as provider bodies send it (spec: "Provider serialization omits
    redundant generated titles and empty default annotations while retaining every validation
    keyword and meaningful non-empty default"): every generated ``title`` annotation
    (:func:`generated_title`) and every empty ``default`` at a schema position is dropped, at
    any depth; nothing else changes. ``keep_titles`` False drops every ``title`` annotation,
    as provider bodies did before builder@9 (a plan pinned before it keeps them so for its
    whole epoch: ``PlanSpec.keeps_schema_titles``). The plan's tool definitions keep the full
    schema: it is the pinned identity, and the tool-definition cap measures that larger form.
    Iterative: a schema nested as deep as the JSON parser admits must not exhaust the stack
    here."""
    root: JSON = {}
    # (subschema, its copy, whether a generator titles it, and after what: its name in a map
    # of named subschemas, None at the root)
    todo: list[tuple[JSON, JSON, bool, str | None]] = [(schema, root, True, None)]

    def later(sub: Any, name: str | None = None, *, named: bool = False) -> Any:
        if not isinstance(sub, dict):
            return sub  # a boolean schema, or not a schema at all: verbatim
        copy: JSON = {}
        todo.append((sub, copy, named, name))
        return copy

    while todo:
        source, out, titled, name = todo.pop()
        for key, value in source.items():
            if key == "title" and (not keep_titles or (
                    titled and generated_title(value, name))):
                continue
            if key == "default" and _empty_default(value):
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {entry: later(sub, entry, named=key in _NAMED_MAPS)
                            for entry, sub in value.items()}
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [later(sub) for sub in value]
            elif key in _ONE_SCHEMA:
                out[key] = later(value)
            else:
                out[key] = value
    return root


def joined_prefix(result: BuildResult) -> str:
    """The prefix blocks as one text, a blank line between blocks (OpenAI ``instructions``,
    the Chat Completions system message, Gemini's ``systemInstruction``). The estimator counts
    one separator per join with the platform policy (plan.py ``request_framing``). A block of
    white space alone (a stored plan's blank agent instructions: ``claude_system_texts``) is
    joined as it is: the text around it carries the policy, so the text is never blank, and
    these bodies keep the bytes they always had."""
    return "\n\n".join(b.text for b in result.request.prefix_blocks if b.text)


# ----------------------------------------------------------------------------- turns

def message_key(m: Message) -> str:
    """The checkpoint item a message renders, as cache markers name it (``through_item``)."""
    return SUMMARY_ITEM if m.row == 9 else m.item_id


@dataclass(slots=True)
class Turn:
    role: str
    results: list[JSON]  # tool results: always first in a user turn
    blocks: list[JSON]
    call_ids: set[str] = field(default_factory=set)

    def content(self) -> list[JSON]:
        return [*self.results, *self.blocks]


class Turns:
    """Messages grouped as the turn-based formats need them (Anthropic, Gemini, Bedrock):
    consecutive blocks of one role share a turn; a tool result moves to the start of the user
    turn right after its call's turn, all results of a batch together, in the order they
    arrived. ``by_key`` remembers every item's blocks for the cache markers."""

    def __init__(self, model_role: str) -> None:
        self.model_role = model_role
        self.turns: list[Turn] = []
        self.by_key: dict[str, list[int]] = {}  # item key -> ids of its blocks

    def add(self, role: str, block: JSON, key: str, *, call_id: str = "",
            result_of: str = "") -> None:
        if result_of:
            at = next((i for i, t in enumerate(self.turns)
                       if t.role == self.model_role and result_of in t.call_ids), None)
            if at is None:
                raise AssemblyError(f"tool result for {result_of!r} has no earlier call")
            if at + 1 == len(self.turns):
                self.turns.append(Turn(role="user", results=[], blocks=[]))
            self.turns[at + 1].results.append(block)
        else:
            if not self.turns or self.turns[-1].role != role:
                self.turns.append(Turn(role=role, results=[], blocks=[]))
            self.turns[-1].blocks.append(block)
            if call_id:
                self.turns[-1].call_ids.add(call_id)
        if key:
            self.by_key.setdefault(key, []).append(id(block))

    def lead(self, block: JSON) -> None:
        """Open with a user turn holding ``block`` unless the first turn is the user's."""
        if not self.turns or self.turns[0].role != "user":
            self.turns.insert(0, Turn(role="user", results=[], blocks=[block]))

    def flat(self) -> list[JSON]:
        return [b for t in self.turns for b in t.content()]


def history_block(flat: Sequence[JSON], furthest: int,
                  cacheable: Callable[[JSON], bool]) -> JSON | None:
    """The last cacheable block at or before position ``furthest`` of ``flat`` (where the body
    lays out the conversation a marker closes: ``_reach``; -1: nowhere). A result sits next to
    its call, so a conversation's last block is not always its last item's: the marker goes
    where the body lays the conversation out to, and never past it (a block of thinking only
    ends it on the cacheable block before)."""
    for i in range(furthest, -1, -1):
        if cacheable(flat[i]):
            return flat[i]
    return None


def _reach(result: BuildResult, turns: Turns, position: Mapping[int, int]) -> dict[str, int]:
    """Per message key, the furthest position in the body of the blocks of every message up
    to and including its last: where the conversation a history marker through it ends, in
    one pass for every marker. An item that renders no block in this body (an assistant
    message without text or calls, or only another provider's reasoning) ends it on the
    messages before it; an item the request does not hold is absent (no marker)."""
    reach: dict[str, int] = {}
    furthest = -1
    for message in result.request.messages:
        key = message_key(message)
        for block in turns.by_key.get(key, ()):
            furthest = max(furthest, position[block])
        reach[key] = furthest
    return reach


def marked_blocks(result: BuildResult, *, tools: Sequence[JSON], system: Sequence[JSON],
                  turns: Turns, cacheable: Callable[[JSON], bool],
                  limit: int = MAX_BREAKPOINTS) -> list[tuple[JSON, str]]:
    """Where the request's cache markers land, in request order (tools -> system ->
    messages): (the block a marker follows, its TTL). after_tools marks the last tool,
    after_system the last cacheable system block, a history marker the last cacheable block
    of the conversation through its ``through_item`` as the body lays it out (``_reach``).
    At most ``limit``, kept by priority (a fifth never lands), one per block, and never a
    longer TTL after a shorter one."""
    flat = turns.flat()
    position = {id(b): i for i, b in enumerate(flat)}
    reach: dict[str, int] | None = None  # made once, for the first history marker
    # (priority, position in request order, block, ttl)
    placed: list[tuple[int, tuple[int, int], JSON, str]] = []
    for mark in result.cache_breakpoints:
        rank = PRIORITY.index(mark.name) if mark.name in PRIORITY else len(PRIORITY)
        if mark.name == "after_tools":
            if tools:
                placed.append((rank, (0, len(tools) - 1), tools[-1], mark.ttl))
        elif mark.name == "after_system":
            # the last cacheable system block: never one carrying nothing
            at = next((i for i in reversed(range(len(system))) if cacheable(system[i])), None)
            if at is not None:
                placed.append((rank, (1, at), system[at], mark.ttl))
        elif mark.through_item:
            reach = _reach(result, turns, position) if reach is None else reach
            block = history_block(flat, reach.get(mark.through_item, -1), cacheable)
            if block is not None:
                placed.append((rank, (2, position[id(block)]), block, mark.ttl))
    seen: set[int] = set()
    kept: list[tuple[int, tuple[int, int], JSON, str]] = []
    for entry in sorted(placed, key=lambda p: p[0]):  # by priority: a 5th never lands
        if id(entry[2]) not in seen and len(kept) < limit:
            seen.add(id(entry[2]))
            kept.append(entry)
    out: list[tuple[JSON, str]] = []
    floor = LONG_TTL
    for _, _, block, asked in sorted(kept, key=lambda p: p[1]):  # request order
        ttl = LONG_TTL if asked == LONG_TTL else DEFAULT_TTL
        if TTL_RANK[ttl] > TTL_RANK[floor]:
            ttl = floor  # never a longer TTL after a shorter one
        floor = ttl
        out.append((block, ttl))
    return out


def call_names(result: BuildResult) -> dict[str, str]:
    """call id -> our tool name, for every replayed call (a result names its call's tool)."""
    return {c.call_id: c.name for m in result.request.messages for c in m.tool_calls}


def pair_problems(calls: Sequence[tuple[int, list[str]]],
                  answers: Sequence[tuple[int, list[str]]], where: str) -> list[str]:
    """Every id called once; every group of answers at index i answers exactly the calls of
    the group of calls at index i - 1 (and nothing else); every call answered. ``calls`` and
    ``answers``: (index of the turn or message, ids in it), for the turns that have any."""
    problems: list[str] = []
    seen: set[str] = set()
    called_at = {i: ids for i, ids in calls}
    answered_at = {i: ids for i, ids in answers}
    for i, ids in calls:
        for c in ids:
            if not c:
                problems.append(f"{where}[{i}]: a call without an id")
            elif c in seen:
                problems.append(f"{where}[{i}]: call id {c!r} used twice")
            seen.add(c)
    for i, ids in answers:
        before = set(called_at.get(i - 1, []))
        once: set[str] = set()
        for r in ids:
            if r in once:
                problems.append(f"{where}[{i}]: call {r!r} answered twice")
            once.add(r)
            if r not in before:
                problems.append(f"{where}[{i}]: result {r!r} answers no call of the turn "
                                "right before it")
    for i, ids in calls:
        after = set(answered_at.get(i + 1, []))
        for c in ids:
            if c and c not in after:
                problems.append(f"{where}[{i}]: call {c!r} has no result in the turn right "
                                "after it")
    return problems
