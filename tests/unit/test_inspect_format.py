"""How ``context-engine inspect`` lays out a session: aligned tables, compact event summaries."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from context_engine.adapters.postgres.inspect import (
    SessionRecord,
    StoredEpoch,
    StoredEvent,
)
from context_engine.domain.plan import ClassUsage
from context_engine.inspect import (
    document,
    format_table,
    format_time,
    render_epoch,
    render_overview,
    summarize,
)

T0 = datetime(2026, 11, 29, 10, 4, 5, 123456, tzinfo=UTC)
H1, H2 = "a" * 64, "0123456789ab" + "c" * 52


def epoch(n: int, sha: str, *, classes: dict[str, int], tools=("web.fetch",), deferred=(),
          skipped=(), reason="session_opened") -> StoredEpoch:
    return StoredEpoch(
        epoch=n, reason=reason, created_at=T0 + timedelta(minutes=n), prefix_sha256=sha,
        prefix_tokens=sum(classes.values()),
        classes=tuple(ClassUsage(class_name=k, tokens=v, cap=2_000, items=1, item_cap=30)
                      for k, v in classes.items()),
        model_id="claude-sonnet-4-5", tokenizer="cl100k_base", tool_names=tuple(tools),
        deferred_tool_names=tuple(deferred), skipped_tool_names=tuple(skipped),
        authority_scope_hashes=("f" * 64,), builder_version="builder@1",
        policy_version="policy@1", cache_ttl="5m")


def record(events: tuple[StoredEvent, ...] = ()) -> SessionRecord:
    return SessionRecord(
        tenant_id="acme", session_id="s-1", current_epoch=2, created_at=T0, updated_at=T0,
        epochs=(epoch(1, H1, classes={"platform_policy": 546, "tool_definitions": 232},
                      deferred=("mail.send",), skipped=("big.tool", "huge.tool")),
                epoch(2, H2, classes={"platform_policy": 546, "memory_snapshot": 7},
                      reason="security_revocation")),
        events=events, events_total=len(events) + 5)


def test_columns_are_aligned_numbers_right_text_left():
    lines = format_table(["ID", "NAME", "TOKENS"], [[7, "alpha", 5], [1234, "b", 123456]])
    assert lines == ["  ID  NAME   TOKENS",
                     "   7  alpha       5",
                     "1234  b      123456"]


def test_no_trailing_space_and_placeholders_stay_text():
    lines = format_table(["EPOCH", "SKIPPED", "NOTE"], [[1, "-", ""], [2, "x.y", "-"]])
    assert all(line == line.rstrip() for line in lines)
    assert lines[1] == "    1  -"  # a dash-only column of names is not numeric
    assert lines[2] == "    2  x.y      -"


def test_an_empty_table_is_its_header_and_a_ragged_row_is_refused():
    assert format_table(["A", "BB"], []) == ["A  BB"]
    with pytest.raises(ValueError):
        format_table(["A", "B"], [[1]])


def test_control_characters_cannot_break_a_row():
    lines = format_table(["ID", "NAME"], [[1, "two\nlines\x1b[31m"]])
    assert len(lines) == 2 and "\n" not in lines[1] and "\x1b" not in lines[1]
    assert lines[1].endswith("two?lines?[31m")


def test_times_are_utc_to_the_millisecond():
    assert format_time(T0) == "2026-11-29 10:04:05.123Z"
    assert format_time(T0.astimezone(timezone(timedelta(hours=-5)))) == format_time(T0)


def test_summary_is_compact_and_leads_with_what_matters():
    payload = {"epoch": 2, "prefix_tokens": 669, "reason": "security_revocation",
               "prefix_sha256": H2, "model_id": "acme-16k", "tool_names": ["a", "b", "c"],
               "deferred_tool_names": [], "skipped_tool_names": ["big.tool"],
               "tokenizer": "cl100k_base", "builder_version": "b@1", "policy_version": "p@1"}
    assert summarize(payload) == (
        "reason=security_revocation prefix_sha256=0123456789ab... prefix_tokens=669 "
        "model_id=acme-16k skipped_tool_names[1] tool_names[3]")


def test_pressure_summary_shows_steps_and_the_token_change_not_ids():
    payload = {"epoch": 1, "fits": False, "tokens_before": 166_009, "tokens_after": 10_301,
               "steps": [{"step": "knowledge", "units": 3, "item_ids": ["k0", "k1", "k2"]},
                         {"step": "history", "units": 88, "item_ids": ["u0", "c0"]}],
               "left_out_items": 88, "compaction_needed": True, "ratio": 0.123456,
               "extra": {"x": 1}, "missing": None}
    text = summarize(payload)
    assert text == ("fits=false steps=knowledge(3),history(88) tokens=166009->10301 "
                    "compaction_needed=true extra{1} left_out_items=88 ratio=0.1235")
    assert "k0" not in text and "u0" not in text


def test_long_strings_and_summaries_are_cut():
    assert summarize({"run_id": "r" * 100}) == "run_id=" + "r" * 37 + "..."
    long = summarize({f"field_{i:03d}": i for i in range(100)})
    assert len(long) == 240 and long.endswith("...")


def test_overview_has_epochs_classes_tools_and_events():
    events = (StoredEvent(id=41, epoch=2, type="context.epoch.rotated",
                          payload={"epoch": 2, "reason": "security_revocation"},
                          created_at=T0),
              StoredEvent(id=42, epoch=None, type="context.custom", payload={"n": 1},
                          created_at=T0))
    lines = render_overview(record(events)).splitlines()
    assert lines[:2] == [
        "session s-1  tenant acme",
        "current epoch 2  created 2026-11-29 10:04:05.123Z  updated 2026-11-29 10:04:05.123Z"]
    at = lines.index("EPOCHS (2)")
    assert lines[at + 1].split() == ["EPOCH", "REASON", "CREATED", "(UTC)", "PREFIX_SHA256",
                                     "TOKENS", "MODEL", "TOKENIZER"]
    assert lines[at + 2].split() == ["1", "session_opened", "2026-11-29", "10:05:05.123Z", H1,
                                     "778", "claude-sonnet-4-5", "cl100k_base"]
    assert lines[at + 3].split()[:5] == ["2", "security_revocation", "2026-11-29",
                                         "10:06:05.123Z", H2]
    at = lines.index("PREFIX TOKENS BY CLASS")
    assert lines[at + 1].split() == ["EPOCH", "platform_policy", "tool_definitions",
                                     "memory_snapshot"]
    assert lines[at + 2].split() == ["1", "546", "232", "-"]
    assert lines[at + 3].split() == ["2", "546", "-", "7"]
    at = lines.index("TOOLS")
    assert lines[at + 2].split() == ["1", "web.fetch", "mail.send", "big.tool,", "huge.tool"]
    assert lines[at + 3].split() == ["2", "web.fetch", "-", "-"]
    at = lines.index("EVENTS (last 2 of 7)")
    assert lines[at + 1].split() == ["ID", "CREATED", "(UTC)", "EPOCH", "TYPE", "SUMMARY"]
    assert lines[at + 2].split()[3:] == ["2", "context.epoch.rotated",
                                         "reason=security_revocation"]
    assert lines[at + 3].split()[3:] == ["-", "context.custom", "n=1"]
    assert lines[at + 1].index("TYPE") == lines[at + 2].index("context.")


def test_no_events_says_so():
    text = render_overview(record())
    assert text.endswith("EVENTS (last 0 of 5)\n(none)\n")


def test_one_epoch_in_detail():
    rec = record()
    text = render_epoch(rec, rec.epochs[0])
    lines = text.splitlines()
    assert "EPOCH 1" in lines and "(current)" not in text
    assert f"prefix_sha256    {H1}" in lines
    assert "skipped tools    big.tool, huge.tool" in lines
    assert "scope hashes     1" in lines
    at = lines.index("PREFIX CLASSES")
    assert lines[at + 1].split() == ["CLASS", "TOKENS", "CAP", "ITEMS", "ITEM_CAP"]
    assert lines[at + 2].split() == ["platform_policy", "546", "2000", "1", "30"]
    assert "EPOCH 2  (current)" in render_epoch(rec, rec.epochs[1])


def test_the_document_round_trips_through_json():
    events = (StoredEvent(id=3, epoch=1, type="context.budget.pressure",
                          payload={"fits": True, "steps": []}, created_at=T0),)
    doc = json.loads(json.dumps(document(record(events), epoch=None)))
    assert [e["prefix_sha256"] for e in doc["epochs"]] == [H1, H2]
    assert doc["epochs"][0]["skipped_tool_names"] == ["big.tool", "huge.tool"]
    assert doc["epochs"][0]["classes"][1] == {"class_name": "tool_definitions", "tokens": 232,
                                              "cap": 2_000, "items": 1, "item_cap": 30}
    assert doc["events"] == [{"id": 3, "epoch": 1, "type": "context.budget.pressure",
                              "created_at": "2026-11-29T10:04:05.123456+00:00",
                              "summary": "fits=true", "payload": {"fits": True, "steps": []}}]
    assert doc["events_total"] == 6 and doc["epoch_filter"] is None
