"""A checkpoint's summary as the runtime sends it back (``mapping.history_summary``): what
Compact writes is taken as it is, and a pointer's provenance is checked before row 9 prints
it as the platform's own words."""

from __future__ import annotations

from context_engine.api import mapping as M
from context_engine.domain.items import RenderContext
from context_engine.v1 import context_engine_pb2 as pb

CTX = RenderContext(session_key="sk")


def summary(**kw: object) -> pb.Summary:
    fields: dict[str, object] = {"text": "narr", "replaced_through_sequence": 3, "depth": 1,
                                 "source_event_ids": [1, 2, 3]}
    fields.update(kw)
    return pb.Summary(**fields)  # type: ignore[arg-type]


def span(**kw: object) -> pb.ElidedSpan:
    fields: dict[str, object] = {"item_id": "r1", "byte_length": 10, "event_id": 2,
                                 "trust_level": pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
                                 "kind": "tool.result"}
    fields.update(kw)
    return pb.ElidedSpan(**fields)  # type: ignore[arg-type]


def read(s: pb.Summary) -> tuple[list[tuple[str, str]], str]:
    v = M.Violations()
    hs = M.history_summary(v, "checkpoint.summary", s)
    if v.items:
        return [(x.field, x.description) for x in v.items], ""
    assert hs is not None
    return [], hs.messages(CTX)[0].text


def test_attachment_pointers_compact_wrote_are_taken_back() -> None:
    """Compact points to each attachment of a replaced message (attachment.pdf, .text,
    .image): the summary holding them must be accepted when the runtime sends it back."""
    violations, text = read(summary(elided=[
        span(item_id="u1", kind="attachment.pdf", byte_length=12, artifact_ref="artifact:a/77",
             event_id=1, trust_level=pb.TRUST_LEVEL_USER),
        span(item_id="m1", kind="attachment.text", byte_length=90_000,
             artifact_ref="artifact:a/78"),
        span(item_id="u1", kind="attachment.image", byte_length=0, artifact_ref="a/79",
             event_id=1, trust_level=pb.TRUST_LEVEL_USER)]))
    assert violations == []
    assert "[elided] attachment.pdf u1 (user, 12 pages) -> artifact:a/77 (event:1)" in text
    assert ("[elided] attachment.text m1 (external_untrusted, 90,000 characters) -> "
            "artifact:a/78 (event:2)") in text
    assert "[elided] attachment.image u1 (user, image) -> a/79 (event:1)" in text


def test_an_unknown_pointer_kind_is_refused() -> None:
    violations, _ = read(summary(elided=[span(kind="attachment.zip")]))
    assert [f for f, _ in violations] == ["checkpoint.summary.elided[0].kind"]


def test_negative_event_ids_are_refused_at_their_own_fields() -> None:
    """A summary's "Source event ids: -7, 0" and "-> event:-5" printed as platform
    text. A negative id is refused where it stands; 0 is a valid sequence (and a pointer's
    event 0 is none: the pointer names its item)."""
    violations, _ = read(summary(source_event_ids=[-7, 0, 4], elided=[span(event_id=-5),
                                                                      span(event_id=0)]))
    assert violations == [
        ("checkpoint.summary.source_event_ids[0]", "-7 is not an event id"),
        ("checkpoint.summary.elided[0].event_id", "must not be negative")]
    violations, text = read(summary(source_event_ids=[0, 4], elided=[span(event_id=0)]))
    assert violations == [] and "Source event ids: 0, 4" in text
    assert "[elided] tool.result r1 (external_untrusted, 10 bytes) -> item:r1" in text
