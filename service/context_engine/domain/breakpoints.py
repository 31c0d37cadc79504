"""Cache breakpoints (spec: "The history cache window", ADR-0132, ADR-0135).

The plan carries ``after_system`` and ``after_tools`` with one TTL fixed at plan time. Build
adds up to two history markers: the carried-history marker (through the summary and the
retained carried history) and the run marker (through the active run's completed
conversation, stopping before a replayed provider continuation; fresh rows 11-14 and the
trailing input always come after it). History markers use the default TTL. Markers are
provider cache annotations: outside ``prefix_sha256``, they change no byte the model reads.
Priority order: after_system, after_tools, carried history, run — a model that allows fewer
breakpoints drops the run marker first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from context_engine.domain.items import (
    ConversationItem,
    ReasoningItem,
    ToolResultItem,
    UserMessageItem,
)

DEFAULT_TTL = "5m"
PRIORITY = ("after_system", "after_tools", "carried_history", "run")
SUMMARY_ITEM = "@summary"


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheBreakpoint:
    name: str
    ttl: str
    through_item: str = ""  # history markers: the last item the cached prefix includes
    through_input_item: str = ""  # the latest user or tool-result item at or before it


def _latest_input(items: Sequence[ConversationItem], upto: int) -> str:
    for item in reversed(items[:upto + 1]):
        if isinstance(item, (UserMessageItem, ToolResultItem)):
            return item.id
    return ""


def history_breakpoints(*, carried: Sequence[ConversationItem], has_summary: bool,
                        active: Sequence[ConversationItem]) -> list[CacheBreakpoint]:
    """The history window of one request. ``carried`` is the retained carried history,
    ``active`` the active run's items in request order (trailing input excluded)."""
    marks: list[CacheBreakpoint] = []
    if carried:
        marks.append(CacheBreakpoint(name="carried_history", ttl=DEFAULT_TTL,
                                     through_item=carried[-1].id,
                                     through_input_item=_latest_input(carried,
                                                                      len(carried) - 1)))
    elif has_summary:
        marks.append(CacheBreakpoint(name="carried_history", ttl=DEFAULT_TTL,
                                     through_item=SUMMARY_ITEM))
    # The runtime replays only the latest turn's reasoning items, so the next step no longer
    # carries them: the run's repeated prefix ends before the last stretch of reasoning.
    end = len(active)
    last = max((i for i, item in enumerate(active) if isinstance(item, ReasoningItem)),
               default=-1)
    if last >= 0:
        end = last
        while end > 0 and isinstance(active[end - 1], ReasoningItem):
            end -= 1
    if end > 0:
        everything = [*carried, *active[:end]]
        marks.append(CacheBreakpoint(name="run", ttl=DEFAULT_TTL,
                                     through_item=active[end - 1].id,
                                     through_input_item=_latest_input(everything,
                                                                      len(everything) - 1)))
    return marks


def select(marks: Sequence[CacheBreakpoint], budget: int) -> tuple[CacheBreakpoint, ...]:
    """Keep at most ``budget`` markers by priority; the kept ones stay in request order."""
    ranked = sorted(marks, key=lambda m: PRIORITY.index(m.name))[:max(budget, 0)]
    kept = {m.name for m in ranked}
    return tuple(m for m in marks if m.name in kept)
