"""The ``context.update_working_state`` control tool (spec: "The model never writes it as
prose"), as one pydantic model: it gives the input schema the model sees — pinned in
``assets/control_tools.json``, byte for byte (``tests/unit/test_working_state_tool.py``) — and
validates what the model sends back, so the two cannot drift apart (STYLE §6).

The model's call arrives as the provider returned it (``WorkingStateToolCall``): the arguments
are parsed strictly (not JSON, not an object, an unknown field, a wrong type, an oversized
value: each is a field violation) and become an ``Update`` labelled with the call's trust.
No field removes a constraint: only the user can (``RemoveConstraint``).

The texts here are tool results the runtime returns to the model: a short confirmation, or what
was wrong with the call together with the tool's input schema (spec: "invalid arguments return
that tool's input schema"). They name the schema's fields and counts, never text the model wrote
(a task id, an unknown argument's name, its statements): a runtime returns them at the tool's
label, which would otherwise lift what a call after untrusted content wrote.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, JsonSchemaValue
from pydantic_core import CoreSchema

from context_engine.domain.budget import WORKING_STATE_TOKENS
from context_engine.domain.canonical import NOT_AN_OBJECT, canonical_json, json_object_problem
from context_engine.domain.errors import (
    BudgetExceeded,
    ConstraintCapReached,
    ContextEngineError,
    FieldViolation,
    InvalidInput,
)
from context_engine.domain.identifiers import ID_CHARACTERS_RULE, bad_id_characters
from context_engine.domain.items import WorkingFact, WorkingTask
from context_engine.domain.providers import provider_tool_name
from context_engine.domain.trust import TrustLevel, lowest
from context_engine.domain.working_state import (
    MAX_CONSTRAINTS,
    MAX_FACTS,
    MAX_OPEN_QUESTIONS,
    MAX_OPEN_TASKS,
    Changes,
    Update,
)

NAME = "context.update_working_state"
NAMES = (NAME, provider_tool_name(NAME))  # as defined, and as providers return it

# Bounds of one call (characters; entries at the working state's own caps). The block itself
# holds to 1,000 tokens, so no single entry needs to be long.
MAX_OBJECTIVE_CHARS = 400
MAX_CONSTRAINT_CHARS = 300
MAX_TASK_ID_CHARS = 64
MAX_TITLE_CHARS = 200
MAX_STATEMENT_CHARS = 400
MAX_QUESTION_CHARS = 400
MAX_NEXT_ACTION_CHARS = 300
MAX_SOURCES = 20
# The tool result lists the first errors (the BadRequest detail lists more), each line cut to
# a bound: with the schema it stays under the status's MAX_TOOL_RESULT_BYTES, so the schema
# itself is never cut.
MAX_LISTED_ERRORS = 6
MAX_ERROR_LINE_BYTES = 120


def _text(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _identifier(value: str) -> str:
    """The rule of every id (``identifier_problem``); the length is the field's own."""
    if bad_id_characters(value):
        raise ValueError(ID_CHARACTERS_RULE)
    return value


Objective = Annotated[str, Field(min_length=1, max_length=MAX_OBJECTIVE_CHARS),
                      AfterValidator(_text)]
Constraint = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS),
                       AfterValidator(_text)]
Statement = Annotated[str, Field(min_length=1, max_length=MAX_STATEMENT_CHARS),
                      AfterValidator(_text)]
Question = Annotated[str, Field(min_length=1, max_length=MAX_QUESTION_CHARS),
                     AfterValidator(_text)]
NextAction = Annotated[str, Field(min_length=1, max_length=MAX_NEXT_ACTION_CHARS),
                       AfterValidator(_text)]
TaskId = Annotated[str, Field(min_length=1, max_length=MAX_TASK_ID_CHARS),
                   AfterValidator(_identifier)]
Title = Annotated[str, Field(max_length=MAX_TITLE_CHARS), AfterValidator(
    lambda v: _text(v) if v else v)]
