"""The bounds of an error's status at their edges: a value of exactly its limit travels whole,
the violations that exactly fill their room are all listed, and a status that lists fewer
than it counts says so in its message. Expected values are literal (sizes worked out by hand
from the protobuf wire format), never computed by the code under test."""

from __future__ import annotations

import grpc
from context_engine.api.status import rich_status
from context_engine.domain.errors import FieldViolation
from google.rpc import error_details_pb2

CODE = grpc.StatusCode.INVALID_ARGUMENT


def listed(status: object) -> list[str]:
    """The fields of the BadRequest the status carries, parsed back by protobuf."""
    for detail in status.details:  # type: ignore[attr-defined]
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return [v.field for v in bad.field_violations]
    return []


def test_a_message_of_exactly_the_limit_travels_whole() -> None:
    exact = "é" * 200  # 400 UTF-8 bytes: the message's limit
    assert rich_status(CODE, exact, "INVALID_ARGUMENT", {}).message == exact
    over = "m" * 401
    assert rich_status(CODE, over, "INVALID_ARGUMENT", {}).message == "m" * 397 + "…"


def test_a_metadata_value_of_exactly_the_limit_travels_whole() -> None:
    status = rich_status(CODE, "m", "R", {"field": "f" * 200, "other": "g" * 201})
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.metadata["field"] == "f" * 200
    assert info.metadata["other"] == "g" * 197 + "…"


def test_violations_that_exactly_fill_their_room_are_all_listed() -> None:
    # each: field "fNN" (1 + 1 + 3 bytes) and a description of 110 bytes (1 + 1 + 110): 117
    # bytes, counted with 3 of framing, 120: twenty-five fill the 3,000 bytes exactly
    violations = tuple(FieldViolation(f"f{i:02d}", "d" * 110) for i in range(25))
    status = rich_status(CODE, "bad", "INVALID_ARGUMENT", {}, violations)
    assert listed(status) == [f"f{i:02d}" for i in range(25)]
    assert status.message == "bad"


def test_a_status_listing_fewer_violations_than_it_counts_says_so() -> None:
    violations = tuple(FieldViolation(f"f{i:02d}", "d" * 110) for i in range(30))
    status = rich_status(CODE, "bad", "INVALID_ARGUMENT", {}, violations)
    assert listed(status) == [f"f{i:02d}" for i in range(25)]
    assert status.message == "30 violations (the first 25 in the details): bad"
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.metadata["violations"] == "30"
