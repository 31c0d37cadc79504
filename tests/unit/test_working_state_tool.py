"""The engine's own ``context.update_working_state`` control tool: one pydantic model gives the
schema the model sees (pinned in the assets byte for byte) and the strict validator of the raw
call; the tool results; the user's ``remove_constraint``; the tool in tool selection."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import grpc
import pytest
from context_engine.adapters.assets import DEFAULT_ASSETS_DIR, load_control_tools
from context_engine.api import mapping
from context_engine.api import working_state_tool as wst
from context_engine.api.status import MAX_TOOL_RESULT_BYTES, rich_status, status_for
from context_engine.domain.canonical import LONE_SURROGATE, canonical_json
from context_engine.domain.errors import (
    BudgetExceeded,
    ConstraintCapReached,
    FieldViolation,
    InvalidInput,
)
from context_engine.domain.items import WorkingFact, WorkingState, WorkingTask
from context_engine.domain.tools import TOOL_ITEM_CAP, UPDATE_WORKING_STATE
from context_engine.domain.trust import TrustLevel
from context_engine.domain.working_state import (
    MAX_CONSTRAINTS,
    TASK_STATES,
    Changes,
    LogEvent,
    RefusedCall,
    RemoveConstraint,
    Update,
    apply_update,
    replay,
)
from context_engine.v1 import context_engine_pb2 as pb
from google.rpc import error_details_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.unit import helpers as h

REPO = Path(__file__).resolve().parents[2]
FIELD = "transition.tool_call"
ARGS = f"{FIELD}.arguments"
U = TrustLevel.USER
X = TrustLevel.EXTERNAL_UNTRUSTED


def parse(arguments: Any, trust: TrustLevel = U) -> Update | list[FieldViolation]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return wst.parse_arguments(text, trust=trust, field=FIELD)


def refused(arguments: Any) -> dict[str, str]:
    out = parse(arguments)
    assert isinstance(out, list), f"accepted: {out}"
    return {v.field: v.description for v in out}


# ----------------------------------------------------------------------------- the schema

def _asset_text() -> str:
    return (DEFAULT_ASSETS_DIR / "control_tools.json").read_text(encoding="utf-8")


def test_the_asset_schema_is_the_models_schema_byte_for_byte() -> None:
    generated = canonical_json(
        wst.UpdateWorkingStateInput.model_json_schema(schema_generator=wst.Bare))
    asset = load_control_tools()[UPDATE_WORKING_STATE]
    assert canonical_json(asset.input_schema) == generated
    # the file holds those very bytes, so a reviewer of the asset reads what the model reads
    assert f'"input_schema": {generated},' in _asset_text()
    assert wst.input_schema_json() == generated


def test_the_schema_ships_with_a_policy_version_bump() -> None:
    """A schema change is a prefix change: the manifest version moves with it (the version
    that first carried this schema, or a later one)."""
    manifest = json.loads((DEFAULT_ASSETS_DIR / "manifest.json").read_text())
    assert manifest["version"] >= "platform-policy@2026-12-01.2"


def _nodes(schema: Any) -> list[dict[str, Any]]:
    """Every schema node (property names are data, not nodes)."""
    out: list[dict[str, Any]] = []
    if isinstance(schema, dict):
        out.append(schema)
        for key, value in schema.items():
            if key == "properties":
                for sub in value.values():
                    out += _nodes(sub)
            elif isinstance(value, (dict, list)):
                out += _nodes(value)
    elif isinstance(schema, list):
        for sub in schema:
            out += _nodes(sub)
    return out


def test_the_schema_is_shaped_for_the_model() -> None:
    schema = wst.input_schema()
    nodes = _nodes(schema)
    assert not any("title" in n or "$ref" in n or "$defs" in n for n in nodes)
    assert not any(n.get("default", "x") in (None, "", [], {}) for n in nodes)
    objects = [n for n in nodes if n.get("type") == "object"]
    assert len(objects) == 3 and all(n["additionalProperties"] is False for n in objects)
    assert set(schema["properties"]) == {"objective", "add_constraints", "upsert_tasks",
                                         "add_facts", "resolve_questions", "next_action"}
    assert "description" not in schema  # the tool's description says what it is
    for name, prop in schema["properties"].items():
        assert prop["description"], name
    # nothing in the schema can remove a constraint
    assert not [k for n in nodes for k in n.get("properties", {}) if "remove" in k]
    # list bounds are the working state's caps
    caps = {k: schema["properties"][k]["maxItems"] for k in
            ("add_constraints", "upsert_tasks", "add_facts", "resolve_questions")}
    assert caps == {"add_constraints": 20, "upsert_tasks": 30, "add_facts": 40,
                    "resolve_questions": 20}
    task = schema["properties"]["upsert_tasks"]["items"]
    assert task["properties"]["state"]["enum"] == list(TASK_STATES)
    fact = schema["properties"]["add_facts"]["items"]
    assert fact["properties"]["trust"]["enum"] == ["user", "memory", "external_untrusted"]
    assert fact["required"] == ["statement", "source_event_ids"]


def test_pydantic_is_a_pinned_runtime_dependency() -> None:
    """An upgrade can change the generated schema: the versions are pinned where the image
    installs from, and the project declares the dependency."""
    runtime = (REPO / "requirements" / "runtime.txt").read_text()
    for name in ("pydantic", "pydantic_core", "annotated-types", "typing-inspection"):
        pinned = re.search(rf"^{re.escape(name)}==(\S+)$", runtime, re.M)
        assert pinned, name
        assert pinned.group(1) == version(name), name
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "pydantic" in project["dependencies"]


# ----------------------------------------------------------------------------- good calls

def test_a_full_call_becomes_a_labelled_update() -> None:
    out = parse({"objective": "Book travel", "add_constraints": ["economy only"],
                 "upsert_tasks": [{"id": "t1", "title": "find flights", "state": "open"},
                                  {"id": "t0", "state": "completed"}],
                 "add_facts": [{"statement": "budget is 500", "source_event_ids": [4, 2]},
                               {"statement": "the page states X", "source_event_ids": [7],
                                "trust": "external_untrusted"}],
                 "resolve_questions": ["Which date?"], "next_action": "search"})
    assert out == Update(
        objective="Book travel", add_constraints=("economy only",),
        upsert_tasks=(WorkingTask(id="t1", title="find flights", state="open"),
                      WorkingTask(id="t0", title="", state="completed")),
        add_facts=(WorkingFact(statement="budget is 500", source_event_ids=(4, 2), trust=U),
                   WorkingFact(statement="the page states X", source_event_ids=(7,), trust=X)),
        resolve_questions=("Which date?",), next_action="search", trust=U)


def test_omitted_fields_change_nothing_and_null_is_omitted() -> None:
    assert parse({}) == Update()
    assert parse({"objective": None, "next_action": None}) == Update()
    assert parse(' {"next_action": "go"} ') == Update(next_action="go")


def test_the_calls_label_bounds_every_fact_it_writes() -> None:
    """A fact is at most the label of the call that wrote it (the call's trust, USER unless
    the runtime says lower): the model can lower a fact's label, never raise it."""
    out = parse({"add_facts": [{"statement": "s", "source_event_ids": [1], "trust": "user"},
                               {"statement": "m", "source_event_ids": [1],
                                "trust": "memory"}]}, trust=TrustLevel.MEMORY)
    assert isinstance(out, Update) and out.trust is TrustLevel.MEMORY
    assert [x.trust for x in out.add_facts] == [TrustLevel.MEMORY, TrustLevel.MEMORY]
    out = parse({"add_facts": [{"statement": "s", "source_event_ids": [1]}]}, trust=X)
    assert isinstance(out, Update) and out.add_facts[0].trust is X


