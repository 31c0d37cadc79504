"""What Build returns: an ordered, provider-neutral model request."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from context_engine.domain.trust import TrustLevel

# Anthropic's, Gemini's and Bedrock's first message must be a user turn. When the retained
# history starts with the model's own turn (a history cut without a summary yet), this fixed
# platform line opens it (provider_common ``Turns.lead``); every Build's estimate counts it.
LEADING_USER_TEXT = "(Earlier conversation omitted.)"


class Role(enum.Enum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixBlock:
    row: int
    trust: TrustLevel
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolDefinition:
    name: str
    description: str
    input_schema_json: str  # canonical JSON


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments_json: str


class AttachmentKind(enum.Enum):
    IMAGE = "image"
    PDF = "pdf"
    TEXT = "text"


@dataclass(frozen=True, kw_only=True, slots=True)
class Attachment:
    """A file reference in an owner-written user message. The adapter sends the file; the
    estimator counts what it will cost (estimator.py, ADR-0120)."""

    kind: AttachmentKind
    name: str
    ref: str
    pages: int = 0  # PDF
    text_chars: int = 0  # TEXT: the inlined length
    text_bytes: int = 0  # TEXT: the inlined length in UTF-8 bytes, when the sender states it

    def label(self) -> str:
        return f"[attachment {self.kind.value}: {self.name}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    row: int
    role: Role
    trust: TrustLevel
    text: str = ""
    item_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    call_id: str = ""
    reasoning_provider: str = ""
    reasoning_opaque: bytes = b""
    attachments: tuple[Attachment, ...] = ()

    def __repr__(self) -> str:  # never print a reasoning payload or content into logs
        return (f"Message(row={self.row}, role={self.role.value}, trust={self.trust.value}, "
                f"item_id={self.item_id!r}, text_chars={len(self.text)}, "
                f"tool_calls={len(self.tool_calls)}, reasoning_bytes={len(self.reasoning_opaque)})")

    def digest_parts(self) -> list[object]:
        """Everything the model receives, for byte-identity checks and hashing."""
        return [self.row, self.role.value, self.trust.value, self.text, self.item_id,
                [[c.call_id, c.name, c.arguments_json] for c in self.tool_calls],
                self.call_id, self.reasoning_provider, self.reasoning_opaque.hex(),
                [[a.kind.value, a.name, a.ref, a.pages, a.text_chars, a.text_bytes]
                 for a in self.attachments]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRequest:
    prefix_blocks: tuple[PrefixBlock, ...]
    tools: tuple[ToolDefinition, ...]
    messages: tuple[Message, ...]
