"""What a pressure event records of a yield step's ids (``engine.step_record``): the ids
themselves up to 64, else their count, ends and digest, checked against an oracle written
here with the standard library."""

from __future__ import annotations

import hashlib
import json

import pytest
from context_engine.domain.budget import Pressure, YieldStep
from context_engine.engine import pressure_payload
from hypothesis import given, settings
from hypothesis import strategies as st


def step(ids: list[str]) -> YieldStep:
    return YieldStep(step="history", units=len(ids), ids=tuple(ids), tokens_before=900,
                     tokens_after=100)


def digest(ids: list[str]) -> str:
    text = json.dumps(ids, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def recorded(ids: list[str]) -> dict[str, object]:
    p = Pressure(steps=(step(ids),), fits=True, tokens_before=900, tokens_after=100,
                 body_budget=500, compaction_needed=True, left_out_items=len(ids),
                 left_out_tokens=800, cut_index=len(ids), floor_index=0,
                 legacy_tool_excerpts=0)
    out = pressure_payload(p, 3)["steps"]
    assert isinstance(out, list) and len(out) == 1
    return dict(out[0])


@pytest.mark.parametrize("n", [0, 1, 63, 64])
def test_up_to_64_ids_are_listed(n: int) -> None:
    ids = [f"i{k}" for k in range(n)]
    assert recorded(ids) == {"step": "history", "units": n, "item_count": n, "item_ids": ids,
                             "tokens_before": 900, "tokens_after": 100}


@pytest.mark.parametrize("n", [65, 3_000])
def test_more_are_counted_bounded_and_digested(n: int) -> None:
    ids = [f"i{k}" for k in range(n)]
    assert recorded(ids) == {"step": "history", "units": n, "item_count": n,
                             "first_item_id": "i0", "last_item_id": f"i{n - 1}",
                             "item_ids_sha256": digest(ids), "tokens_before": 900,
                             "tokens_after": 100}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=65, max_size=120, unique=True))
def test_the_digest_is_of_every_id_in_order(ids: list[str]) -> None:
    """Any id text (quotes, escapes, non-ASCII): the digest is of the canonical array, and
    another order or one id fewer digests otherwise."""
    record = recorded(ids)
    assert record["item_ids_sha256"] == digest(ids)
    assert record["item_ids_sha256"] != digest(ids[1:]) != digest(ids[::-1])
