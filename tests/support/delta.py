"""An independent reading of ResponseDelta (it shares no code with the service or the clients):
the full BuildResponse from a delta response and the base's full response, exactly as the
contract's comments define it."""

from __future__ import annotations

from typing import Any


def _spans(spans: Any, base: list[Any], sent: list[Any]) -> list[Any]:
    out: list[Any] = []
    taken = 0
    for span in spans:
        out.extend(base[span.base_start:span.base_start + span.base_count])
        out.extend(sent[taken:taken + span.new_count])
        taken += span.new_count
    assert taken == len(sent), f"spans consumed {taken} of {len(sent)} sent entries"
    return out


def _text(spans: Any, base: str, sent: str) -> str:
    if not spans:
        return sent
    data = _spans(spans, list(base.encode("utf-8")), list(sent.encode("utf-8")))
    return bytes(data).decode("utf-8")


def reconstruct(response: Any, base: Any) -> Any:
    """The full response (delta cleared) of ``response`` relative to ``base`` (a full
    response). Messages of the same generated module as ``response``."""
    if not response.HasField("delta"):
        return response
    d = response.delta
    full = type(response)()
    full.CopyFrom(response)
    full.ClearField("delta")
    if d.prefix_from_base:
        full.request.prefix_blocks.extend(base.request.prefix_blocks)
        full.request.tools.extend(base.request.tools)
    if d.message_spans:
        messages = _spans(d.message_spans, list(base.request.messages),
                          list(response.request.messages))
        del full.request.messages[:]
        full.request.messages.extend(messages)
    full.provider_body_json = _text(d.provider_body_spans, base.provider_body_json,
                                    response.provider_body_json)
    if d.gemini_create_body_spans or d.gemini_cached_body_spans:
        g, bg, sg = (full.gemini_cached_content, base.gemini_cached_content,
                     response.gemini_cached_content)
        g.create_body_json = _text(d.gemini_create_body_spans, bg.create_body_json,
                                   sg.create_body_json)
        g.cached_body_json = _text(d.gemini_cached_body_spans, bg.cached_body_json,
                                   sg.cached_body_json)
    assert len(full.provider_body_json.encode("utf-8")) == d.provider_body_bytes
    assert full.ByteSize() == d.full_response_bytes, (full.ByteSize(), d.full_response_bytes)
    return full
