"""The Unicode character properties the envelope escaper's fold and the checks of names and ids
read, from committed tables (``ucd_tables``, written by ``scripts/gen_ucd.py`` from Unicode
14.0.0) rather than from the interpreter: each Python minor version ships its own Unicode
database, and the fold decides the bytes of pinned prefixes, so every replica must read the
same characters alike whatever Python it runs. A character Unicode 14.0.0 does not assign (one
a later version added) has category "Cn", no decomposition and no case here.

``decompose`` and ``compose`` are NFKD and NFKC of one character, ``lower`` the lower case of
one character (``str.lower`` of it); of a string, each is the concatenation of its
characters' (no canonical reordering, no final-sigma rule: the fold reads one character at a
time)."""

from __future__ import annotations

import bisect

from context_engine.domain import ucd_tables as _t

VERSION = _t.VERSION


def _text(hexadecimal: str) -> str:
    return bytes.fromhex(hexadecimal).decode("utf-8", "surrogatepass")


def _mapping(keys: str, values: str) -> dict[str, str]:
    """Each character of ``keys`` to its value, the values ended by NUL in ``values``."""
    return dict(zip(_text(keys), _text(values).split("\0")[:-1], strict=True))


_STARTS = [ord(ch) for ch in _text(_t.STARTS)]
_CATEGORIES = [_t.CATEGORIES[i:i + 2] for i in range(0, len(_t.CATEGORIES), 2)]
_SPACE = frozenset(_text(_t.SPACE))
_DECOMPOSED = _mapping(_t.DECOMPOSED_KEYS, _t.DECOMPOSED_VALUES)
# NFKC where it is not NFKD's; elsewhere NFKD's, or the character where NFKD leaves it
_COMPOSED = _mapping(_t.COMPOSED_KEYS, _t.COMPOSED_VALUES)
_LOWER = _mapping(_t.LOWER_KEYS, _t.LOWER_VALUES)

_HANGUL_FIRST, _HANGUL_COUNT = 0xAC00, 11_172
_L_FIRST, _V_FIRST, _T_FIRST, _V_COUNT, _T_COUNT = 0x1100, 0x1161, 0x11A7, 21, 28


def category(ch: str) -> str:
    """The general category of ``ch`` (a one-character string), as ``unicodedata.category``."""
    return _CATEGORIES[bisect.bisect_right(_STARTS, ord(ch)) - 1]


def isspace(ch: str) -> bool:
    """Whether ``ch`` is white space, as ``str.isspace``."""
    return ch in _SPACE


def decompose(text: str) -> str:
    """Each character's compatibility decomposition (NFKD of it), concatenated."""
    return "".join(_one_decomposed(ch) for ch in text)


def _one_decomposed(ch: str) -> str:
    found = _DECOMPOSED.get(ch)
    if found is not None:
        return found
    index = ord(ch) - _HANGUL_FIRST
    if not 0 <= index < _HANGUL_COUNT:
        return ch
    # Unicode's algorithm for a Hangul syllable: leading consonant, vowel, trailing consonant
    lead, rest = divmod(index, _V_COUNT * _T_COUNT)
    vowel, trail = divmod(rest, _T_COUNT)
    return (chr(_L_FIRST + lead) + chr(_V_FIRST + vowel)
            + (chr(_T_FIRST + trail) if trail else ""))


def compose(text: str) -> str:
    """Each character's compatibility composition (NFKC of it), concatenated."""
    return "".join(_COMPOSED.get(ch) or _DECOMPOSED.get(ch, ch) for ch in text)


def lower(text: str) -> str:
    """Each character's lower case (``str.lower`` of it), concatenated."""
    return "".join(_LOWER.get(ch, ch) for ch in text)