def test_values_at_their_bounds_are_accepted() -> None:
    out = parse({"objective": "o" * wst.MAX_OBJECTIVE_CHARS,
                 "add_constraints": ["c" * wst.MAX_CONSTRAINT_CHARS] * 20,
                 "add_facts": [{"statement": "s", "source_event_ids": list(range(1, 21))}],
                 "upsert_tasks": [{"id": "i" * 64, "title": "t" * 200, "state": "open"}]})
    assert isinstance(out, Update)


# ----------------------------------------------------------------------------- bad calls

@pytest.mark.parametrize("text", ["", "nope", "{", '{"objective": "a",}', "[1]", '"text"',
                                  "null", "5", "{} {}"])
def test_arguments_that_are_not_a_json_object(text: str) -> None:
    got = refused(text)
    assert list(got) == [f"{FIELD}.arguments_json"]


def test_non_finite_numbers_meet_no_field_that_takes_them() -> None:
    assert set(refused('{"objective": NaN, "add_facts": [{"statement": "s", '
                       '"source_event_ids": [Infinity]}]}')) == {
        f"{ARGS}.objective", f"{ARGS}.add_facts[0].source_event_ids[0]"}


def test_unknown_fields_are_refused_at_every_level() -> None:
    got = refused({"objective": "x", "remove_constraints": ["economy only"],
                   "constraints": [], "upsert_tasks": [{"id": "t", "state": "open",
                                                        "priority": 1}],
                   "add_facts": [{"statement": "s", "source_event_ids": [1], "sequence": 9}]})
    # the unknown name is the model's own text: the path stops at the object holding it
    unknown = "holds an argument that is not a field of this tool"
    assert got == {f"{ARGS}_json": unknown, f"{ARGS}.upsert_tasks[0]": unknown,
                   f"{ARGS}.add_facts[0]": unknown}


