"""The sizes an incremental Build computes instead of serializing (``full_response_bytes``):
each length-delimited field's bytes, read against what protobuf itself writes, at every
boundary where a length's varint grows a byte (127/128, 16,383/16,384, ...). A message that
serializes to exactly 128 bytes is an ordinary one; its entry is 3 bytes of framing, not 2."""

from __future__ import annotations

import pytest
from context_engine.api.incremental import _entry, _varint
from context_engine.v1 import context_engine_pb2 as pb

LENGTHS = [1, 127, 128, 129, 16_383, 16_384, 2_097_151, 2_097_152]


@pytest.mark.parametrize("n", LENGTHS)
def test_a_varints_size_is_what_protobuf_writes(n: int) -> None:
    # Span.base_start is field 1, a varint: its encoding is a one-byte tag and the varint
    assert _varint(n) == len(pb.Span(base_start=n).SerializeToString()) - 1


@pytest.mark.parametrize("n", [0, 1, 125, 126, 127, 128, 200])
def test_a_length_delimited_entry_is_what_protobuf_writes(n: int) -> None:
    # a request holding one message whose text makes the message n bytes or so: the entry
    # the size computation gives it equals the bytes protobuf spends on it
    message = pb.Message(text="x" * n)
    size = message.ByteSize()
    request = pb.ModelRequest(messages=[message])
    assert _entry(1, size) == request.ByteSize()
