"""A class exactly at its cap keeps everything (spec: "The budget allocator": knowledge 3
passages / 3,000 tokens, recall 2,000 tokens; a cap is what a class may use, so using all of
it is within it). The allocator runs on a cost function written here, 1,000 tokens a
passage or a recall line, so each block's cost is known by hand and sits at the cap exactly;
the body has room to spare, so no ladder step is involved."""

from __future__ import annotations

from typing import Any

from context_engine.domain.budget import (
    KNOWLEDGE_TOKENS,
    RECALL_TOKENS,
    Budget,
    BudgetPolicy,
    allocate,
)
from context_engine.domain.items import KnowledgeItem, KnowledgePassage, MemoryLine, RecallItem
from context_engine.domain.trust import TrustLevel


def _cost(item: Any) -> int:
    if isinstance(item, KnowledgeItem):
        return 1_000 * len(item.passages)
    if isinstance(item, RecallItem):
        return 1_000 * len(item.lines)
    return 0


def _allocated(knowledge: list[KnowledgePassage], recall: list[MemoryLine]) -> tuple[
        list[str], list[str], list[str]]:
    a = allocate(budget=Budget(total_tokens=100_000, output_reserve=0, margin_tokens=0,
                               body_budget=50_000),
                 prefix_tokens=0, factor=1.0, policy=BudgetPolicy(), summary=None, carried=[],
                 floor=0, active=[], fixed={"current_user_message": 0}, knowledge=knowledge,
                 recall=recall, cost=_cost, legacy_tool_excerpts=0, position=lambda i: i)
    yielded = [i for s in a.pressure.steps for i in s.ids]
    return [p.id for p in a.knowledge], [ln.id for ln in a.recall], yielded


def _passage(k: int) -> KnowledgePassage:
    return KnowledgePassage(id=f"k{k}", source="docs", text=f"Passage {k}.", rank=k,
                            trust=TrustLevel.MEMORY)


def test_knowledge_at_exactly_its_token_cap_is_kept_whole() -> None:
    assert KNOWLEDGE_TOKENS == 3_000  # three passages of 1,000: the cap exactly
    assert _allocated([_passage(1), _passage(2), _passage(3)], []) == (
        ["k1", "k2", "k3"], [], [])


def test_recall_at_exactly_its_token_cap_is_kept_whole() -> None:
    assert RECALL_TOKENS == 2_000  # two lines of 1,000: the cap exactly
    lines = [MemoryLine(id="m1", text="Likes tea."), MemoryLine(id="m2", text="Uses vim.")]
    assert _allocated([], lines) == ([], ["m1", "m2"], [])


def test_one_token_over_a_cap_yields() -> None:
    # the boundary from the other side: a fourth passage (over the item cap) and a third
    # recall line (3,000 > 2,000) yield, the lowest-ranked passage and the last line
    lines = [MemoryLine(id=f"m{k}", text="x") for k in (1, 2, 3)]
    assert _allocated([_passage(k) for k in (1, 2, 3, 4)], lines) == (
        ["k1", "k2", "k3"], ["m1", "m2"], ["k4", "m3"])
