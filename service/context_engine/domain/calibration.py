"""Estimator reconciliation (spec: "It reconciles against reality"): a per-model correction
factor from the observed ratio of actual to estimated usage. It moves up at once (an
under-count risks a provider error) and down slowly (an over-count only wastes headroom), and
resets when the encoding changes.

Which part of the estimate the ratio is taken over depends on how the prefix was counted. A
prefix counted with the model's own tokenizer is exact and never scaled, so the whole error is
the body's (``fixed`` = the prefix's tokens). A prefix counted with an approximate tokenizer
(Claude and Gemini with cl100k_base x 1.3, a fallback encoding) carries the same error as the
body and is scaled with it, so the factor is the ratio over the whole estimate (``fixed`` = 0):
actual = 2 x estimate doubles the factor, where charging it all to the body would quadruple it.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_FACTOR = 0.5
MAX_FACTOR = 4.0
DOWN_RATE = 0.3
# The least factor where the model's own tokenizer counts the request: at 1.0 the estimate is
# already an upper bound of what the provider counts (every form counted at its costliest, each
# tool with conservative framing), so a report below it measures that designed slack, not
# drift, and the slack differs by content: a factor under 1 learned on one request's mix
# (tool-heavy, say) under-counts a request of another and sends it over the window.
EXACT_MIN_FACTOR = 1.0


def least_factor(exact: bool, base_factor: float | None = None) -> float:
    """The floor of the correction factor: :data:`EXACT_MIN_FACTOR` where the plan's prefix
    and body are counted with the model's own tokenizer (``builder.prefix_exact``). Else an
    approximate count, its encoding's times ``base_factor`` (cl100k_base x 1.3 for Claude and
    Gemini, whose ratio to the provider's is what reconciliation learns): never below
    ``1 / base_factor``, where the estimate would be less than the encoding's own count,
    which the providers' tokenizers do not count below (Claude's counts more than cl100k_base
    for the same text), nor below :data:`MIN_FACTOR`. ``base_factor`` None: the encoding stands
    in for another (a fallback), which may count below it: :data:`MIN_FACTOR`."""
    if exact:
        return EXACT_MIN_FACTOR
    return MIN_FACTOR if base_factor is None else max(MIN_FACTOR, 1.0 / base_factor)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    model_id: str
    encoding: str
    factor: float = 1.0
    reports: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconciled:
    calibration: Calibration
    previous_factor: float
    error_ratio: float  # signed (actual - estimated) / actual


def reconcile(current: Calibration | None, *, model_id: str, encoding: str, estimated: int,
              actual: int, factor_used: float, fixed: int = 0, bounded: int = 0,
              floor: float = MIN_FACTOR) -> Reconciled:
    """``estimated`` was computed with ``factor_used`` applied to everything but ``fixed``
    tokens (an exact prefix, measured once at plan time and never scaled; 0 when the prefix
    count is approximate and was scaled too). The factor that would have matched is
    ``factor_used * (actual - fixed) / (estimated - fixed)``: what was scaled absorbs the whole
    error, so one report corrects an under-count at once. With ``fixed`` = 0 that is the
    observed ratio over the whole estimate. The factor never falls below ``floor``
    (:func:`least_factor`), and one stored below it is raised to it.

    ``bounded``: the part of ``estimated`` that is an upper bound and not a count (the
    attachments' content: an image at its model's largest cost), whose actual tokens lie
    anywhere from none to all of it. The text's ratio then lies between the one that charges
    the attachments in full and the one that charges them nothing: the factor rises at once to
    the first when even it is above the factor (an under-count the report proves), falls
    slowly toward the second when even it is below (an over-count it proves), and is kept
    otherwise, so a file that cost the provider less than its bound never pulls down the
    factor that text alone is estimated with."""
    if current is None or current.encoding != encoding or current.model_id != model_id:
        current = Calibration(model_id=model_id, encoding=encoding)
    body_estimated = estimated - fixed - bounded
    if body_estimated > 0:
        least = factor_used * max(actual - fixed - bounded, 1) / body_estimated
        most = factor_used * max(actual - fixed, 1) / body_estimated
    else:  # nothing but bounds: the report tells nothing of the text
        least = most = current.factor
    least = min(max(least, floor), MAX_FACTOR)
    most = min(max(most, floor), MAX_FACTOR)
    if least > current.factor:  # a factor stored under the floor rises to it at least
        factor = least
    elif most < current.factor:
        factor = current.factor + (most - current.factor) * DOWN_RATE
    else:
        factor = current.factor
    factor = round(factor, 6)
    error = (actual - estimated) / actual if actual > 0 else 0.0
    return Reconciled(
        calibration=Calibration(model_id=model_id, encoding=encoding, factor=factor,
                                reports=current.reports + 1),
        previous_factor=current.factor, error_ratio=error)
