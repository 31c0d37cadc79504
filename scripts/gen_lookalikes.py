#!/usr/bin/env python3
"""Write service/context_engine/domain/lookalikes.py: the characters the envelope escaper's
folds (``context-engine-builder@5``, with more from @7, @8 and @10) read as "<", as "/" and as
the letters of the envelope tag names, from Unicode's confusables (confusables.txt, as the PyPI
package confusable-homoglyphs ships it), Unicode's decompositions and character names.

The table is generated once and committed: what it holds decides the bytes of pinned
prefixes, so a newer confusables release must not change it silently. ``--check`` exits 1 when
the committed file differs from what this script writes (tests/unit/test_lookalikes.py runs
it).
"""

from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from pathlib import Path

from confusable_homoglyphs import confusables

OUT = Path(__file__).resolve().parent.parent / "service/context_engine/domain/lookalikes.py"
TAG_LETTERS = "".join(sorted(set("untrusted" + "user" + "memory")))
# The fold of builder@4 read these as "<" and "/"; the new sets keep every one of them.
FOLD4_LT = ("<\uff1c\ufe64\u2039\u3008\u2329\u27e8\u276e\u02c2\u1438\u276c\u29fc\u2770"
            "\u3014\u27ea\u2991\u2993\u29d8\u1445\u2264\u227a")
FOLD4_SLASH = "/\\\uff0f\u2044\u2215\u29f8\u2571\ufe68\uff3c\u30ce\u2f03\u4e3f"


def _single(target: str) -> set[str]:
    """Unicode's single-character confusables of ``target``."""
    data = confusables.confusables_data.get(target, [])
    return {e["c"] for e in data if len(e["c"]) == 1 and e["c"] != target}


SLASHES = "/\\"


def _runs(of: str) -> set[str]:
    """Unicode's single-character confusables of strings of two or more characters, each in
    ``of`` ("<<": U+226A; "//": U+2AFD)."""
    return {e["c"] for target, data in confusables.confusables_data.items()
            if len(target) > 1 and set(target) <= set(of)
            for e in data if len(e["c"]) == 1}


def _letter_runs() -> dict[str, str]:
    """Unicode's single-character confusables of strings of two or more tag letters (either
    case), each read as those letters lower-cased (U+11700 as "rn", which reads as "m"); not
    those that already decompose to Latin letters (U+217F, small roman numeral one thousand,
    is "m" once decomposed)."""
    found: dict[str, str] = {}
    for target, data in sorted(confusables.confusables_data.items()):
        if len(target) < 2 or not set(target.lower()) <= set(TAG_LETTERS):
            continue
        for e in data:
            ch = e["c"]
            if len(ch) == 1 and not any(c.isascii() and c.isalpha() for c in _bare(ch)):
                found.setdefault(ch, target.lower())
    return found


_RTL_MARKS = "\u200e\u200f"


def _single_rtl(target: str) -> set[str]:
    """Unicode's single-character confusables of ``target`` that confusables.txt lists inside
    directional marks (right-to-left letters: Arabic heh as "o"), which ``_single`` misses."""
    data = confusables.confusables_data.get(target, [])
    return {c for e in data if len(e["c"]) > 1
            for c in [e["c"].strip(_RTL_MARKS)] if len(c) == 1 and c != target}


def _named_base(ch: str) -> str | None:
    """The letter ``ch`` is named after when its name is that letter's with more words
    ("LATIN SMALL LETTER O WITH STROKE" is "LATIN SMALL LETTER O"'s, "LATIN SMALL LETTER U
    BAR" "LATIN SMALL LETTER U"'s: letters with a stroke, a bar, a hook, which have no
    decomposition), or, for a combining letter, the letter it is named after ("COMBINING
    LATIN SMALL LETTER U" is "LATIN SMALL LETTER U"'s; "COMBINING CYRILLIC LETTER O" "CYRILLIC
    SMALL LETTER O"'s)."""
    words = unicodedata.name(ch, "").split()
    combining = words[:1] == ["COMBINING"]
    if combining:
        words = words[1:]
        if words[:2] == ["CYRILLIC", "LETTER"]:
            words.insert(1, "SMALL")
    if "LETTER" not in words:
        return None
    end = words.index("LETTER") + 2
    if end > len(words) or (end == len(words) and not combining):
        return None
    try:
        return unicodedata.lookup(" ".join(words[:end]))
    except KeyError:
        return None


# A symbol named after a Latin letter: Unicode's enclosed letters (parenthesized, circled,
# squared, negative circled and squared, tortoise-shell bracketed: "NEGATIVE SQUARED LATIN
# CAPITAL LETTER U") and the regional indicators ("REGIONAL INDICATOR SYMBOL LETTER U").
_SYMBOL_LETTER = re.compile(r"(?:LATIN (?:SMALL|CAPITAL)|REGIONAL INDICATOR SYMBOL) LETTER "
                            r"(?P<letter>[A-Z])$")


def _symbol_letter(ch: str) -> str | None:
    """The letter, lower-cased, a symbol (category So) is named after (``_SYMBOL_LETTER``)."""
    if unicodedata.category(ch) != "So":
        return None
    m = _SYMBOL_LETTER.search(unicodedata.name(ch, ""))
    return None if m is None else m["letter"].lower()