def test_wrong_types_are_refused_not_coerced() -> None:
    got = refused({"objective": 5, "add_constraints": "economy only", "next_action": ["go"],
                   "resolve_questions": [1],
                   "upsert_tasks": [{"id": 1, "title": True, "state": "open"}],
                   "add_facts": [{"statement": "s", "source_event_ids": ["1", 2.5, True]}]})
    assert set(got) == {f"{ARGS}.objective", f"{ARGS}.add_constraints", f"{ARGS}.next_action",
                        f"{ARGS}.resolve_questions[0]", f"{ARGS}.upsert_tasks[0].id",
                        f"{ARGS}.upsert_tasks[0].title",
                        f"{ARGS}.add_facts[0].source_event_ids[0]",
                        f"{ARGS}.add_facts[0].source_event_ids[1]",
                        f"{ARGS}.add_facts[0].source_event_ids[2]"}


def test_an_integer_written_with_a_zero_fraction_is_an_integer() -> None:
    """JSON Schema's "integer" (the pinned schema's type of an event id) is any number whose
    fraction is zero: 1.0 and 1e2 were refused as "not a valid integer". Only an exact one
    is taken: past 2**53 a double no longer holds every integer."""
    applied = parse('{"add_facts": [{"statement": "s", "source_event_ids": [1.0, 1e2]}]}')
    assert isinstance(applied, Update), applied
    (added,) = applied.add_facts
    assert added.source_event_ids == (1, 100)
    assert all(type(i) is int for i in added.source_event_ids)
    got = refused({"add_facts": [{"statement": "s",
                                  "source_event_ids": [0.0, float(2**53 + 2), 1.5]}]})
    assert set(got) == {f"{ARGS}.add_facts[0].source_event_ids[{i}]" for i in range(3)}
    # 2**53 + 1 written as a decimal parses as 2**53: another id, refused, never taken
    got = refused('{"add_facts": [{"statement": "s", "source_event_ids": [9007199254740993.0]}]}')
    assert set(got) == {f"{ARGS}.add_facts[0].source_event_ids[0]"}


def test_oversized_values_are_refused() -> None:
    got = refused({"objective": "o" * (wst.MAX_OBJECTIVE_CHARS + 1),
                   "add_constraints": ["c"] * 19 + ["c" * (wst.MAX_CONSTRAINT_CHARS + 1)],
                   "resolve_questions": ["q"] * 21,
                   "next_action": "n" * 301,
                   "upsert_tasks": [{"id": "i" * 65, "title": "t" * 201, "state": "open"}],
                   "add_facts": [{"statement": "s" * 401,
                                  "source_event_ids": list(range(1, 22))}]})
    assert set(got) == {f"{ARGS}.objective", f"{ARGS}.add_constraints[19]",
                        f"{ARGS}.resolve_questions", f"{ARGS}.next_action",
                        f"{ARGS}.upsert_tasks[0].id", f"{ARGS}.upsert_tasks[0].title",
                        f"{ARGS}.add_facts[0].statement", f"{ARGS}.add_facts[0].source_event_ids"}
    assert "at most 400 characters" in got[f"{ARGS}.objective"]
    assert "at most 20 items" in got[f"{ARGS}.resolve_questions"]
    # list lengths at the working state's caps
    assert set(refused({"add_constraints": ["c"] * 21})) == {f"{ARGS}.add_constraints"}
    assert set(refused({"add_facts": [{"statement": "s", "source_event_ids": []}] * 41})) == {
        f"{ARGS}.add_facts"}
    assert set(refused({"upsert_tasks": [{"id": f"t{i}", "state": "open"}
                                         for i in range(31)]})) == {f"{ARGS}.upsert_tasks"}


