"""Where the history markers land (spec: "The history cache window"): each expectation is
written out by hand from the spec's rules, item by item, never computed by the builder's own
code. The run marker stops before the active run's last stretch of reasoning (the runtime
replays only the latest turn's reasoning, so the next step no longer carries it), and each
marker names as ``through_input_item`` the latest user or tool-result item at or before the
item it marks, in the carried history as well as the run."""

from __future__ import annotations

from context_engine.domain.builder import BuildResult
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    ReasoningItem,
)
from context_engine.domain.trust import TrustLevel

from tests import factories as f


def _assistant(item_id: str, seq: int, run: str = "run-1") -> AssistantMessageItem:
    return AssistantMessageItem(id=item_id, sequence=seq, run_id=run,
                                item_trust=TrustLevel.TRUSTED_CONFIGURATION, text="Noted.")


def _thought(item_id: str, seq: int) -> ReasoningItem:
    return ReasoningItem(id=item_id, sequence=seq, run_id="run-1",
                         item_trust=TrustLevel.TRUSTED_CONFIGURATION, provider="anthropic",
                         opaque=b'{"type":"thinking","thinking":"hm","signature":"s"}')


def _marks(items: list[ConversationItem]) -> list[tuple[str, str, str]]:
    r: BuildResult = f.run_build(f.loaded(f.inputs(model_profile=f.model(
        "claude-sonnet-4-5", breakpoint_budget=4))), f.checkpoint(items))
    return [(b.name, b.through_item, b.through_input_item) for b in r.cache_breakpoints
            if b.name in ("carried_history", "run")]


def test_the_run_marker_stops_before_the_last_stretch_of_reasoning_not_the_first() -> None:
    # the run: u1, a first turn's reasoning (th1) and call, then the latest turn's two
    # reasoning items (th2, th3) before its call: the next step replays th2 and th3 only,
    # so the run's repeated prefix ends at r1, after th1 and before th2
    items = [f.user("u0", "Earlier.", 1, run="run-0"),
             _assistant("a0", 2, run="run-0"),
             f.user("u1", "Fetch two pages.", 3),
             _thought("th1", 4), f.call("c1", 5, "k1"), f.result("r1", 6, "k1", "One."),
             _thought("th2", 7), _thought("th3", 8),
             f.call("c2", 9, "k2"), f.result("r2", 10, "k2", "Two.")]
    assert _marks(items) == [("carried_history", "a0", "u0"), ("run", "r1", "r1")]


def test_a_carried_history_ending_on_a_result_names_that_result_as_its_input() -> None:
    # the carried marker is through r0, and r0 itself is the latest input at or before it
    items = [f.user("u0", "Check.", 1, run="run-0"), f.call("c0", 2, "k0", run="run-0"),
             f.result("r0", 3, "k0", "Sunny.", run="run-0"),
             f.user("u1", "And now?", 4), f.call("c1", 5, "k1"),
             f.result("r1", 6, "k1", "Rain.")]
    assert _marks(items) == [("carried_history", "r0", "r0"), ("run", "r1", "r1")]


def test_a_run_marker_before_any_input_of_the_run_names_the_carried_input() -> None:
    # a run the agent began itself (a1, no user message of its own): its marker is through
    # a1, before the latest reasoning; the latest input at or before a1 is the carried u0
    items = [f.user("u0", "Remind me later.", 1, run="run-0"),
             _assistant("a0", 2, run="run-0"),
             _assistant("a1", 3), _thought("th1", 4), f.call("c1", 5, "k1"),
             f.result("r1", 6, "k1", "Reminder due.")]
    assert _marks(items) == [("carried_history", "a0", "u0"), ("run", "a1", "u0")]
