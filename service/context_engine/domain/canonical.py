"""Canonical JSON and hashing: sorted keys, no insignificant whitespace, UTF-8 (ARCHITECTURE.md
"Byte stability and `prefix_sha256`")."""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any


def canonical_json(value: Any) -> str:
    """Serialize ``value`` canonically. Sets must be sorted by the caller (we reject them)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def sha256_hex(text: str | bytes) -> str:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def canonical_sha256(value: Any) -> str:
    return sha256_hex(canonical_json(value))


def session_key(tenant_id: str, session_id: str) -> str:
    """``session-`` + first 32 hex of SHA-256 over canonical [tenant_id, session_id]."""
    return "session-" + canonical_sha256([tenant_id, session_id])[:32]


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


class _Unsendable(ValueError):
    """Valid JSON holding what a body that sends the object parsed cannot carry as written;
    its message says what (a field violation's text), ``bare`` the same without the text
    found (for a reader who must not be shown it)."""

    def __init__(self, message: str, bare: str) -> None:
        super().__init__(message)
        self.bare = bare


def _finite(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):  # e.g. 1e400: not representable, and not canonical JSON
        said = ("beyond the range of a 64-bit float: a body that sends it parsed cannot carry "
                "it; refused in every format alike")
        raise _Unsendable(f"holds the number {literal[:40]}, {said}", f"holds a number {said}")
    return value


# The longest integer a JSON text may write, in digits (a sign aside): CPython's default limit
# on converting between an int and its decimal text, fixed here rather than left to the
# interpreter's (PYTHONINTMAXSTRDIGITS, -X int_max_str_digits), so that whether a text is
# accepted depends on the text alone, on every replica: one without the limit would otherwise
# pin a longer integer in a plan that a default replica could not read back or hash. Every
# value the decoders below build stays within it, so canonical_json (and every hash over such
# a value) writes it under the default limit; protobuf's integers are 64-bit. (A limit set
# below the default, 640 digits at least, is not supported.)
MAX_INT_DIGITS = 4_300


def _bounded_int(literal: str) -> int:
    digits = len(literal) - literal.startswith("-")
    if digits > MAX_INT_DIGITS:
        said = (f"of more than {MAX_INT_DIGITS:,} digits: a body that sends it parsed cannot "
                "carry it as written; refused in every format alike")
        raise _Unsendable(f"holds the integer {literal[:40]}... ({digits:,} digits), {said}",
                          f"holds an integer {said}")
    return int(literal)


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refused when a name occurs twice: a parsed body would keep only
    the last, while the formats that send the text as it is would send both."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                said = ("twice in one object: a body that sends it parsed would keep one "
                        "value; refused in every format alike")
                raise _Unsendable(f"holds the name {name[:40]!r} {said}",
                                  f"holds one name {said}")
            seen.add(name)
    return value


# What json.loads(text, parse_constant=..., parse_float=..., parse_int=...) builds anew for
# every call; the strict one (validation) also refuses a name repeated in an object.
_OBJECT_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite,
                                   parse_int=_bounded_int)
_STRICT_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite,
                                   parse_int=_bounded_int, object_pairs_hook=_unique_names)


# A \uD800-\uDFFF escape: half of a UTF-16 surrogate pair. Python's json decodes one that is not
# in a pair to a lone surrogate, which is not a Unicode character: no UTF-8 text (a provider
# body that re-encodes it, a stored plan) can carry it. Texts arriving over gRPC are valid
# UTF-8, so such an escape is the only way one gets in. A valid pair's escapes match too: one
# encoding of the parsed value tells them apart.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
NOT_AN_OBJECT = "is not a JSON object"
# How deep a JSON object may nest (objects and arrays): far more than any tool's input takes,
# and far from the depth where writing it into a body or a stored plan (recursively, a few
# levels deeper) would fail.
MAX_JSON_DEPTH = 100
TOO_DEEP = (f"nests objects and arrays more than {MAX_JSON_DEPTH} levels deep: a body or a "
            "stored plan that holds it could not be written")
LONE_SURROGATE = ("holds a lone surrogate escape (\\ud800-\\udfff outside a pair): not a "
                  "Unicode character, so a body sending it as JSON (Anthropic, Gemini, Bedrock) "
                  "cannot carry it; refused in every format alike")


def _decode(text: str, decoder: json.JSONDecoder) -> Any:
    if not isinstance(text, str) or text.startswith("\ufeff"):
        # json.loads' own handling: bytes decoded, a byte-order mark refused
        return json.loads(text, parse_constant=decoder.parse_constant,
                          parse_float=decoder.parse_float, parse_int=decoder.parse_int,
                          object_pairs_hook=decoder.object_pairs_hook)
    return decoder.decode(text)


def _parse_object(text: str) -> dict[str, Any] | None:
    try:
        value = _decode(text, _OBJECT_DECODER)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _lone_surrogate(text: str | bytes, value: dict[str, Any]) -> bool:
    if isinstance(text, str) and not _SURROGATE_ESCAPE.search(text):
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def json_object_problem(text: str, *, quote: bool = True) -> str | None:
    """Why ``text`` is not a JSON object every request body can carry (None when it is one):
    :data:`NOT_AN_OBJECT`, :data:`LONE_SURROGATE`, :data:`TOO_DEEP`, a name repeated in one of
    its objects, an integer of more than :data:`MAX_INT_DIGITS` digits or a number beyond a
    64-bit float (what a body that sends it parsed would not carry as written, or would
    change). ``quote`` False: the name or number is not repeated in what is said."""
    try:
        value = _decode(text, _STRICT_DECODER)
    except _Unsendable as e:
        return str(e) if quote else e.bare
    except RecursionError:
        return TOO_DEEP
    except ValueError:
        return NOT_AN_OBJECT
    if not isinstance(value, dict):
        return NOT_AN_OBJECT
    if text.count("{") + text.count("[") > MAX_JSON_DEPTH and _too_deep(value):
        return TOO_DEEP  # (fewer brackets than that cannot nest so deep: nothing to walk)
    return LONE_SURROGATE if _lone_surrogate(text, value) else None


def _too_deep(value: dict[str, Any]) -> bool:
    """Whether ``value`` nests objects and arrays more than :data:`MAX_JSON_DEPTH` levels."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def parse_json_object(text: str) -> dict[str, Any] | None:
    """Parse ``text`` as a JSON object; None if it is not valid JSON, not an object, or holds a
    lone surrogate (see :func:`json_object_problem`)."""
    value = _parse_object(text)
    if value is None or _lone_surrogate(text, value):
        return None
    return value


def sent_object_json(text: str) -> str:
    """A JSON object text as the provider bodies that send it parsed carry it: re-serialized
    canonically (``{}`` where it is not an object, as they send it)."""
    return canonical_json(parse_json_object(text) or {})


# Keys whose string values a reasoning payload's provider reads as text: Anthropic's
# ``thinking``, Bedrock's ``reasoningText.text``, OpenAI's summary ``text``.
REASONING_TEXT_KEYS = frozenset({"thinking", "text"})


def reasoning_texts(opaque: bytes) -> list[str]:
    """Every string under a :data:`REASONING_TEXT_KEYS` key, at any depth, of a reasoning
    payload that is a JSON object (none if it is not one)."""
    try:
        value = parse_json_object(opaque.decode("utf-8"))
    except UnicodeDecodeError:
        return []
    found: list[str] = []
    stack: list[Any] = [value] if value is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, child in node.items():
                if key in REASONING_TEXT_KEYS and isinstance(child, str):
                    found.append(child)
                elif isinstance(child, (dict, list)):
                    stack.append(child)
        elif isinstance(node, list):
            stack.extend(c for c in node if isinstance(c, (dict, list)))
    return found


# Texts already found to be JSON objects (the same tool-call arguments are checked on every
# whole Build of a session): speed only. Bounded in entries; a short text is kept as it is, a
# longer one by its BLAKE2b digest (hashing 12 KB takes some microseconds, parsing it strictly
# a few hundred); a text that is not an object is never kept, so it is parsed (and refused)
# every time.
KNOWN_OBJECTS_ENTRIES = 16_384
KNOWN_OBJECT_CHARS = 1_024
_known_objects: dict[str | bytes, None] = {}


def _known_key(text: str) -> str | bytes:
    if len(text) <= KNOWN_OBJECT_CHARS:
        return text
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def is_json_object(text: str) -> bool:
    """``json_object_problem(text) is None``, remembered for texts that are."""
    key = _known_key(text)
    if key in _known_objects:
        return True
    if json_object_problem(text) is not None:
        return False
    if len(_known_objects) >= KNOWN_OBJECTS_ENTRIES:
        _known_objects.clear()
    _known_objects[key] = None
    return True
