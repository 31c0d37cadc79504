"""CE_MAX_ITEMS_PER_REQUEST caps the elements of every repeated field of a request, wherever it
is: inside the elements of another repeated field too (100,001 calls in one checkpoint item, a
million scopes of one tool were taken). Paths are found by walking the contract's descriptors,
not by the code under test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from context_engine.api import limits as limits_module
from context_engine.api.limits import Limits, Violation, shape_violation
from context_engine.v1 import context_engine_pb2 as pb
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

SERVICE = pb.DESCRIPTOR.services_by_name["ContextEngine"]
SMALL = Limits(max_concurrent=1, max_items=3, max_item_bytes=1 << 24)

# a path: the fields from the request down to a repeated field, each (field, is the element
# of a repeated field stepped into)
Path = tuple[FieldDescriptor, ...]


def repeated_paths(message: Descriptor, above: Path = (),
                   seen: frozenset[str] = frozenset()) -> Iterator[Path]:
    for field in message.fields:
        path = (*above, field)
        if field.is_repeated:
            yield path
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.full_name not in seen:
            if field.message_type.full_name == "google.protobuf.Timestamp":
                continue
            yield from repeated_paths(field.message_type, path,
                                      seen | {field.message_type.full_name})


CASES = [(method.name, path) for method in SERVICE.methods
         for path in repeated_paths(method.input_type)]


def over_the_limit(request: Message, path: Path) -> str:
    """Put ``max_items + 1`` elements in the last field of ``path`` (one element in each
    repeated field on the way) and return the name the limit should give it."""
    message, names = request, []
    for field in path[:-1]:
        if field.is_repeated:
            message = getattr(message, field.name).add()
            names.append(f"{field.name}[0]")
        else:
            message = getattr(message, field.name)
            names.append(field.name)
    last = path[-1]
    target = getattr(message, last.name)
    for _ in range(SMALL.max_items + 1):
        if last.type == FieldDescriptor.TYPE_MESSAGE:
            target.add()
        elif last.type == FieldDescriptor.TYPE_STRING:
            target.append("")
        elif last.type == FieldDescriptor.TYPE_BYTES:
            target.append(b"")
        elif last.type == FieldDescriptor.TYPE_BOOL:
            target.append(False)
        elif last.type == FieldDescriptor.TYPE_ENUM:
            target.append(0)
        else:
            target.append(0)
    return ".".join([*names, last.name])


@pytest.mark.parametrize(("rpc", "path"), CASES,
                         ids=[f"{rpc}:{'.'.join(f.name for f in path)}" for rpc, path in CASES])
def test_every_repeated_field_of_every_request_is_held_to_the_limit(rpc: str,
                                                                    path: Path) -> None:
    request = pb.DESCRIPTOR.services_by_name["ContextEngine"].methods_by_name[rpc]
    message = getattr(pb, request.input_type.name)()
    name = over_the_limit(message, path)
    assert shape_violation(message, SMALL) == Violation(
        "TOO_MANY_ITEMS", name, SMALL.max_items + 1, SMALL.max_items)


def test_the_depth_bound_reaches_the_deepest_repeated_field() -> None:
    deepest = max(sum(1 for f in path[:-1]) for _, path in CASES)
    assert deepest == limits_module._MAX_DEPTH


def test_the_oversized_requests_are_refused_at_the_default_limit() -> None:
    """100,001 calls in one checkpoint item; one tool with 1,000,000 required scopes."""
    defaults = Limits(max_concurrent=64, max_items=100_000, max_item_bytes=16 * 1024 * 1024)
    build = pb.BuildRequest(tenant_id="t", session_id="s")
    build.checkpoint.items.add(id="u1", sequence=1, user=pb.UserMessage(text="hi"))
    calls = build.checkpoint.items.add(id="c1", sequence=2).tool_calls.calls
    for i in range(100_001):
        calls.add(call_id=f"k{i}", name="web.fetch", arguments_json="{}")
    assert shape_violation(build, defaults) == Violation(
        "TOO_MANY_ITEMS", "checkpoint.items[1].tool_calls.calls", 100_001, 100_000)
    plan = pb.PlanRequest(tenant_id="t", session_id="s")
    plan.tool_catalog.add(name="web.fetch").required_scopes.extend(
        f"s{i}" for i in range(1_000_000))
    assert shape_violation(plan, defaults) == Violation(
        "TOO_MANY_ITEMS", "tool_catalog[0].required_scopes", 1_000_000, 100_000)
    del calls[-1]  # at the limit: served
    assert shape_violation(build, defaults) is None


def test_an_incremental_builds_items_are_named_by_their_place_in_the_whole_checkpoint() -> None:
    build = pb.BuildRequest(tenant_id="t", session_id="s", base_build_id="b",
                            base_items_kept=2)
    calls = build.checkpoint.items.add(id="c1", sequence=3).tool_calls.calls
    for i in range(SMALL.max_items + 1):
        calls.add(call_id=f"k{i}", name="web.fetch")
    assert shape_violation(build, SMALL, base_items=lambda *_: 2) == Violation(
        "TOO_MANY_ITEMS", "checkpoint.items[2].tool_calls.calls", 4, 3)