INT64_MAX = 2**63 - 1


def _int64(value: int) -> int:
    # Event ids are int64 on the wire and in the store. Checked here rather than as a schema
    # "maximum", so the input schema assets/control_tools.json pins (and every plan with it)
    # stays as it is.
    if value > INT64_MAX:
        raise ValueError(f"must be at most {INT64_MAX} (an int64 event id)")
    return value


def _integral(value: object) -> object:
    # JSON Schema's "integer" is any number with a zero fraction (1.0, 1e2), which a model or a
    # runtime that writes numbers as doubles may send; a double holds every integer only below
    # 2**53 (9007199254740993.0 parses as 2**53, another event's id)
    if isinstance(value, float) and value.is_integer():
        if abs(value) >= 2**53:
            raise ValueError("is written as a decimal too large to be exact: write it as an "
                             "integer")
        return int(value)
    return value


EventId = Annotated[int, Field(ge=1), BeforeValidator(_integral), AfterValidator(_int64)]

# extra="forbid" is the schema's "additionalProperties": false; strict refuses coercions
# ("5" for an event id, 1 for a title) instead of guessing what the model meant.
_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)


class TaskState(BaseModel):
    model_config = _CONFIG

    id: TaskId = Field(description="A short id of your choosing, stable across calls.")
    title: Title = Field("", description="What the task is. Required for a new task; omit it "
                                         "to keep the current title.")
    state: Literal["open", "in_progress", "blocked", "completed"]


class Fact(BaseModel):
    model_config = _CONFIG

    statement: Statement = Field(description="The fact. What a tool result, page, email or "
                                             "file says is attributed: \"the page states X\".")
    source_event_ids: list[EventId] = Field(max_length=MAX_SOURCES,
                                            description="The session events it rests on.")
    trust: Literal["user", "memory", "external_untrusted"] = Field(
        "user", description="Where it comes from: external_untrusted for tool results, "
                            "pages, emails and files.")


class UpdateWorkingStateInput(BaseModel):
    """The tool's input. Omitted fields change nothing."""

    model_config = _CONFIG

    objective: Objective | None = Field(
        None, description="The objective, when it changes; a new one supersedes the current.")
    add_constraints: list[Constraint] = Field(
        default_factory=list, max_length=MAX_CONSTRAINTS,
        description="Constraints the user set, verbatim. They cannot be removed by this tool.")
    upsert_tasks: list[TaskState] = Field(
        default_factory=list, max_length=MAX_OPEN_TASKS, description="Tasks to add or update, "
                                                                     "by id.")
    add_facts: list[Fact] = Field(default_factory=list, max_length=MAX_FACTS,
                                  description="Facts established in this session.")
    resolve_questions: list[Question] = Field(
        default_factory=list, max_length=MAX_OPEN_QUESTIONS,
        description="Open questions now resolved, by their exact text.")
    next_action: NextAction | None = Field(
        None, description="What you will do next; it resets when the turn ends.")


class Bare(GenerateJsonSchema):
    """The schema as the model reads it: no generated titles, no class docstrings, nested
    models inline rather than behind ``$ref`` (not every provider's schema subset resolves
    references), and no empty defaults (spec: provider serialization omits them); every
    validation keyword and each meaningful default stays."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def generate(self, schema: CoreSchema,
                 mode: JsonSchemaMode = "validation") -> JsonSchemaValue:
        out = super().generate(schema, mode=mode)
        defs = out.pop("$defs", {})
        shaped: JsonSchemaValue = _shape(out, defs)
        shaped.pop("description", None)
        return shaped


def _shape(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_shape(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = dict(defs[ref.removeprefix("#/$defs/")])
        target.pop("description", None)  # a model's docstring; the field says what it is
        target.update({k: v for k, v in node.items() if k != "$ref"})
        node = target
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" or (key == "default" and value in (None, "", [], {})):
            continue
        if key == "properties":  # property names are data: a property may be called "title"
            out[key] = {name: _shape(v, defs) for name, v in value.items()}
        else:
            out[key] = _shape(value, defs)
    return out


@cache
def input_schema() -> dict[str, Any]:
    """The tool's input schema, as ``assets/control_tools.json`` pins it."""
    schema: dict[str, Any] = UpdateWorkingStateInput.model_json_schema(schema_generator=Bare)
    return schema