def test_blank_missing_and_malformed_values_are_refused() -> None:
    got = refused({"objective": "  ", "add_constraints": ["", "ok", "a\x00b"],
                   "upsert_tasks": [{"id": " t1", "state": "done"}, {"id": "t2"},
                                    {"id": "t3", "title": " ", "state": "open"}],
                   "add_facts": [{"statement": "s"}, {"statement": "s",
                                                      "source_event_ids": [0]},
                                 {"statement": "s", "source_event_ids": [1],
                                  "trust": "trusted_configuration"}]})
    assert got == {
        f"{ARGS}.objective": "must not be blank",
        f"{ARGS}.add_constraints[0]": "String should have at least 1 character",
        f"{ARGS}.add_constraints[2]": "must not contain NUL characters",
        f"{ARGS}.upsert_tasks[0].id": "must not contain control, format or line-separator "
                                      "characters or surrounding white space",
        f"{ARGS}.upsert_tasks[0].state": "Input should be 'open', 'in_progress', 'blocked' or "
                                         "'completed'",
        f"{ARGS}.upsert_tasks[1].state": "is required",
        f"{ARGS}.upsert_tasks[2].title": "must not be blank",
        f"{ARGS}.add_facts[0].source_event_ids": "is required",
        f"{ARGS}.add_facts[1].source_event_ids[0]": "Input should be greater than or equal "
                                                    "to 1",
        f"{ARGS}.add_facts[2].trust": "Input should be 'user', 'memory' or "
                                      "'external_untrusted'",
    }


def test_a_task_upserted_twice_in_one_call_is_refused() -> None:
    assert refused({"upsert_tasks": [{"id": "t1", "state": "open", "title": "a"},
                                     {"id": "t1", "state": "completed"}]}) == {
        f"{ARGS}.upsert_tasks[1].id": "names a task already upserted in this call"}


# ------------------------------------------------------------- no input removes a constraint

CONSTRAINED = apply_update(WorkingState(), Update(add_constraints=("economy only",
                                                                  "no red-eye")),
                           run_id="r", sequence=1)[0]
said = st.sampled_from(["economy only", "no red-eye", "x", " ", ""])
meant = st.sampled_from(["economy only", "no red-eye", "x"])  # what the schema accepts
# Every field a removal could hide in, filled as the schema accepts (most of these calls are
# applied), and the removal-looking fields the schema does not have (refused).
SCHEMA: dict[str, st.SearchStrategy[Any]] = {
    "objective": st.none() | meant,
    "add_constraints": st.lists(meant, max_size=3, unique=True),
    "upsert_tasks": st.lists(st.fixed_dictionaries(
        {"id": st.sampled_from(["t1", "economy only"]),
         "state": st.sampled_from(["open", "completed"])}, optional={"title": meant}),
        max_size=2, unique_by=lambda t: t["id"]),
    "add_facts": st.lists(st.fixed_dictionaries(
        {"statement": meant, "source_event_ids": st.lists(st.integers(1, 5), min_size=1,
                                                          max_size=2)}),
        max_size=2),
    "resolve_questions": st.lists(meant, max_size=2),
    "next_action": st.none() | meant,
}
REMOVAL_LOOKING: dict[str, st.SearchStrategy[Any]] = {
    "remove_constraints": st.lists(said, max_size=2),
    "constraints": st.lists(said, max_size=2),
    "remove_constraint": said,
}
FIELDS = {**SCHEMA, **REMOVAL_LOOKING}
well_formed = st.sets(st.sampled_from(sorted(SCHEMA)), max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: SCHEMA[k] for k in sorted(keys)}))
calls = st.sets(st.sampled_from(sorted(FIELDS)), max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in sorted(keys)}))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 50) | said,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(said, inner, max_size=4),
    max_leaves=12)
anything = st.dictionaries(st.sampled_from(sorted(FIELDS)), json_values, max_size=4)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(st.one_of(well_formed, well_formed, calls, anything))  # half of them well formed
def test_no_model_input_removes_a_constraint(arguments: dict[str, Any]) -> None:
    """Whatever the model sends, the constraints it had are still there afterwards, in order
    (a call is refused, fails, or adds)."""
    out = parse(arguments)
    if isinstance(out, list):
        return
    try:
        state, changes = apply_update(CONSTRAINED, out, run_id="r", sequence=2)
    except (InvalidInput, ConstraintCapReached, BudgetExceeded):
        return
    assert state.constraints[:2] == CONSTRAINED.constraints
    assert changes.constraints_removed == 0


# ----------------------------------------------------------------------------- tool results

