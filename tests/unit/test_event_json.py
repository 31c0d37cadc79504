"""An event payload's JSON text (``store.event_json``, orjson) against the standard library's
canonical text: byte for byte over payloads of the kinds events carry, and the same value read
back where a float's spelling may differ."""

from __future__ import annotations

import json
import math
from typing import Any

from context_engine.adapters.postgres.store import event_json
from hypothesis import given, settings
from hypothesis import strategies as st

KEYS = st.text(max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1),
                    st.text(max_size=40))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(KEYS, inner, max_size=6)), max_leaves=40)
PAYLOADS = st.dictionaries(KEYS, VALUES, max_size=8)


def stdlib(value: Any) -> str:
    """The standard library's canonical text (sorted keys, no whitespace, UTF-8 kept)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(PAYLOADS)
def test_the_text_is_the_standard_librarys(payload: dict[str, Any]) -> None:
    assert event_json(payload) == stdlib(payload)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(KEYS, st.lists(st.floats(allow_nan=False, allow_infinity=False),
                                      max_size=5), max_size=4))
def test_floats_read_back_the_same(payload: dict[str, Any]) -> None:
    assert json.loads(event_json(payload)) == json.loads(stdlib(payload))


def test_a_pressure_payload_of_thousands_of_ids() -> None:
    ids = [f"item-{i}" for i in range(3000)] + ['quote " back \\ line\n', "\u00e9\u2028\x7f"]
    payload = {"epoch": 3, "fits": True, "steps": [{"step": "history", "item_ids": ids,
                                                    "tokens_before": 10, "tokens_after": 5}],
               "estimator_factor": 1.15}
    assert event_json(payload) == stdlib(payload)
    assert json.loads(event_json(payload))["steps"][0]["item_ids"] == ids
    assert not math.isnan(json.loads(event_json(payload))["estimator_factor"])


def test_what_it_does_not_write_as_the_standard_library_does() -> None:
    """The differences its docstring names: a float's spelling (the same value), a non-finite
    float (null where the standard library refuses it), an integer past 64 bits and a key that
    is not a string (refused)."""
    assert event_json({"f": 1e-07}) == '{"f":1e-7}' != stdlib({"f": 1e-07})
    assert json.loads(event_json({"f": 1e-07})) == {"f": 1e-07}
    assert event_json({"f": float("nan")}) == '{"f":null}'
    for bad in ({"i": 2 ** 64}, {1: "key"}):
        try:
            event_json(bad)
        except TypeError:
            continue
        raise AssertionError(f"{bad} was written")