def _decorated(word: str) -> set[str]:
    """The symbols and punctuation Unicode names after ``word`` ("LESS-THAN", "SOLIDUS"),
    anywhere in the name: "LESS-THAN WITH DOT" (U+22D6), "CIRCLED LESS-THAN" (U+29C0), "DOUBLE
    NESTED LESS-THAN" (U+2AA1), "LESS-THAN OR EQUAL TO" (U+2264), "DOTTED SOLIDUS" (U+2E4A),
    "VERY HEAVY SOLIDUS" (U+1F67C), "REVERSE SOLIDUS OPERATOR" (U+29F5). Read so only where a
    tag name follows, so that a wide reading escapes nothing else."""
    named = re.compile(rf"\b{word}\b")
    return {chr(code) for code in range(0x110000)
            if unicodedata.category(chr(code))[0] in "SP"
            and named.search(unicodedata.name(chr(code), ""))}


def _bare(ch: str) -> str:
    """``ch`` decomposed (NFKD) without its combining marks."""
    return "".join(c for c in unicodedata.normalize("NFKD", ch)
                   if unicodedata.category(c) not in ("Mn", "Me"))


def _closure(base: set[str]) -> set[str]:
    """``base`` and every character that decomposes to one of its characters (U+226E "≮" is
    "<" with a combining stroke)."""
    found = set(base)
    for code in range(0x110000):
        ch = chr(code)
        if 0xD800 <= code <= 0xDFFF or ch in found:
            continue
        bare = _bare(ch)
        if len(bare) == 1 and bare in base:
            found.add(ch)
    return found


def _literal(chars: set[str]) -> str:
    return '"' + "".join(c if c.isascii() and c.isalnum() else f"\\U{ord(c):08x}"
                         if ord(c) > 0xFFFF else f"\\u{ord(c):04x}"
                         for c in sorted(chars)) + '"'


def _assignment(name: str, chars: set[str]) -> list[str]:
    """``name = "..."``, in parenthesized pieces where one line would pass 100 columns."""
    line = f"{name} = {_literal(chars)}"
    if len(line) <= 100:
        return [line]
    lines, piece = [f"{name} = ("], ""
    for ch in sorted(chars):
        escaped = _literal({ch})[1:-1]
        if len(piece) + len(escaped) > 90:
            lines.append(f'    "{piece}"')
            piece = ""
        piece += escaped
    return [*lines, f'    "{piece}"', ")"]


def render() -> str:
    lt = _closure(set(FOLD4_LT) | _single("<"))
    slash = set(FOLD4_SLASH) | _single("/") | _single("\\")
    letters: dict[str, str] = {}
    for letter in TAG_LETTERS:
        for ch in sorted(_single(letter) | _single(letter.upper())):
            if ch.lower() != letter and _bare(ch).lower() != letter:
                letters.setdefault(ch, letter)
    lines = [
        '"""Generated by scripts/gen_lookalikes.py from Unicode\'s confusables',
        f'(confusable-homoglyphs {confusables_version()}); do not edit.',
        "",
        "What the envelope escaper's fold of ``context-engine-builder@5`` reads as \"<\", as \"/\"",
        "and as the letters of the tag names. Committed, not computed at import: it decides the",
        'bytes of pinned prefixes."""',
        "",
        "# Unicode's confusables of \"<\", those of builder@4, and what decomposes to one of them.",
        f"LT_LIKE = ({_wrap(_literal(lt))})",
        "# Unicode's confusables of \"/\" and \"\\\\\", and those of builder@4.",
        f"SLASH_LIKE = ({_wrap(_literal(slash))})",
        "# Unicode's single-character confusables of each letter of the tag names (either case)",
        "# that are not already that letter once decomposed and lower-cased.",
        *_dict_lines("LETTERS", letters),
    ]
    lines += [
        "",
        "# From ``context-engine-builder@7``: Unicode's single-character confusables of",
        "# strings: of runs of \"<\" (read as \"<\"), of runs of \"/\" and \"\\\\\"",
        "# (read as \"/\"), and of strings of the tag letters (read as those letters).",
        f"LT_RUN_LIKE = {_literal(_runs('<') - lt)}",
        f"SLASH_RUN_LIKE = {_literal(_runs(SLASHES) - slash)}",
        *_dict_lines("LETTER_RUNS", _letter_runs()),
    ]
    more, combining = _fold8(letters)
    lt_8 = {c for c in _single_rtl("<")} - lt
    slash_8 = (_single_rtl("/") | _single_rtl("\\")) - slash
    lines += [
        "",
        "# From ``context-engine-builder@8``: Unicode's confusables listed inside directional",
        "# marks (right-to-left letters), and letters named after a tag letter with a stroke, a",
        "# bar or a hook (no decomposition: U+00F8, LATIN SMALL LETTER O WITH STROKE).",
        f"LT_LIKE_8 = {_literal(lt_8)}",
        f"SLASH_LIKE_8 = {_literal(slash_8)}",
        *_dict_lines("LETTERS_8", more),
        "# Combining letters named after a tag letter: dropped by one reading, read as that",
        "# letter by the other (U+0367, COMBINING LATIN SMALL LETTER U, as \"u\").",
        *_dict_lines("COMBINING_LETTERS", combining),
    ]
    known = set(letters) | set(_letter_runs()) | set(more)
    lt_10 = _decorated("LESS-THAN") - set("<") - lt - _runs("<") - lt_8
    slash_10 = _decorated("SOLIDUS") - set("/\\") - slash - _runs(SLASHES) - slash_8
    lines += [
        "",
        "# From ``context-engine-builder@10``: symbols and punctuation named after \"<\" or \"/\"",
        "# (LESS-THAN, SOLIDUS: U+22D6, LESS-THAN WITH DOT), and symbols named after a tag letter",
        "# that no decomposition reads as it: Unicode's enclosed letters and regional indicators",
        "# (U+1F184, NEGATIVE SQUARED LATIN CAPITAL LETTER U; U+24B0, PARENTHESIZED LATIN SMALL",
        "# LETTER U, which decomposes to \"(u)\": each is read as its letter before it is",
        "# decomposed).",
        *_assignment("LT_LIKE_10", lt_10),
        *_assignment("SLASH_LIKE_10", slash_10),
        *_dict_lines("LETTERS_10", _fold10(known)),
    ]
    return "\n".join(lines) + "\n"


