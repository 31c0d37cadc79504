"""Estimator reconciliation (spec: "It reconciles against reality"): a per-model correction
factor from observed usage. It moves up at once (an under-count risks a provider error) and
down slowly (an over-count only wastes headroom), and resets when the encoding changes."""

from __future__ import annotations

from dataclasses import dataclass

MIN_FACTOR = 0.5
MAX_FACTOR = 4.0
DOWN_RATE = 0.3


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
              actual: int, factor_used: float, fixed: int = 0) -> Reconciled:
    """``estimated`` was computed with ``factor_used`` applied to everything but ``fixed``
    tokens (the prefix, measured once at plan time and never scaled). The body's factor that
    would have matched is ``factor_used * (actual - fixed) / (estimated - fixed)``: the body
    absorbs the whole error, so one report corrects an under-count at once."""
    if current is None or current.encoding != encoding or current.model_id != model_id:
        current = Calibration(model_id=model_id, encoding=encoding)
    body_estimated = estimated - fixed
    body_actual = max(actual - fixed, 1)
    target = (factor_used * body_actual / body_estimated if body_estimated > 0
              else current.factor)
    target = min(max(target, MIN_FACTOR), MAX_FACTOR)
    if target > current.factor:
        factor = target
    else:
        factor = current.factor + (target - current.factor) * DOWN_RATE
    factor = round(factor, 6)
    error = (actual - estimated) / actual if actual > 0 else 0.0
    return Reconciled(
        calibration=Calibration(model_id=model_id, encoding=encoding, factor=factor,
                                reports=current.reports + 1),
        previous_factor=current.factor, error_ratio=error)