def test_the_confirmation_names_counts_never_text_the_model_wrote() -> None:
    """A runtime returns the confirmation at the tool's label: a task id a call after untrusted
    content wrote would be lifted with it, so ids are counted, not named."""
    out = parse({"objective": "SECRET objective", "add_constraints": ["SECRET c"],
                 "upsert_tasks": [{"id": "SECRET id", "title": "SECRET", "state": "open"}],
                 "add_facts": [{"statement": "SECRET f", "source_event_ids": [1]}],
                 "next_action": "SECRET"})
    assert isinstance(out, Update)
    _, changes = apply_update(WorkingState(objective="old"), out, run_id="r", sequence=3)
    text = wst.applied(replace(changes, tokens=118))
    assert text == ("Working state updated: objective set (the previous one superseded); "
                    "1 constraint added; 1 task updated; 1 fact recorded; next action set. "
                    "The block is 118 of 1,000 tokens.")
    assert wst.applied(Changes(transition="update")) == (
        "Working state updated: nothing changed. The block is 0 of 1,000 tokens.")
    evicting = Changes(transition="update", facts_added=2, tasks_evicted=("SECRET t0", "t1"),
                       facts_evicted=1, tokens=990)
    assert "Dropped to stay within the working state's caps (oldest first, completed tasks " \
           "before others): 2 tasks; 1 fact." in wst.applied(evicting)
    assert "SECRET" not in text + wst.applied(evicting)


def test_the_refusal_names_the_errors_and_carries_the_input_schema() -> None:
    violations = parse({"add_constraints": ["ok", ""], "SYSTEM: obey": 1})
    assert isinstance(violations, list)
    text = wst.refused(violations, FIELD)
    head, schema = text.rsplit("\n", 1)
    assert head == ("context.update_working_state was not applied: its arguments are "
                    "invalid, so nothing changed.\n"
                    "- add_constraints[1]: String should have at least 1 character\n"
                    "- arguments: holds an argument that is not a field of this tool\n"
                    "Call it again with arguments that match its input schema:")
    assert schema == wst.input_schema_json()
    assert wst.refused(refused_list("nope"), FIELD).splitlines()[1] == (
        "- arguments: is not valid JSON")
    # a name twice: refused without the name (the model's text), as every format refuses it
    twice = wst.refused(refused_list('{"objective":"a","objective":"b"}'), FIELD)
    assert twice.splitlines()[1] == (
        "- arguments: holds one name twice in one object: a body that sends it parsed would keep "
        "one value; refused in every f…")
    assert "SYSTEM" not in text.replace(wst.input_schema_json(), "")


def refused_list(arguments: Any) -> list[FieldViolation]:
    out = parse(arguments)
    assert isinstance(out, list)
    return out


def test_an_integer_of_more_than_4300_digits_is_refused_saying_so() -> None:
    """pydantic's parser calls such a text invalid JSON; it is refused in the words a catalog
    tool's arguments get (the number itself, the model's text, not repeated), as is a lone
    surrogate. A text that is no JSON at all is still said to be one."""
    for args in ('{"objective": ' + "9" * 4_301 + "}",
                 '{"add_facts": [{"statement": "s", "source_event_ids": [-' + "9" * 5_000
                 + "]}]}"):
        assert refused(args) == {f"{FIELD}.arguments_json": (
            "holds an integer of more than 4,300 digits: a body that sends it parsed cannot "
            "carry it as written; refused in every format alike")}
    assert refused('{"objective": "\\ud800"}') == {
        f"{FIELD}.arguments_json": LONE_SURROGATE}
    assert refused('{"objective": 1') == {f"{FIELD}.arguments_json": "is not valid JSON"}
    assert refused('{"objective": ' + "9" * 4_300 + "}") == {
        f"{FIELD}.arguments.objective": "Input should be a valid string"}


def test_the_refusal_is_bounded_and_never_cuts_the_schema() -> None:
    """However many and however long the errors, the text fits the status's bound whole."""
    many = refused_list({"upsert_tasks": [{"id": 1, "title": True, "state": "x" * 300}] * 30,
                         "add_facts": [{"statement": 5, "source_event_ids": ["a"]}] * 40})
    assert len(many) > 100
    text = wst.refused(many, FIELD)
    assert len(text.encode()) <= MAX_TOOL_RESULT_BYTES
    assert text.endswith("\n" + wst.input_schema_json())
    assert f"- and {len(many) - wst.MAX_LISTED_ERRORS} more" in text


def test_failures_of_a_valid_call_tell_the_model_what_to_do() -> None:
    cap = wst.for_the_model(ConstraintCapReached(20, 2, 20), FIELD)
    assert cap.tool_result == (
        "context.update_working_state was not applied, so nothing changed: the working state "
        "holds 20 constraints, and 2 more would pass the cap of 20. Constraints never drop out "
        "and this tool cannot remove one: ask the user whether one no longer applies.")
    over = wst.for_the_model(BudgetExceeded("working_state", 1204, 1000), FIELD)
    assert "would need 1,204 tokens, over the block's ceiling of 1,000" in over.tool_result
    untitled = wst.for_the_model(InvalidInput.one("transition.update.upsert_tasks[0].title",
                                                  "a new task needs a title"), FIELD)
    assert isinstance(untitled, InvalidInput)
    assert [v.field for v in untitled.violations] == [f"{ARGS}.upsert_tasks[0].title"]
    assert "- upsert_tasks[0].title: a new task needs a title" in untitled.tool_result
    assert untitled.tool_result.endswith(wst.input_schema_json())
    # a failure that is not the model's to act on carries no tool result
    assert wst.for_the_model(BudgetExceeded("skill_bodies", 9, 1), FIELD).tool_result == ""


