"""Every cache ``build()`` keeps in the memo across Builds (renderings, the identity map, the
units of the carried history, item costs and normalized results) changes no result: a session
edited turn by turn as runtimes edit theirs is built on one memo, Build after Build, and each
result equals ``build()`` of the same checkpoint with no memo at all (or fails alike).

The edits are drawn by hypothesis: tool exchanges with results large and small (some over the
inline maximum, some with a persisted excerpt), plain and reasoning messages, a new run begun by
a user message (which drops the last run's reasoning from what is sent), a user message with an
attachment (some large enough to spend the request's attachment budget), an earlier result
rewritten in place, an item removed, a summary that replaces the oldest items, the correction
factor and the inline maximum moving; now and then two sessions share the memo."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from context_engine.domain.budget import BudgetPolicy
from context_engine.domain.builder import LoadedPlan, build
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    ReasoningItem,
    ToolResultItem,
)
from context_engine.domain.request import Attachment, AttachmentKind
from context_engine.domain.trust import TrustLevel
from context_engine.engine import BoundedMemo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import factories as f

POLICIES = (BudgetPolicy(inline_maximum_bytes=6_000), BudgetPolicy(inline_maximum_bytes=3_000))
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EDITS = ("exchange", "exchange", "big_exchange", "big_exchange", "excerpted_exchange", "assistant",
         "reasoning", "new_run", "attachment", "rewrite", "remove", "summary", "factor",
         "inline_maximum", "big_attachment")
_PLANS: dict[str, LoadedPlan] = {}


def plan(session: str) -> LoadedPlan:
    if session not in _PLANS:  # a small window: the ladder and the cut run
        _PLANS[session] = f.loaded(f.inputs(
            session_id=session,
            model_profile=f.model("gpt-4o", context_window=16_000, output_reserve=4_096)))
    return _PLANS[session]


def words(n: int, seed: int) -> str:
    vocabulary = ("alpha", "beta", "{\"k\": 1}", "<td>", "42", "omega", "line\nbreak", "ok")
    return " ".join(vocabulary[(seed + 3 * i) % len(vocabulary)] for i in range(n))


def outcome(lp: LoadedPlan, cp: Any, factor: float, policy: BudgetPolicy,
            memo: BoundedMemo | None) -> Any:
    try:
        return build(lp, cp, estimator=f.estimator(lp.plan.spec.model), factor=factor,
                     policy=policy, memo=memo)
    except Exception as exc:  # a failure must be the same failure
        return (type(exc).__name__, str(exc))


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(EDITS), st.integers(0, 10_000)), min_size=4,
                max_size=40),
       st.booleans())
def test_builds_on_one_memo_across_edits_are_the_builds_without_it(
        edits: list[tuple[str, int]], two_sessions: bool) -> None:
    memo = BoundedMemo(64 << 20)
    sessions = [plan("memo-a"), plan("memo-b")] if two_sessions else [plan("memo-a")]
    numbers = itertools.count(1)
    run = 1
    sequence = 0
    factor = 1.0
    policy = POLICIES[0]
    summary: HistorySummary | None = None
    items: list[ConversationItem] = [f.user("u0", "start", 0, run="run-1")]

    def nseq() -> int:
        nonlocal sequence
        sequence += 1
        return sequence

    for kind, n in edits:
        k = next(numbers)
        here = f"run-{run}"
        if kind in ("exchange", "big_exchange", "excerpted_exchange"):
            size = {"exchange": 20 + n % 200, "big_exchange": 1_500 + n % 3_000,
                    "excerpted_exchange": 2_000 + n % 2_000}[kind]
            items.append(f.call(f"c{k}", nseq(), f"call{k}", run=here))
            result = f.result(f"r{k}", nseq(), f"call{k}", words(size, n), run=here)
            if kind == "excerpted_exchange":  # a persisted excerpt beside the canonical content
                result = replace(result, context_content=words(40, n + 1))
            items.append(result)
        elif kind == "assistant":
            items.append(AssistantMessageItem(id=f"a{k}", sequence=nseq(), run_id=here,
                                              item_trust=TrustLevel.USER,
                                              text=words(5 + n % 900, n)))
        elif kind == "reasoning":
            items.append(ReasoningItem(id=f"z{k}", sequence=nseq(), run_id=here,
                                       item_trust=TrustLevel.USER, provider="anthropic",
                                       opaque=bytes(n % 90)))
        elif kind == "new_run":
            run += 1
            items.append(f.user(f"u{k}", words(3 + n % 20, n), nseq(), run=f"run-{run}"))
        elif kind in ("attachment", "big_attachment"):
            # big ones spend the request's attachment budget: older owners' shares shrink
            run += 1
            pages = 1 + n % 3 if kind == "attachment" else 20 + n % 20
            items.append(replace(
                f.user(f"u{k}", "see the file", nseq(), run=f"run-{run}"),
                attachments=(Attachment(kind=AttachmentKind.PDF, name=f"f{k}.pdf",
                                        ref=f"files/{k}", pages=pages),)))
        elif kind == "rewrite":  # an earlier result, same id, other content
            results = [i for i, it in enumerate(items) if isinstance(it, ToolResultItem)]
            if results:
                at = results[n % len(results)]
                items[at] = replace(items[at], content=words(10 + n % 300, n + 7))
        elif kind == "remove":  # an assistant message taken out (a correction)
            plain = [i for i, it in enumerate(items) if isinstance(it, AssistantMessageItem)]
            if plain:
                del items[plain[n % len(plain)]]
        elif kind == "summary":  # replaces some of what came before the active run
            earlier = [it for it in items if it.run_id != here]
            if earlier:
                through = earlier[n % len(earlier)].sequence
                summary = HistorySummary(text=words(20, n), replaced_through_sequence=through)
        elif kind == "factor":
            factor = (1.0, 1.6, 0.7)[n % 3]
        elif kind == "inline_maximum":  # a deployment's limit changed between two Builds
            policy = POLICIES[n % 2]
        cp = f.checkpoint(items, run=f"run-{run}", summary=summary)
        for lp in sessions:
            want = outcome(lp, cp, factor, policy, None)
            assert outcome(lp, cp, factor, policy, memo) == want, (kind, len(items))


def test_an_older_attachment_costs_what_is_left_of_the_budget_when_a_newer_one_comes() -> None:
    """Attachments spend one request-wide budget newest first: a second large file shrinks the
    first one's share, so the first owner's cost changes with no change to the owner itself
    (its left-out tokens say so)."""
    memo = BoundedMemo(64 << 20)
    lp = plan("memo-attach")

    def pdf(item_id: str, seq: int, run: str) -> ConversationItem:
        return replace(f.user(item_id, "see the file", seq, run=run), attachments=(
            Attachment(kind=AttachmentKind.PDF, name=f"{item_id}.pdf", ref=f"files/{item_id}",
                       pages=8),))

    def answer(item_id: str, seq: int, run: str) -> ConversationItem:
        return AssistantMessageItem(id=item_id, sequence=seq, run_id=run,
                                    item_trust=TrustLevel.USER, text="read it")

    items: list[ConversationItem] = [pdf("u1", 1, "run-1"), answer("a1", 2, "run-1"),
                                     f.user("u2", "next", 3, "run-2")]
    shares = []
    for more in ([], [answer("a2", 4, "run-2"), pdf("u3", 5, "run-3"), answer("a3", 6, "run-3"),
                      f.user("u4", "and next", 7, "run-4")]):
        items += more
        cp = f.checkpoint(items, run=items[-1].run_id)
        want = outcome(lp, cp, 1.0, POLICIES[0], None)
        assert outcome(lp, cp, 1.0, POLICIES[0], memo) == want
        shares.append(want.pressure.left_out_tokens)
    assert shares[1] > shares[0]  # both files left out, the first at a smaller share


def test_the_newest_attachment_is_counted_whole_and_an_older_one_at_what_is_left() -> None:
    """``attachment_costs``: the request-wide budget (100,000 tokens) goes to the newest
    attachment first; an 8-page PDF is 54,960 tokens (6,870 a page), so of two the newer
    costs 54,960 and the older the 45,040 left; a user message without one, or another item,
    costs nothing here (at an image figure of 3,870)."""
    from context_engine.domain.builder import attachment_costs

    def pdf(item_id: str, seq: int) -> ConversationItem:
        return replace(f.user(item_id, "see the file", seq, run="run-1"), attachments=(
            Attachment(kind=AttachmentKind.PDF, name=f"{item_id}.pdf", ref=f"files/{item_id}",
                       pages=8),))

    items = [pdf("u1", 1), f.user("u2", "no file", 2, run="run-1"), f.call("c3", 3, "k3"),
             f.result("r3", 4, "k3", "out"), pdf("u5", 5)]
    assert attachment_costs(items, image_tokens=3_870) == {"u5": 54_960, "u1": 45_040}
    assert attachment_costs(items[:2], image_tokens=3_870) == {"u1": 54_960}
    assert attachment_costs(items[1:4], image_tokens=3_870) == {}


def test_items_given_as_a_list_then_as_a_tuple_and_a_list_changed_in_place() -> None:
    """A direct caller may hand ``build()`` its items as a list, keep that list and append to
    it, or switch to a tuple: what the memo keeps is its own copy, and each Build is the
    memo-less one."""
    memo = BoundedMemo(64 << 20)
    lp = plan("memo-lists")
    items: list[ConversationItem] = [f.user("u0", "start", 0, run="run-1")]
    for k in range(1, 8):
        items += [f.call(f"c{k}", 2 * k - 1, f"call{k}"),
                  f.result(f"r{k}", 2 * k, f"call{k}", words(300 * k, k))]
        for sent in (tuple(items), items):  # the list last: the next turn appends to it
            cp = replace(f.checkpoint([]), items=sent)
            want = outcome(lp, cp, 1.0, POLICIES[1], None)
            assert not isinstance(want, tuple), want
            assert outcome(lp, cp, 1.0, POLICIES[1], memo) == want, (k, type(sent))


def test_shared_prefix_counts_the_leading_equal_items() -> None:
    from context_engine.domain.builder import shared_prefix

    a, b, c = (f.user(f"u{k}", "x", k) for k in range(3))
    assert shared_prefix((), ()) == 0
    assert shared_prefix((a, b), (a, b, c)) == 2 == shared_prefix((a, b, c), (a, b))
    assert shared_prefix((a, b, c), (a, c, b)) == 1
    assert shared_prefix((b,), (a,)) == 0
    assert shared_prefix([a, b], (a, b, c)) == 2  # a list: by item
    # an equal copy is the same item, before and after the first object that is not the same
    assert shared_prefix((a, b, c), (a, replace(b), replace(c), a)) == 3
    assert shared_prefix((a, b, c), (replace(a), b, a)) == 2