@cache
def input_schema_json() -> str:
    return canonical_json(input_schema())


# ---------------------------------------------------------------- the model's call

_MESSAGES = {
    "json_invalid": "is not valid JSON",
    "model_type": "must be a JSON object",
    "missing": "is required",
}


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _violations(error: ValidationError, field: str) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    for e in error.errors(include_url=False):
        if e["type"] == "json_invalid":  # pydantic's parser says only that: the service says
            # why where its own parser does (an integer of more than 4,300 digits, a lone
            # surrogate), in the words a catalog tool's arguments are refused with
            problem = json_object_problem(e["input"], quote=False)
            if problem is not None and problem != NOT_AN_OBJECT:
                return [FieldViolation(f"{field}.arguments_json", problem)]
        loc = tuple(e["loc"])
        message = _MESSAGES.get(e["type"], e["msg"].removeprefix("Value error, "))
        if e["type"] == "extra_forbidden":  # the name is the model's text: not repeated
            loc = loc[:-1]
            message = "holds an argument that is not a field of this tool"
        where = f"{field}.arguments{_path(loc)}" if loc else f"{field}.arguments_json"
        found = FieldViolation(where, message)
        if found not in out:  # (two unknown arguments of one object: one line)
            out.append(found)
    return out


def parse_arguments(arguments_json: str, *, trust: TrustLevel,
                    field: str) -> Update | list[FieldViolation]:
    """The call's arguments as an ``Update`` labelled ``trust`` (a fact's own label can only
    lower it), or every violation, at ``{field}.arguments...`` paths."""
    try:
        call = UpdateWorkingStateInput.model_validate_json(arguments_json)
    except ValidationError as error:
        return _violations(error, field)
    # a name twice (read as its last by the parse above), say; the name itself is not repeated
    problem = json_object_problem(arguments_json, quote=False)
    if problem is not None:
        return [FieldViolation(f"{field}.arguments_json", problem)]
    seen: set[str] = set()
    duplicates: list[FieldViolation] = []
    for i, t in enumerate(call.upsert_tasks):
        if t.id in seen:
            duplicates.append(FieldViolation(f"{field}.arguments.upsert_tasks[{i}].id",
                                             "names a task already upserted in this call"))
        seen.add(t.id)
    if duplicates:
        return duplicates
    return Update(
        objective=call.objective, add_constraints=tuple(call.add_constraints),
        upsert_tasks=tuple(WorkingTask(id=t.id, title=t.title, state=t.state)
                           for t in call.upsert_tasks),
        add_facts=tuple(WorkingFact(statement=f.statement,
                                    source_event_ids=tuple(f.source_event_ids),
                                    trust=lowest([TrustLevel(f.trust), trust], trust))
                        for f in call.add_facts),
        resolve_questions=tuple(call.resolve_questions), next_action=call.next_action,
        trust=trust)


# ---------------------------------------------------------------- tool results

