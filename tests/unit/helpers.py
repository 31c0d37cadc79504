"""Helpers for the unit tests: an independent envelope parser, sized tools, plan shortcuts.

The parser here deliberately shares no code with ``context_engine.domain.envelope``: it reads
rendered text back the way a reader (or a model) would, so a test built on it fails if the
service's own escaping is wrong rather than agreeing with it by construction.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from context_engine.domain.canonical import session_key
from context_engine.domain.model import PlanInputs, SideEffect, ToolSpec
from context_engine.domain.plan import PlanSpec, make_spec, tool_cost

from tests import factories as f

# ----------------------------------------------------------------------------- envelope parser

OPENING_RE = re.compile(
    r'<(?P<tag>user|memory|untrusted) source="(?P<source>[^"]*)" id="(?P<id>[^"]*)" '
    r'nonce="(?P<nonce>[0-9a-f]+)">')

# Characters a reader is likely to take for "<", "/" or ">" although they are other code points.
_LT = {"\uff1c", "\ufe64", "\u2039", "\u3008", "\u2329", "\u27e8", "\u276e", "\u02c2"}
_SLASH = {"\uff0f", "\u2044", "\u2215", "\u29f8", "\u2571"}
_GT = {"\uff1e", "\ufe65", "\u203a", "\u3009", "\u232a", "\u27e9", "\u276f", "\u02c3"}
# Invisible characters that are neither Unicode format (Cf) nor control (Cc) characters.
_EXTRA_INVISIBLE = {"\u034f", "\u115f", "\u1160", "\u3164", "\uffa0"} | {
    chr(c) for c in range(0xFE00, 0xFE10)}


def _invisible(ch: str) -> bool:
    return ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf") or ch in _EXTRA_INVISIBLE


def fold(text: str) -> tuple[str, list[int]]:
    """A reader's view of ``text``: invisible characters and white space dropped, look-alikes
    of ``<``, ``/`` and ``>`` mapped to ASCII, NFKC-normalized and case-folded. Returns the folded
    text and, for each folded character, the index of the source character it came from."""
    out: list[str] = []
    where: list[int] = []
    for i, ch in enumerate(text):
        if _invisible(ch):
            continue
        if ch in _LT:
            norm = "<"
        elif ch in _SLASH:
            norm = "/"
        elif ch in _GT:
            norm = ">"
        else:
            norm = unicodedata.normalize("NFKC", ch).casefold()
        for c in norm:
            out.append(c)
            where.append(i)
    return "".join(out), where


@dataclass(frozen=True)
class ParsedEnvelope:
    tag: str
    source: str
    item_id: str
    nonce: str
    start: int  # index of the opening "<"
    body_start: int  # first character after the opening tag
    close_start: int  # index of the closing marker's "<" (first one the reader sees)
    close_end: int  # index after the closing marker
    body: str  # text between the opening tag and the closing marker


def find_close(text: str, tag: str, nonce_: str, start: int, *, lenient: bool) -> tuple[int, int]:
    """Position (start, end) of the FIRST closing marker ``</tag:nonce>`` at or after ``start``.
    ``lenient`` reads the way a model might: through invisible characters, white space,
    letter case and look-alike punctuation."""
    marker = f"</{tag}:{nonce_}>"
    if not lenient:
        i = text.find(marker, start)
        if i < 0:
            raise AssertionError(f"no closing marker {marker!r} after {start}")
        return i, i + len(marker)
    folded, where = fold(text)
    fstart = next((k for k, src in enumerate(where) if src >= start), len(folded))
    k = folded.find(marker.casefold(), fstart)
    if k < 0:
        raise AssertionError(f"no closing marker {marker!r} after {start}")
    return where[k], where[k + len(marker) - 1] + 1


def parse_envelopes(text: str, *, lenient: bool = False) -> list[ParsedEnvelope]:
    """Every envelope in ``text``, outermost first, each closed at the first marker with its
    nonce that a reader would see. Openings inside an envelope's body are not envelopes."""
    found: list[ParsedEnvelope] = []
    pos = 0
    while True:
        m = OPENING_RE.search(text, pos)
        if m is None:
            return found
        close_start, close_end = find_close(text, m["tag"], m["nonce"], m.end(),
                                            lenient=lenient)
        found.append(ParsedEnvelope(
            tag=m["tag"], source=m["source"], item_id=m["id"], nonce=m["nonce"],
            start=m.start(), body_start=m.end(), close_start=close_start, close_end=close_end,
            body=text[m.end():close_start]))
        pos = close_end


def only_envelope(text: str, *, lenient: bool = False) -> ParsedEnvelope:
    envs = parse_envelopes(text, lenient=lenient)
    assert len(envs) == 1, f"expected exactly one envelope, found {len(envs)}"
    return envs[0]


def unescape(body: str) -> str:
    """Undo the documented escaping (a delimiter's "<" shown as ``&lt;``)."""
    return body.replace("&lt;", "<")


def lt_folded(text: str) -> str:
    """``text`` with every look-alike of "<" written as "<". Escaping shows a delimiter's
    "<" (or its look-alike) as ``&lt;``, so a round trip is exact only up to this folding."""
    return "".join("<" if ch in _LT else ch for ch in text)


def round_trips(body: str, content: str) -> bool:
    """Does the envelope ``body`` carry exactly ``content`` (up to look-alike "<")?"""
    return lt_folded(unescape(body)) == lt_folded(content)


# ----------------------------------------------------------------------------- tools and plans

def sized_tool(name: str, cost: int, **kw: Any) -> ToolSpec:
    """A tool whose definition costs as close to ``cost`` tokens as possible without going over
    (measured with the same estimator the planner uses)."""
    est = f.estimator(f.model())
    lo, hi = 0, cost * 2
    best = f.tool(name, description=f"Does {name}.", **kw)
    while lo <= hi:
        mid = (lo + hi) // 2
        t = f.tool(name, description=f"Does {name}. " + " ".join(["alpha"] * mid), **kw)
        c = tool_cost(t, est)
        if c <= cost:
            best, lo = t, mid + 1
        else:
            hi = mid - 1
    return best


def cost_of(tool: ToolSpec) -> int:
    return tool_cost(tool, f.estimator(f.model()))


def tools(prefix: str, n: int, *, side_effect: SideEffect = SideEffect.NONE,
          server: str = "") -> tuple[ToolSpec, ...]:
    return tuple(f.tool(f"{prefix}{i:02d}", side_effect=side_effect, server=server)
                 for i in range(n))


def names(specs: tuple[ToolSpec, ...] | list[ToolSpec]) -> list[str]:
    return [t.name for t in specs]


def spec_of(i: PlanInputs) -> PlanSpec:
    """Tool selection and pinning only (no rendering or class measurement)."""
    return make_spec(i, f.estimator(i.model), session_key(i.tenant_id, i.session_id))


def browser_tools(*, side_effect: SideEffect = SideEffect.NETWORK_READ,
                  scopes: tuple[str, ...] = ()) -> tuple[ToolSpec, ...]:
    return tuple(f.tool(n, session_binding="website", side_effect=side_effect, scopes=scopes)
                 for n in ("browser.navigate", "browser.observe", "browser.act"))
