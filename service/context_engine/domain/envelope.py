"""Trust envelopes: attributed, nonced delimiters around content below TRUSTED_CONFIGURATION.

spec: "Every non-platform region is enveloped". The closing marker carries a per-item nonce
derived from the session key, the item id and a digest of the content (DESIGN §3), and any
occurrence of the delimiter syntax inside content is escaped at render time, so content cannot
close its own envelope even if it guesses the nonce.
"""

from __future__ import annotations

import re
import unicodedata

from context_engine.domain.canonical import canonical_sha256, sha256_hex
from context_engine.domain.trust import TrustLevel

TAGS: dict[TrustLevel, str] = {
    TrustLevel.USER: "user",
    TrustLevel.MEMORY: "memory",
    TrustLevel.EXTERNAL_UNTRUSTED: "untrusted",
}
TAG_NAMES = tuple(sorted(set(TAGS.values())))
NONCE_HEX = 16

# Characters that read as "<" or "/" to a model, and characters invisible to it.
_LT_LIKE = "<\uff1c\ufe64\u2039\u3008\u2329\u27e8\u276e\u02c2"
_SLASH_LIKE = "/\uff0f\u2044\u2215\u29f8\u2571"
_INVISIBLE = "\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff\u00ad\u180e"
_LT_RE = re.compile(f"[{_LT_LIKE}]")
_SKIP = set(_INVISIBLE) | {" ", "\t", "\n", "\r", "\f", "\v"}
_LOOKAHEAD = 64


def nonce(session_key: str, item_id: str, content: str) -> str:
    """Deterministic per-item nonce: truncated SHA-256 over session key, id and content digest."""
    return canonical_sha256([session_key, item_id, sha256_hex(content)])[:NONCE_HEX]


def _opens_delimiter(text: str, start: int) -> bool:
    """Does the "<"-like character at ``start`` begin an envelope tag, once look-alikes,
    invisible characters, white space and letter case are folded away?"""
    folded: list[str] = []
    for ch in text[start + 1:start + 1 + _LOOKAHEAD]:
        if ch in _SKIP:
            continue
        norm = unicodedata.normalize("NFKC", ch).lower()
        if ch in _SLASH_LIKE:
            norm = "/"
        folded.append(norm)
        if len(folded) > 12:
            break
    candidate = "".join(folded).lstrip("/")
    return any(candidate.startswith(name) for name in TAG_NAMES)


def escape_content(content: str) -> str:
    """Neutralize every delimiter-like sequence: its "<" becomes the entity ``&lt;``."""
    if not _LT_RE.search(content):
        return content
    out: list[str] = []
    last = 0
    for match in _LT_RE.finditer(content):
        i = match.start()
        if _opens_delimiter(content, i):
            out.append(content[last:i])
            out.append("&lt;")
            last = i + 1
    out.append(content[last:])
    return "".join(out)


def escape_attr(value: str) -> str:
    return (value.replace("&", "&amp;").replace('"', "&quot;")
            .replace("<", "&lt;").replace(">", "&gt;").replace("\n", " "))


def envelope(*, trust: TrustLevel, source: str, item_id: str, content: str,
             session_key: str) -> str:
    """Render ``content`` inside its envelope. Trust at or above TRUSTED_CONFIGURATION is
    returned unchanged: it is not data but configuration or platform text."""
    if not trust.enveloped:
        return content
    tag = TAGS[trust]
    n = nonce(session_key, item_id, content)
    return (f'<{tag} source="{escape_attr(source)}" id="{escape_attr(item_id)}" '
            f'nonce="{n}">\n{escape_content(content)}\n</{tag}:{n}>')
