"""CE_MAX_SEND_BYTES at its edge: a response of exactly the limit is sent, one byte more is
RESPONSE_TOO_LARGE naming both sizes. The bytes are written out by hand (PlanResponse.created
is field 2, a varint: tag 0x10, then 0x01)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from context_engine.api.servicer import ContextEngineServicer
from context_engine.domain.errors import ResponseTooLarge
from context_engine.v1 import context_engine_pb2 as pb


def servicer(limit: int) -> ContextEngineServicer:
    s = ContextEngineServicer(cast(Any, None), cast(Any, None))
    s.max_response_bytes = limit
    return s


def test_a_response_of_exactly_the_send_limit_is_sent() -> None:
    response = pb.PlanResponse(created=True)
    assert servicer(2)._sized(response) == b"\x10\x01"
    with pytest.raises(ResponseTooLarge) as refused:
        servicer(1)._sized(response)
    assert (refused.value.size, refused.value.limit) == (2, 1)
