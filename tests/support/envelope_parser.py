"""An independent reader of rendered envelopes, for the trust gate.

Shares no code with ``context_engine.domain.envelope``: it reads the rendered text back the way a
strict parser and a lenient reader (a model) would.

* Strict reading: every opening ``<tag source=".." id=".." nonce="N">`` is closed by the FIRST
  literal ``</tag:N>`` after it; openings inside a body are not envelopes.
* Lenient reading: a body, folded the way a model might read it (NFKC, case, invisible and
  blank characters, combining marks, look-alikes of ``<`` and ``/``), must contain nothing that
  reads as an envelope tag: no ``<tag``, ``</tag`` for any envelope tag name. Unicode's tag
  characters (U+E0020-U+E007E) are read both ways a reader may take them: dropped, as
  invisible, and decoded to the ASCII characters they encode (``decode_tags``). Read with
  Unicode's confusables (``unicode_fold``), a letter is also read as the letter its name says
  it is built on (``named_reading``: "LATIN SMALL LETTER O WITH STROKE" as "o"), and each
  combining letter both dropped and as its letter, one by one (``_lettered_hits``). Either
  way a symbol named after a letter is read as that letter (``symbol_reading``: the enclosed
  letters NFKC keeps as they are, "NEGATIVE SQUARED LATIN CAPITAL LETTER U", or reads as
  "(u)", and the regional indicators); read with Unicode's confusables, a symbol or punctuation
  mark named after "<" or "/" ("LESS-THAN WITH DOT", "CIRCLED LESS-THAN", "DOTTED SOLIDUS") as
  that character.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass

TAG_NAMES = ("memory", "untrusted", "user")

OPENING_RE = re.compile(
    r'<(?P<tag>user|memory|untrusted) source="(?P<source>[^"]*)" id="(?P<id>[^"]*)" '
    r'nonce="(?P<nonce>[0-9a-f]+)">')

# Look-alikes of "<" a reader may take for it (NFKC covers fullwidth and small forms too, but
# listing them keeps the reader independent of normalization details).
LT_LIKE = frozenset("<\uff1c\ufe64\u2039\u3008\u2329\u27e8\u276e\u02c2")
# Further confusables of "<" (Unicode confusables.txt, angle-bracket ornaments): outside the
# service's fold list, read only with ``confusables=True`` (a documented finding).
LT_CONFUSABLES_EXTRA = frozenset("\u1438\u16b2\U0001d236\u276c\u29fc")
# "\\" too: "<\\/untrusted:..>" is a closing marker written the way JSON may escape it.
SLASH_LIKE = frozenset("/\\\uff0f\u2044\u2215\u29f8\u2571")
BLANK_LETTERS = frozenset("\u034f\u115f\u1160\u3164\uffa0\u180e\u2800")
# Latin look-alikes of the letters of the tag names (Cyrillic, Greek, Armenian).
LETTER_HOMOGLYPHS = {
    "\u0435": "e", "\u0455": "s", "\u043e": "o", "\u0443": "y", "\u0440": "p",
    "\u057d": "u", "\u03c5": "u", "\u0578": "n", "\u03bf": "o", "\u0433": "r",
    "\u0442": "t", "\u043c": "m", "\u0501": "d",
    # Lisu, Greek, Myanmar, Devanagari and Cyrillic letters, and a set operator
    "\ua4f4": "u", "\u222a": "u", "\u03b7": "n", "\u101d": "o", "\u0966": "o",
    "\u03b3": "y", "\u04af": "y",
}
# Strokes that read as "/" (Katakana no, a Kangxi radical and its CJK form).
SLASH_CONFUSABLES = frozenset("\u30ce\u2f03\u4e3f")


def decode_tags(text: str) -> str:
    """``text`` with each tag character that encodes a printable ASCII character (U+E0020 to
    U+E007E, the character plus U+E0000) read as that character, as a reader that decodes
    them (a model may) sees it."""
    return "".join(chr(ord(c) - 0xE0000) if 0xE0020 <= ord(c) <= 0xE007E else c for c in text)


def invisible(ch: str) -> bool:
    if ch.isspace() or ch in BLANK_LETTERS:
        return True
    code = ord(ch)
    if 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF:
        return True
    return unicodedata.category(ch) in ("Cc", "Cf", "Mn", "Me")  # a reader may drop controls


_SYMBOL_NAMED = re.compile(r"^[A-Z -]+ LETTER (?P<letter>[A-Z])$")


@functools.cache
def symbol_reading(ch: str) -> str | None:
    """The letter a reader takes a symbol named after a Latin letter for, lower-cased:
    U+1F184 (NEGATIVE SQUARED LATIN CAPITAL LETTER U, which NFKC leaves as it is), U+24B0
    (PARENTHESIZED LATIN SMALL LETTER U, "(u)" to NFKC) and U+1F1FA (REGIONAL INDICATOR SYMBOL
    LETTER U) as "u"; None for anything else."""
    if not unicodedata.category(ch).startswith("S"):
        return None
    m = _SYMBOL_NAMED.match(unicodedata.name(ch, ""))
    return None if m is None else m["letter"].lower()


_DECORATED = re.compile(r"\b(?P<base>LESS-THAN|SOLIDUS)\b")


@functools.cache
def delimiter_reading(ch: str) -> str | None:
    """The "<" or "/" a reader takes a symbol or a punctuation mark for whose name says it is
    built on "<" ("LESS-THAN") or on "/" or "\\" ("SOLIDUS", "REVERSE SOLIDUS"): U+22D6,
    LESS-THAN WITH DOT, and U+29C0, CIRCLED LESS-THAN, as "<"; U+1F67C, VERY HEAVY SOLIDUS, as
    "/"."""
    if unicodedata.category(ch)[0] not in "SP":
        return None
    m = _DECORATED.search(unicodedata.name(ch, ""))
    return None if m is None else "<" if m["base"] == "LESS-THAN" else "/"


def _read(ch: str, confusables: bool) -> str:
    """One character as ``fold`` reads it ("" when invisible)."""
    if invisible(ch):
        return ""
    delimiter = delimiter_reading(ch) if confusables else None
    if delimiter is not None:
        return delimiter
    if ch in (LT_LIKE | LT_CONFUSABLES_EXTRA if confusables else LT_LIKE):
        return "<"
    if ch in SLASH_LIKE or (confusables and ch in SLASH_CONFUSABLES):
        return "/"
    if confusables and ch in LETTER_HOMOGLYPHS:
        return LETTER_HOMOGLYPHS[ch]
    return symbol_reading(ch) or unicodedata.normalize("NFKC", ch).casefold()


# Each character's reading, once per character and reading (the gates fold millions).
_READINGS: dict[bool, dict[str, str]] = {False: {}, True: {}}


def fold(text: str, *, confusables: bool = False) -> str:
    """A model's view of ``text``: invisible characters dropped, look-alikes mapped, NFKC,
    case-folded. ``confusables`` also maps rarer confusables and letter homoglyphs."""
    readings = _READINGS[confusables]
    out: list[str] = []
    for ch in text:
        read = readings.get(ch)
        if read is None:
            read = readings[ch] = _read(ch, confusables)
        out.append(read)
    return "".join(out)


_TAGLIKE = re.compile(r"<\s*/*\s*(?:" + "|".join(TAG_NAMES) + ")")


def _bare(ch: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKD", ch)
                   if unicodedata.category(c) not in ("Mn", "Me"))


def unicode_group(target: str) -> set[str]:
    """``target`` and its single-character confusables, as Unicode lists them (a right-to-left
    one, Arabic heh for "o", listed between directional marks, read without them)."""
    from confusable_homoglyphs import confusables

    data = confusables.confusables_data
    found = {target}
    for e in data.get(target, []):
        ch = e["c"].replace("\u200e", "").replace("\u200f", "")
        if len(ch) == 1:
            found.add(ch)
    return found


_NAMED = re.compile(r"^(?:LATIN|GREEK|CYRILLIC|COPTIC|ARMENIAN) (?:SMALL |CAPITAL )?LETTER "
                    r"(?P<base>\S+)(?: .+)?$")


@functools.cache
def named_reading(ch: str) -> str | None:
    """The letter a reader takes ``ch`` for by what it is named after: a Latin letter with a
    stroke, bar or hook ("LATIN SMALL LETTER O WITH STROKE" as "o"), a letter of another
    script named after one (as that letter is read); None when its name says nothing, or when
    it decomposes ("ŉ" is read as the apostrophe and "n" it decomposes to)."""
    m = _NAMED.match(unicodedata.name(ch, ""))
    if m is None or unicodedata.normalize("NFKD", ch) != ch:  # read by its decomposition
        return None
    base = m["base"]
    if len(base) == 1 and "A" <= base <= "Z" and unicodedata.name(ch).startswith("LATIN"):
        return base.lower()
    script, case = unicodedata.name(ch).split()[0], "SMALL"
    try:
        plain = unicodedata.lookup(f"{script} {case} LETTER {base}")
    except KeyError:
        return None
    if plain == ch:
        return None
    _, _, letters = _unicode_tables()
    return letters.get(plain)


_COMBINING = re.compile(r"^COMBINING (?P<script>LATIN|CYRILLIC) (?:SMALL |CAPITAL )?LETTER "
                        r"(?P<base>.+)$")


@functools.cache
def _combining_letter(ch: str) -> str | None:
    m = _COMBINING.match(unicodedata.name(ch, ""))
    if m is None:
        return None
    for words in (m["base"], m["base"].split()[0]):  # "O WITH DIAERESIS", then "O"
        try:
            return unicodedata.lookup(f"{m['script']} SMALL LETTER {words}")
        except KeyError:
            continue
    return None


def decode_marks(text: str) -> str:
    """``text`` with each combining letter (U+0367, COMBINING LATIN SMALL LETTER U) read as
    the letter it is named after, as a reader that reads them as letters sees it (one
    character each, so positions agree)."""
    return "".join(_combining_letter(c) or c for c in text)


def unicode_string_group(chars: str) -> dict[str, str]:
    """Unicode's single-character confusables of strings of two or more characters, each in
    ``chars`` (either case), each to that string lower-cased ("≪": "<<", U+11700: "rn")."""
    from confusable_homoglyphs import confusables

    allowed = set(chars.lower())
    return {e["c"]: target.lower() for target, data in confusables.confusables_data.items()
            if len(target) > 1 and set(target.lower()) <= allowed
            for e in data if len(e["c"]) == 1}


@functools.cache
def _unicode_tables() -> tuple[set[str], set[str], dict[str, str]]:
    letters = {c: letter for letter in "abcdefghijklmnopqrstuvwxyz"
               for c in unicode_group(letter) | unicode_group(letter.upper())}
    # a confusable of a string of letters reads as those letters (U+11700 as "rn")
    letters.update((c, run) for c, run in
                   unicode_string_group("abcdefghijklmnopqrstuvwxyz").items()
                   if c not in letters)
    # and one of a run of "<" as "<", of a run of "/" and "\\" as "/"
    return (unicode_group("<") | set(unicode_string_group("<")),
            unicode_group("/") | unicode_group("\\") | set(unicode_string_group("/\\")),
            letters)


def unicode_fold(text: str) -> str:
    """A model's view of ``text`` read with Unicode's own confusables (confusables.txt as the
    package confusable-homoglyphs ships it, read here, not the service's table): each
    character decomposed without its marks, a confusable of "<", "/" or "\\" (or of a run of
    them) as that character, a confusable of a Latin letter (or of a string of them) as those
    letters, a symbol named after a letter as it (``symbol_reading``) or after "<" or "/" as
    that character (``delimiter_reading``), case-folded; "rn" as "m"."""
    lt, slash, letters = _unicode_tables()
    out: list[str] = []
    for ch in text:
        if invisible(ch):
            continue
        bare = _bare(ch)
        delimiter = delimiter_reading(ch)
        if ch in lt or bare in lt or delimiter == "<":
            out.append("<")
        elif ch in slash or bare in slash or delimiter == "/":
            out.append("/")
        else:
            out.append(letters.get(ch) or letters.get(bare) or named_reading(ch)
                       or symbol_reading(ch) or bare.casefold())
    return "".join(out).replace("rn", "m")


def taglike(body: str, *, confusables: bool = False, unicode: bool = False) -> list[str]:
    """Every sequence in ``body`` a lenient reader takes for an envelope tag (opening or
    closing, any nonce), with tag characters dropped or decoded (``decode_tags``).
    ``unicode``: read with Unicode's confusables (``unicode_fold``)."""
    hits: list[str] = []
    for reading in (body, decode_tags(body)):  # tag characters dropped, then decoded
        if unicode:
            hits += _TAGLIKE.findall(unicode_fold(reading))
            # each combining letter read as a letter or dropped, one by one
            hits += _lettered_hits(reading) if decode_marks(reading) != reading else []
        else:
            hits += _TAGLIKE.findall(fold(reading, confusables=confusables))
    return hits


def _lettered_hits(text: str) -> list[str]:
    """What reads as a tag when each combining letter of ``text`` is read either as the
    letter it is named after or not at all, each choice on its own: from every "<", every
    reading of the next characters, folded, up to the length of a tag and its padding."""
    choices = [("", unicode_fold(_combining_letter(ch) or "")) if _combining_letter(ch)
               else (unicode_fold(ch),) for ch in text]
    hits: list[str] = []
    for start, first in enumerate(choices):
        if first != ("<",):
            continue
        found: set[str] = set()
        pending = [(start + 1, "<")]
        seen: set[tuple[int, str]] = set()
        while pending:
            i, read = pending.pop()
            match = _TAGLIKE.match(read.replace("rn", "m"))
            if match:
                found.add(match.group(0))
                continue
            if i >= len(choices) or len(read) > 40 or (i, read) in seen:
                continue
            seen.add((i, read))
            pending += [(i + 1, read + piece) for piece in choices[i]]
        hits += sorted(found)
    return hits


@dataclass(frozen=True)
class Envelope:
    tag: str
    source: str
    item_id: str
    nonce: str
    start: int
    body_start: int
    body_end: int
    end: int

    def body(self, text: str) -> str:
        return text[self.body_start:self.body_end]


class EnvelopeError(AssertionError):
    pass


def parse(text: str) -> list[Envelope]:
    """Strict reading: top-level envelopes, each closed at its FIRST literal closing marker.
    Raises if an envelope is never closed or its closing marker occurs again later."""
    found: list[Envelope] = []
    pos = 0
    while True:
        m = OPENING_RE.search(text, pos)
        if m is None:
            break
        marker = f"</{m['tag']}:{m['nonce']}>"
        close = text.find(marker, m.end())
        if close < 0:
            raise EnvelopeError(f"envelope {m['id']!r} at {m.start()} is never closed")
        found.append(Envelope(tag=m["tag"], source=m["source"], item_id=m["id"],
                              nonce=m["nonce"], start=m.start(), body_start=m.end(),
                              body_end=close, end=close + len(marker)))
        pos = close + len(marker)
    for e in found:
        marker = f"</{e.tag}:{e.nonce}>"
        if text.count(marker) != 1:
            raise EnvelopeError(f"closing marker {marker!r} occurs {text.count(marker)} times")
    return found


def check_text(text: str, canaries: list[str], *, confusables: bool = False) -> list[Envelope]:
    """Assert every canary occurrence lies strictly inside an envelope body, every envelope is
    closed exactly once, and no body reads (leniently) as containing a tag. Returns the
    envelopes."""
    envs = parse(text)
    for canary in canaries:
        start = text.find(canary)
        while start >= 0:
            end = start + len(canary)
            if not any(e.body_start <= start and end <= e.body_end for e in envs):
                raise EnvelopeError(
                    f"canary {canary!r} at {start} lies outside every envelope: "
                    f"{text[max(0, start - 120):end + 20]!r}")
            start = text.find(canary, end)
    for e in envs:
        body = e.body(text)
        hits = taglike(body, confusables=confusables)
        if hits:
            raise EnvelopeError(f"envelope {e.item_id!r} body reads as containing tags {hits}: "
                                f"{body[:300]!r}")
    return envs


# How trusted each envelope's content is, most trusted first (its own table: independent of the
# service's trust levels).
TAG_RANK = {"user": 3, "memory": 2, "untrusted": 1}


def check_labels(text: str, canaries: dict[str, str]) -> list[Envelope]:
    """``canaries`` maps each canary to the tag of its own label. Every occurrence must lie
    inside an envelope whose tag is at most as trusted as that label: the label survived
    whatever transformation put the canary here. Also every envelope closes exactly once."""
    envs = parse(text)
    for canary, tag in canaries.items():
        start = text.find(canary)
        while start >= 0:
            end = start + len(canary)
            inside = [e for e in envs if e.body_start <= start and end <= e.body_end]
            if not inside:
                raise EnvelopeError(f"canary {canary!r} (own label {tag}) at {start} lies "
                                    f"outside every envelope: "
                                    f"{text[max(0, start - 160):end + 20]!r}")
            if TAG_RANK[inside[0].tag] > TAG_RANK[tag]:
                raise EnvelopeError(f"canary {canary!r} (own label {tag}) sits in a "
                                    f"<{inside[0].tag}> envelope {inside[0].item_id!r}: its "
                                    "label was raised")
            start = text.find(canary, end)
    return envs