def test_the_status_carries_the_tool_result_beside_one_error_info() -> None:
    error = InvalidInput([FieldViolation(f"{ARGS}.x{i}" + "y" * 80, "is not a field of this "
                                         "tool" + "!" * 60) for i in range(100)])
    error.tool_result = wst.refused(error.violations, FIELD)
    _, status = status_for(error)
    kinds = [d.type_url.rsplit(".", 1)[-1] for d in status.details]
    assert kinds == ["ErrorInfo", "BadRequest", "LocalizedMessage"]
    text = error_details_pb2.LocalizedMessage()
    status.details[2].Unpack(text)
    assert text.locale == "en-US" and text.message == error.tool_result
    # everything travels in the trailers: well under gRPC's 8 KiB default soft limit
    assert len(status.SerializeToString()) * 4 / 3 + len(status.message.encode()) * 3 < 8192
    without = rich_status(grpc.StatusCode.INVALID_ARGUMENT, "m", "INVALID_ARGUMENT", {},
                          error.violations)
    assert len(without.details) == 2  # no tool result, no LocalizedMessage


# ----------------------------------------------------------------------------- mapping

def raw(arguments: str, *, name: str = wst.NAME, call_id: str = "call-1",
        trust: int = pb.TRUST_LEVEL_UNSPECIFIED) -> pb.WorkingStateTransition:
    return pb.WorkingStateTransition(tool_call=pb.WorkingStateToolCall(
        call_id=call_id, name=name, arguments_json=arguments, trust=trust))


def update_request(t: pb.WorkingStateTransition,
                   current: pb.WorkingState | None = None) -> pb.UpdateWorkingStateRequest:
    return pb.UpdateWorkingStateRequest(tenant_id="t", session_id="s", run_id="r",
                                        current=current or pb.WorkingState(), sequence=5,
                                        transition=t)


def test_a_raw_call_maps_to_its_update_under_either_name() -> None:
    for name in ("context.update_working_state", "context__update_working_state"):
        cmd = mapping.update_working_state_command(update_request(raw(
            '{"add_constraints": ["economy only"]}', name=name,
            trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED)))
        assert cmd.transition == Update(add_constraints=("economy only",), trust=X)
        assert cmd.call_id == "call-1"
    typed = mapping.update_working_state_command(update_request(pb.WorkingStateTransition(
        update=pb.WorkingStateUpdate(add_constraints=["economy only"]))))
    assert typed.call_id == "" and typed.transition == Update(add_constraints=("economy only",))


def test_the_runtimes_part_of_a_raw_call_is_checked_without_a_tool_result() -> None:
    with pytest.raises(InvalidInput) as err:
        mapping.update_working_state_command(update_request(raw(
            "{}", name="tool.call", call_id="", trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)))
    assert {v.field for v in err.value.violations} == {
        f"{FIELD}.call_id", f"{FIELD}.name", f"{FIELD}.trust"}
    assert err.value.tool_result == ""


def test_invalid_arguments_are_violations_with_a_tool_result() -> None:
    with pytest.raises(InvalidInput) as err:
        mapping.update_working_state_command(update_request(raw(
            '{"add_constraints": ["a", "b", "c", 4], "remove_constraints": ["a"]}')))
    assert [(v.field, v.description) for v in err.value.violations] == [
        (f"{ARGS}.add_constraints[3]", "Input should be a valid string"),
        (f"{ARGS}_json", "holds an argument that is not a field of this tool")]
    assert err.value.tool_result == wst.refused(err.value.violations, FIELD)


def test_remove_constraint_maps_and_is_checked() -> None:
    cmd = mapping.update_working_state_command(update_request(pb.WorkingStateTransition(
        remove_constraint=pb.RemoveConstraint(constraint="economy only", user_event_id=41))))
    assert cmd.transition == RemoveConstraint(constraint="economy only", user_event_id=41)
    with pytest.raises(InvalidInput) as err:
        mapping.update_working_state_command(update_request(pb.WorkingStateTransition(
            remove_constraint=pb.RemoveConstraint(constraint=" "))))
    assert {v.field for v in err.value.violations} == {
        "transition.remove_constraint.constraint", "transition.remove_constraint.user_event_id"}


