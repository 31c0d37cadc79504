"""Tool-result normalization before selection (spec ADR-0137, "What history selection
retains"): a persisted ``context_content`` excerpt replaces canonical content; a legacy result
over the inline maximum gets a deterministic head/tail excerpt that references its source.
Trust, ids and the first artifact reference are kept; the checkpoint itself is never changed
(items are frozen: new values are returned)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from context_engine.domain.items import ConversationItem, ToolResultItem

DEFAULT_INLINE_MAXIMUM_BYTES = 16_384


def utf8_length(text: str) -> int:
    """``len(text.encode("utf-8"))``; ASCII text (one byte a character) is not encoded."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _head(data: bytes, n: int) -> str:
    return data[:n].decode("utf-8", errors="ignore")


def _tail(data: bytes, n: int) -> str:
    return data[len(data) - n:].decode("utf-8", errors="ignore") if n > 0 else ""


def head_tail_excerpt(item: ToolResultItem, inline_maximum_bytes: int) -> str:
    """The first two thirds and the last third of the allowance, cut on character
    boundaries, with a marker naming what was omitted and where the whole result lives."""
    data = item.content.encode("utf-8")
    head_n = (inline_maximum_bytes * 2) // 3
    tail_n = inline_maximum_bytes - head_n
    head, tail = _head(data, head_n), _tail(data, tail_n)
    omitted = len(data) - len(head.encode("utf-8")) - len(tail.encode("utf-8"))
    where = f"event:{item.event_id}" if item.event_id else f"item:{item.id}"
    if item.artifact_ref:
        where += f", {item.artifact_ref}"
    # cutting a persisted excerpt: the whole result's size is another than what was cut
    whole = f" ({item.bytes:,} bytes)" if item.bytes != len(data) else ""
    return (f"{head}\n[... excerpt: {omitted:,} of {len(data):,} bytes omitted; "
            f"full result{whole}: {where} ...]\n{tail}")


def normalize_tool_result(item: ConversationItem, inline_maximum_bytes: int
                          ) -> tuple[ConversationItem, bool]:
    """The item to assemble, and whether it was excerpted here (head/tail). A persisted
    ``context_content`` excerpt replaces the content; content that still exceeds the inline
    maximum (a legacy result, or an excerpt persisted under a larger limit) gets the head/tail
    excerpt, which names the original event."""
    if isinstance(item, ToolResultItem) and not item.elided:
        selected = item
        if item.context_content:
            selected = replace(item, content=item.context_content, context_content="",
                               byte_length=item.bytes)
        if utf8_length(selected.content) > inline_maximum_bytes:
            return replace(selected, content=head_tail_excerpt(selected, inline_maximum_bytes),
                           byte_length=item.bytes), True
        return selected, False
    return item, False


def normalize_tool_results(items: Sequence[ConversationItem], inline_maximum_bytes: int
                           ) -> tuple[tuple[ConversationItem, ...], int]:
    """Returns the items to assemble and how many legacy results were excerpted."""
    out: list[ConversationItem] = []
    legacy = 0
    for item in items:
        item, excerpted = normalize_tool_result(item, inline_maximum_bytes)
        out.append(item)
        legacy += excerpted
    return tuple(out), legacy
