"""The estimator rounds up, never down, and the correction factor scales a message's framing
with the rest of it (spec: "The token estimator"; estimator.py: "conservative: counts ...
are multiplied by the model's base factor and the request's correction factor, and round
up"). The expected figures are worked out by hand here from those rules, with a counter that
counts one token a character, so no figure depends on a tokenizer nor on the estimator's own
arithmetic."""

from __future__ import annotations

import pytest
from context_engine.domain.estimator import TokenEstimator
from context_engine.domain.request import Message, Role
from context_engine.domain.trust import TrustLevel


class _OneACharacter:
    name = "one-a-character"
    encoding = "one-a-character"

    def count(self, text: str) -> int:
        return len(text)


@pytest.mark.parametrize(("size", "tokens"), [(1, 1), (3, 1), (4, 2), (5, 2), (7, 3)])
def test_a_reasoning_payload_costs_a_token_per_three_bytes_rounded_up(size: int,
                                                                      tokens: int) -> None:
    # not JSON: no text in it is read, only its bytes count; 4 bytes are more than one token
    message = Message(row=10, role=Role.ASSISTANT, trust=TrustLevel.TRUSTED_CONFIGURATION,
                      reasoning_provider="anthropic", reasoning_opaque=b"\xff" * size)
    assert TokenEstimator(_OneACharacter(), 1.0).raw(message) == tokens


def test_the_correction_factor_scales_a_messages_framing_too() -> None:
    # ten characters and the 4 tokens of framing, times 1.5: (10 + 4) * 1.5 = 21, where
    # scaling the text alone would give 10 * 1.5 + 4 = 19
    message = Message(row=10, role=Role.USER, trust=TrustLevel.USER, text="abcdefghij")
    assert TokenEstimator(_OneACharacter(), 1.0).message(message, 1.5) == 21
    # and with a base factor: (10 * 1.3 + 4) * 1.5 = 25.5, rounded up to 26
    assert TokenEstimator(_OneACharacter(), 1.3).message(message, 1.5) == 26


@pytest.mark.parametrize("reserve", [8_192, 9_000])
def test_an_output_reserve_that_takes_the_whole_window_is_refused(reserve: int) -> None:
    # a reserve equal to the window leaves no token of input: refused at the field, as one
    # above it is, not admitted to fail later without naming the reserve
    from context_engine.domain.errors import InvalidInput
    from context_engine.domain.estimator import ModelCatalog

    with pytest.raises(InvalidInput) as refused:
        ModelCatalog([]).resolve("acme-8k", context_window=8_192, output_reserve=reserve,
                                 breakpoint_budget=None)
    assert "model.capabilities.output_reserve" in str(refused.value.violations)
    ModelCatalog([]).resolve("acme-8k", context_window=8_192, output_reserve=8_191,
                             breakpoint_budget=None)