def _fold10(known: set[str]) -> dict[str, str]:
    """Builder@10's letters beyond those of builder@8 (``known``): every symbol named after a
    tag letter (``_symbol_letter``) that is not that letter once decomposed ("CIRCLED LATIN
    SMALL LETTER U", U+24E4, decomposes to "u" and is read so already), each to its letter:
    the parenthesized letters (U+249C-U+24B5, U+1F110-U+1F129, which decompose to "(u)"), the
    negative circled and squared ones (U+1F150-U+1F169, U+1F170-U+1F189) and the regional
    indicators (U+1F1E6-U+1F1FF), which have no decomposition, and two more (U+1F12A,
    tortoise-shell bracketed "S"; U+1F1A5, squared small "d")."""
    found: dict[str, str] = {}
    for code in range(0x110000):
        ch = chr(code)
        letter = _symbol_letter(ch)
        if letter is not None and letter in TAG_LETTERS and ch not in known \
                and _bare(ch).lower() != letter:
            found[ch] = letter
    return found


def _fold8(letters: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Builder@8's letters beyond those of builder@7 (``letters`` and ``LETTER_RUNS``): the
    right-to-left confusables of the tag letters, and the letters named after one of them with
    a stroke, bar or hook; and the combining letters named after a letter that reads as one
    (U+0367, COMBINING LATIN SMALL LETTER U), each to the letter it is named after."""
    def reads_as(ch: str) -> str | None:
        bare = _bare(ch).lower()
        if len(bare) == 1 and bare in TAG_LETTERS:
            return bare
        return letters.get(ch) or letters.get(_bare(ch))
    known = set(letters) | set(_letter_runs())
    more: dict[str, str] = {}
    for letter in TAG_LETTERS:
        for ch in sorted(_single_rtl(letter) | _single_rtl(letter.upper())):
            if ch not in known and _bare(ch).lower() != letter:
                more.setdefault(ch, letter)
    combining: dict[str, str] = {}
    for code in range(0x110000):
        ch = chr(code)
        category = unicodedata.category(ch)
        if ch in known or ch in more or not (category.startswith("L") or category == "Mn"):
            continue
        base = _named_base(ch)
        letter = None if base is None else reads_as(base)
        if letter is None:
            continue
        if category == "Mn":
            combining[ch] = letter
        elif len(_bare(ch)) == 1 and reads_as(ch) != letter:  # not read so already
            more[ch] = letter
    return more, combining


def _dict_lines(name: str, readings: dict[str, str]) -> list[str]:
    """A generated dict, its entries in code point order."""
    return [f"{name} = {{", *(_entry(ch, reading) for ch, reading in sorted(readings.items())),
            "}"]


def _entry(ch: str, reading: str) -> str:
    """One line of a generated dict: the character escaped, what it reads as, its name."""
    code = f"\\U{ord(ch):08x}" if ord(ch) > 0xFFFF else f"\\u{ord(ch):04x}"
    return f'    "{code}": "{reading}",  # {unicodedata.name(ch, "?")}'


def _wrap(literal: str) -> str:
    body = literal[1:-1]
    chunks, line = [], ""
    i = 0
    while i < len(body):  # never split an escape
        j = i + (10 if body.startswith("\\U", i) else 6 if body.startswith("\\u", i) else 1)
        if len(line) + (j - i) > 80:
            chunks.append(line)
            line = ""
        line += body[i:j]
        i = j
    chunks.append(line)
    return "\n    ".join(f'"{c}"' for c in chunks)


def confusables_version() -> str:
    from importlib.metadata import version
    return version("confusable-homoglyphs")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the committed table differs from a new one")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} differs from what scripts/gen_lookalikes.py writes", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
