"""The canonical forms, against what is written out by hand (ARCHITECTURE.md "Byte stability
and `prefix_sha256`": sorted keys, no insignificant whitespace, UTF-8): every hash, nonce and
session key is taken over these bytes, so a serialization that kept insertion order or
escaped non-ASCII characters would move every stored plan's prefix_sha256 while the
service's own hashes still agreed with each other. The oracles are literal strings and
``hashlib`` directly, not the functions under test."""

from __future__ import annotations

import hashlib

from context_engine.domain.canonical import (
    canonical_json,
    canonical_sha256,
    reasoning_texts,
    session_key,
)


def test_canonical_json_sorts_keys_and_keeps_characters_as_utf8() -> None:
    value = {"zeta": 1, "alpha": ["é", "日本"], "mid": {"b": True, "a": None}}
    text = '{"alpha":["é","日本"],"mid":{"a":null,"b":true},"zeta":1}'
    assert canonical_json(value) == text
    assert canonical_sha256(value) == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_the_session_key_hashes_the_tenant_then_the_session() -> None:
    digest = hashlib.sha256(b'["tenant-a","session-1"]').hexdigest()
    assert session_key("tenant-a", "session-1") == "session-" + digest[:32]
    assert session_key("session-1", "tenant-a") != session_key("tenant-a", "session-1")


def test_reasoning_text_is_found_at_any_depth() -> None:
    # Bedrock nests its text one object down, OpenAI's summary in a list of objects
    bedrock = b'{"reasoningText":{"text":"weigh both","signature":"s"}}'
    openai = b'{"type":"reasoning","summary":[{"type":"summary_text","text":"compare"}]}'
    anthropic = b'{"type":"thinking","thinking":"top level","signature":"s"}'
    assert reasoning_texts(bedrock) == ["weigh both"]
    assert reasoning_texts(openai) == ["compare"]
    assert reasoning_texts(anthropic) == ["top level"]