def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def applied(changes: Changes) -> str:
    """The confirmation the model reads after an applied call."""
    done: list[str] = []
    if changes.objective_changed:
        done.append("objective set" + (" (the previous one superseded)"
                                       if changes.objective_superseded else ""))
    if changes.constraints_added:
        done.append(_count(changes.constraints_added, "constraint", "constraints") + " added")
    if changes.tasks_upserted:
        done.append(_count(len(changes.tasks_upserted), "task", "tasks") + " updated")
    if changes.facts_added:
        done.append(_count(changes.facts_added, "fact", "facts") + " recorded")
    if changes.questions_resolved:
        done.append(_count(changes.questions_resolved, "question", "questions") + " resolved")
    if changes.next_action_changed:
        done.append("next action set")
    evicted: list[str] = []
    if changes.tasks_evicted:
        evicted.append(_count(len(changes.tasks_evicted), "task", "tasks"))
    if changes.facts_evicted:
        evicted.append(_count(changes.facts_evicted, "fact", "facts"))
    if changes.questions_evicted:
        evicted.append(_count(changes.questions_evicted, "question", "questions"))
    text = "Working state updated: " + ("; ".join(done) if done else "nothing changed") + "."
    if evicted:
        text += (" Dropped to stay within the working state's caps (oldest first, completed "
                 "tasks before others): " + "; ".join(evicted) + ".")
    return text + f" The block is {changes.tokens:,} of {WORKING_STATE_TOKENS:,} tokens."


def _line(v: FieldViolation, field: str) -> str:
    where = v.field.removeprefix(f"{field}.arguments").removeprefix(".") or "arguments"
    if where == "_json":
        where = "arguments"
    line = f"- {where}: {v.description}".replace("\n", " ")
    data = line.encode()
    if len(data) <= MAX_ERROR_LINE_BYTES:
        return line
    return data[:MAX_ERROR_LINE_BYTES - 3].decode(errors="ignore") + "…"


def refused(violations: list[FieldViolation] | tuple[FieldViolation, ...], field: str) -> str:
    """What the model reads when its arguments are invalid: the errors and the input schema."""
    lines = [_line(v, field) for v in violations[:MAX_LISTED_ERRORS]]
    if len(violations) > MAX_LISTED_ERRORS:
        lines.append(f"- and {len(violations) - MAX_LISTED_ERRORS} more")
    return (f"{NAME} was not applied: its arguments are invalid, so nothing changed.\n"
            + "\n".join(lines)
            + "\nCall it again with arguments that match its input schema:\n"
            + input_schema_json())


def not_applied(error: ContextEngineError, field: str) -> str | None:
    """The tool result for a call whose valid arguments the working state refused, or None
    when the failure is not the model's to act on."""
    head = f"{NAME} was not applied, so nothing changed: "
    if isinstance(error, ConstraintCapReached):
        return (head + f"the working state holds {error.constraints} constraints, and "
                f"{error.adding} more would pass the cap of {error.cap}. Constraints never drop "
                "out and this tool cannot remove one: ask the user whether one no longer "
                "applies.")
    if isinstance(error, BudgetExceeded) and error.class_name == "working_state":
        return (head + f"its objective, constraints and next action alone would need "
                f"{error.tokens:,} tokens, over the block's ceiling of {error.limit:,}. "
                "Shorten the objective or the next action.")
    if isinstance(error, InvalidInput):
        return refused(error.violations, field)
    return None


def for_the_model(error: ContextEngineError, field: str) -> ContextEngineError:
    """The failure of an applied raw call as the runtime receives it: the transition's own
    violations at the call's argument paths, and the tool result for the model when the
    failure is the model's to act on (a constraint cap, a block over its ceiling, a new task
    without a title)."""
    if isinstance(error, InvalidInput):
        error = rebased(error, field)
    text = not_applied(error, field)
    if text is not None:
        error.tool_result = text
    return error


def rebased(error: InvalidInput, field: str) -> InvalidInput:
    """A transition's own violations (``transition.update.upsert_tasks[0].title``, where the
    typed form has them) at the raw call's argument paths
    (``transition.tool_call.arguments.upsert_tasks[0].title``)."""
    typed = "transition.update."
    return InvalidInput([FieldViolation(f"{field}.arguments." + v.field.removeprefix(typed)
                                        if v.field.startswith(typed) else v.field,
                                        v.description)
                         for v in error.violations])
