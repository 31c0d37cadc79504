"""The request-shape limits at their edges: an element of exactly ``max_item_bytes`` is taken,
one byte more is refused, and a string element is measured in the UTF-8 bytes it travels as,
not in characters. Sizes are written out by hand from the protobuf wire format."""

from __future__ import annotations

from context_engine.api.limits import Limits, Violation, shape_violation
from context_engine.v1 import context_engine_pb2 as pb


def item_of(text: str) -> pb.ConversationItem:
    return pb.ConversationItem(user=pb.UserMessage(text=text))


def test_an_element_of_exactly_the_item_limit_is_taken() -> None:
    # ConversationItem.user (tag and length, a byte each) holding UserMessage.text (tag and
    # length, a byte each, then 100 bytes): 104 bytes
    item = item_of("x" * 100)
    assert len(item.SerializeToString()) == 104  # protobuf's own count agrees
    request = pb.BuildRequest(checkpoint=pb.Checkpoint(items=[item]))
    taken = Limits(max_concurrent=1, max_items=10, max_item_bytes=104)
    assert shape_violation(request, taken) is None
    refused = Limits(max_concurrent=1, max_items=10, max_item_bytes=103)
    assert shape_violation(request, refused) == Violation(
        "ITEM_TOO_LARGE", "checkpoint.items[0]", 104, 103)


def test_a_string_element_is_measured_in_utf8_bytes() -> None:
    limits = Limits(max_concurrent=1, max_items=10, max_item_bytes=1024)
    # 600 characters of two bytes each: 1,200 bytes on the wire, over the limit of 1,024
    request = pb.RotateRequest(drop_tools=["ok", "é" * 600])
    assert shape_violation(request, limits) == Violation(
        "ITEM_TOO_LARGE", "drop_tools[1]", 1200, 1024)
    # exactly the limit in bytes (512 two-byte characters) is taken
    assert shape_violation(pb.RotateRequest(drop_tools=["é" * 512]), limits) is None