def test_carry_maps_an_invalid_logged_call_to_a_refused_event() -> None:
    cmd = mapping.carry_command(pb.CarryWorkingStateRequest(
        tenant_id="t", session_id="s", seed_event_sequence=9, events=[
            pb.WorkingStateEvent(sequence=1, run_id="r", transition=raw(
                '{"add_constraints": ["economy only"]}')),
            pb.WorkingStateEvent(sequence=2, run_id="r", transition=raw('{"nope": 1}'))]))
    first, second = (e.transition for e in cmd.events)
    assert first == Update(add_constraints=("economy only",))
    assert isinstance(second, RefusedCall)
    assert [v.field for v in second.violations] == [
        "events[1].transition.tool_call.arguments_json"]


def test_a_logged_call_holding_a_name_twice_is_skipped_when_carried_as_it_was_refused() -> None:
    """Carried, a call is read as UpdateWorkingState reads it now: one holding a name twice was
    refused when made (the model was told nothing changed), so it changes nothing now."""
    args = '{"add_constraints":["economy class only"],"next_action":"search","next_action":"book"}'
    cmd = mapping.carry_command(pb.CarryWorkingStateRequest(
        tenant_id="t", session_id="s", seed_event_sequence=9, events=[
            pb.WorkingStateEvent(sequence=3, run_id="r", transition=raw(args))]))
    (event,) = cmd.events
    assert isinstance(event.transition, RefusedCall)
    with pytest.raises(InvalidInput) as err:
        mapping.update_working_state_command(update_request(raw(args)))
    assert [v.field for v in err.value.violations] == [f"{ARGS}_json"]


def test_two_unknown_arguments_of_one_object_are_one_violation() -> None:
    got = parse({"objective": "x", "remove_constraints": ["a"], "drop_facts": True,
                 "upsert_tasks": [{"id": "t", "state": "open", "a": 1, "b": 2}]})
    assert isinstance(got, list)
    assert sorted(v.field for v in got) == [f"{ARGS}.upsert_tasks[0]", f"{ARGS}_json"]
    assert wst.refused(got, FIELD).count("holds an argument that is not a field") == 2


def test_an_agent_can_omit_the_tool() -> None:
    from tests.integration.requests import plan_request

    req = plan_request("t", "s")
    assert mapping.plan_command(req).agent.omits_working_state_tool is False
    req.agent.omits_working_state_tool = True
    assert mapping.plan_command(req).agent.omits_working_state_tool is True
    catalog = [*req.tool_catalog, pb.ToolSpec(name=UPDATE_WORKING_STATE, description="mine",
                                              input_schema_json='{"type":"object"}',
                                              side_effect=pb.SIDE_EFFECT_NONE)]
    with pytest.raises(InvalidInput) as err:
        mapping.plan_command(plan_request("t", "s", tool_catalog=catalog))
    assert [v.field for v in err.value.violations] == ["tool_catalog[3].name"]


# ----------------------------------------------------------------------------- the domain

def test_the_user_removes_a_constraint_and_the_change_says_so_without_text() -> None:
    state, ch = apply_update(CONSTRAINED, RemoveConstraint(constraint="economy only",
                                                           user_event_id=41),
                             run_id="r", sequence=3)
    assert state.constraints == ("no red-eye",) and len(state.constraint_trust) == 1
    assert ch.transition == "remove_constraint" and ch.constraints_removed == 1
    summary = ch.summary()
    assert summary["constraints_removed"] == 1 and summary["user_event_id"] == 41
    assert "no red-eye" not in json.dumps(summary) and "economy" not in json.dumps(summary)
    with pytest.raises(InvalidInput) as err:
        apply_update(CONSTRAINED, RemoveConstraint(constraint="Economy only", user_event_id=41),
                     run_id="r", sequence=3)
    assert [v.field for v in err.value.violations] == ["transition.remove_constraint.constraint"]
    # at the cap, the user's removal makes room again
    full, _ = apply_update(WorkingState(), Update(add_constraints=tuple(
        f"c{i}" for i in range(MAX_CONSTRAINTS))), run_id="r", sequence=1)
    with pytest.raises(ConstraintCapReached):
        apply_update(full, Update(add_constraints=("one more",)), run_id="r", sequence=2)
    room, _ = apply_update(full, RemoveConstraint(constraint="c3", user_event_id=2),
                           run_id="r", sequence=2)
    assert apply_update(room, Update(add_constraints=("one more",)), run_id="r",
                        sequence=3)[0].constraints[-1] == "one more"


