"""Reconciliation around attachments' bounds, over generated reports.

A report of a request with attachments tells the provider's total, not how it splits: the
attachments' content (estimated at an upper bound, ``bounded``) cost anything from nothing to
all of it. Whatever the split, the factor one report leaves must lie between the factor it
found and the one that would have matched the text alone (the truth the report cannot see,
which this test knows because it made the report): it moves toward the truth, never past it.
Past it downward, a later request of text alone is estimated below what the provider counts;
past it upward, headroom is wasted for files the text never cost. The oracle here is that
sentence, computed from the generated split; it calls nothing of the service's but
``reconcile`` itself.
"""

from __future__ import annotations

import pytest
from context_engine.domain.calibration import MAX_FACTOR, Calibration, reconcile
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gate_budget

FLOOR = 1 / 1.3  # Claude's and Gemini's least factor


@st.composite
def reports(draw: st.DrawFn) -> tuple[Calibration, int, int, int, int, float, float]:
    """(current, fixed, text estimated, bound, actual, factor used, the text's true factor)."""
    factor_used = draw(st.floats(min_value=FLOOR, max_value=MAX_FACTOR))
    current = Calibration(model_id="claude-sonnet-4-5", encoding="cl100k_base",
                          factor=draw(st.floats(min_value=FLOOR, max_value=MAX_FACTOR)),
                          reports=1)
    fixed = draw(st.sampled_from([0, 0, 2_000, 9_000]))
    text_estimated = draw(st.integers(min_value=50, max_value=150_000))
    bound = draw(st.integers(min_value=0, max_value=100_000))
    text_actual = draw(st.integers(min_value=1, max_value=300_000))
    attachments_actual = draw(st.integers(min_value=0, max_value=bound))
    actual = fixed + text_actual + attachments_actual
    truth = factor_used * text_actual / text_estimated
    return current, fixed, text_estimated, bound, actual, factor_used, truth


@settings(max_examples=400, deadline=None)
@given(reports())
def test_the_factor_moves_toward_the_texts_own_and_never_past_it(
        case: tuple[Calibration, int, int, int, int, float, float]) -> None:
    current, fixed, text_estimated, bound, actual, factor_used, truth = case
    truth = min(max(truth, FLOOR), MAX_FACTOR)
    after = reconcile(current, model_id="claude-sonnet-4-5", encoding="cl100k_base",
                      estimated=fixed + text_estimated + bound, actual=actual,
                      factor_used=factor_used, fixed=fixed, bounded=bound,
                      floor=FLOOR).calibration.factor
    low, high = sorted((current.factor, truth))
    assert low - 1e-6 <= after <= high + 1e-6, (current.factor, truth, after)


@settings(max_examples=200, deadline=None)
@given(reports())
def test_without_attachments_a_report_still_corrects_an_under_count_at_once(
        case: tuple[Calibration, int, int, int, int, float, float]) -> None:
    """The bound at 0 is the report as before: the factor rises at once to the text's."""
    current, fixed, text_estimated, _, _, factor_used, truth = case
    actual = fixed + round(truth * text_estimated / factor_used)
    truth = factor_used * max(actual - fixed, 1) / text_estimated
    after = reconcile(current, model_id="claude-sonnet-4-5", encoding="cl100k_base",
                      estimated=fixed + text_estimated, actual=actual,
                      factor_used=factor_used, fixed=fixed, floor=FLOOR).calibration.factor
    if min(truth, MAX_FACTOR) > current.factor:
        assert after == pytest.approx(min(truth, MAX_FACTOR), abs=1e-6)
    else:
        assert after <= current.factor + 1e-6  # stored to six places
