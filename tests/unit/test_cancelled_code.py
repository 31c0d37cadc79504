"""The code of a call cancelled under its handler (``rpc_metrics.cancelled_code``): the
caller's deadline passes on its side a network latency before the server's copy of it, so a
call cancelled that close to its deadline is DEADLINE_EXCEEDED; one with time left, or none
set, was given up by its caller (or the server stopping)."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest
from context_engine.api.rpc_metrics import DEADLINE_SLACK_SECONDS, cancelled_code


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(("remaining", "code"), [
    (-1.0, grpc.StatusCode.DEADLINE_EXCEEDED),
    (0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
    (0.1, grpc.StatusCode.DEADLINE_EXCEEDED),  # the caller's deadline passed first
    (DEADLINE_SLACK_SECONDS, grpc.StatusCode.DEADLINE_EXCEEDED),
    (DEADLINE_SLACK_SECONDS + 0.01, grpc.StatusCode.CANCELLED),
    (25.0, grpc.StatusCode.CANCELLED),
    (None, grpc.StatusCode.CANCELLED),  # no deadline: only the caller can have given up
])
def test_a_cancelled_call_is_deadline_exceeded_only_at_its_deadline(
        remaining: float | None, code: grpc.StatusCode) -> None:
    assert cancelled_code(cast(Any, Context(remaining))) is code


def test_the_slack_is_a_network_latency_not_a_deadline() -> None:
    assert 0 < DEADLINE_SLACK_SECONDS <= 0.5