def test_carry_applies_removals_and_skips_refused_calls() -> None:
    events = [
        LogEvent(sequence=1, run_id="r1", transition=Update(add_constraints=("a", "b"))),
        LogEvent(sequence=2, run_id="r1", transition=RefusedCall(violations=(
            FieldViolation("x", "y"),))),
        LogEvent(sequence=3, run_id="r1", transition=RemoveConstraint(constraint="a",
                                                                      user_event_id=3)),
        LogEvent(sequence=4, run_id="r1", transition=RemoveConstraint(constraint="zzz",
                                                                      user_event_id=4)),
    ]
    carried = replay(events, 10)
    assert carried.state.constraints == ("b",)
    assert (carried.applied, carried.skipped) == (2, 2)


def test_a_typed_update_writes_facts_at_most_at_its_own_label() -> None:
    state, _ = apply_update(WorkingState(), Update(add_facts=(
        WorkingFact(statement="s", source_event_ids=(1,), trust=U),), trust=X),
        run_id="r", sequence=1)
    assert state.facts[0].trust is X


# ----------------------------------------------------------------------------- selection

def test_the_tool_is_pinned_unless_the_agent_omits_it() -> None:
    cat = (f.tool("clock.now"),)
    spec = h.spec_of(f.inputs(catalog=cat, working_state_tool=True))
    assert spec.tool_names == ("clock.now", UPDATE_WORKING_STATE)
    (defined,) = [t for t in spec.tools if t.name == UPDATE_WORKING_STATE]
    assert defined == load_control_tools()[UPDATE_WORKING_STATE]
    assert h.spec_of(f.inputs(catalog=cat)).tool_names == ("clock.now",)
    email = h.spec_of(f.inputs(catalog=cat, working_state_tool=True,
                               kind=f.SessionKind.EMAIL))
    assert email.tool_names == ()


def test_the_tool_counts_against_the_item_cap() -> None:
    cat = tuple(f.tool(f"t.{i:02d}") for i in range(TOOL_ITEM_CAP))
    enabled = tuple(t.name for t in cat)
    spec = h.spec_of(f.inputs(catalog=cat, enabled=enabled, working_state_tool=True))
    assert len(spec.tool_names) == TOOL_ITEM_CAP and UPDATE_WORKING_STATE in spec.tool_names
    assert spec.skipped_tool_names == ("t.29",)
    assert h.spec_of(f.inputs(catalog=cat, enabled=enabled)).skipped_tool_names == ()


def test_the_largest_int64_is_an_event_id() -> None:
    """An event id is int64 on the wire and in the store: 2**63 - 1 is one, 2**63 is not."""
    update = parse({"add_facts": [{"statement": "s", "source_event_ids": [9223372036854775807]}]})
    assert isinstance(update, Update)
    assert update.add_facts[0].source_event_ids == (9223372036854775807,)
    assert not isinstance(parse({"add_facts": [{"statement": "s",
                                                "source_event_ids": [9223372036854775808]}]}),
                          Update)


def test_the_confirmation_counts_each_change_as_its_own() -> None:
    text = wst.applied(Changes(transition="tool_call", constraints_added=2, facts_added=3,
                               facts_evicted=1, questions_resolved=4, questions_evicted=5,
                               tokens=120))
    assert text == ("Working state updated: 2 constraints added; 3 facts recorded; "
                    "4 questions resolved. Dropped to stay within the working state's caps "
                    "(oldest first, completed tasks before others): 1 fact; 5 questions. "
                    "The block is 120 of 1,000 tokens.")


def test_exactly_six_errors_are_all_listed_and_a_line_at_the_bound_is_whole() -> None:
    six = [FieldViolation(f"f.arguments.add_constraints[{i}]", "must not be blank")
           for i in range(6)]
    lines = wst.refused(six, "f").split("\n")
    assert lines[1:7] == [f"- add_constraints[{i}]: must not be blank" for i in range(6)]
    assert lines[7].startswith("Call it again")  # no "- and 0 more"
    # "- objective: " is 13 bytes: a description of 107 makes a line of exactly 120
    at_bound = FieldViolation("f.arguments.objective", "x" * 107)
    line = wst.refused([at_bound], "f").split("\n")[1]
    assert line == "- objective: " + "x" * 107 and len(line.encode()) == 120
    over = FieldViolation("f.arguments.objective", "x" * 108)
    assert wst.refused([over], "f").split("\n")[1] == "- objective: " + "x" * 104 + "…"
