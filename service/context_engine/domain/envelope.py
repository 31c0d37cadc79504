"""Trust envelopes: attributed, nonced delimiters around content below TRUSTED_CONFIGURATION.

spec: "Every non-platform region is enveloped" (ARCHITECTURE.md "Trust envelopes"). The closing
marker carries a per-item nonce derived from the session key, the item id and a digest of the
content, and any occurrence of the delimiter syntax inside content is escaped at render time, so
content cannot close its own envelope even if it guesses the nonce.
"""

from __future__ import annotations

import functools
import re

from context_engine.domain import lookalikes, ucd
from context_engine.domain.canonical import canonical_sha256, sha256_hex
from context_engine.domain.trust import TrustLevel

TAGS: dict[TrustLevel, str] = {
    TrustLevel.USER: "user",
    TrustLevel.MEMORY: "memory",
    TrustLevel.EXTERNAL_UNTRUSTED: "untrusted",
}
TAG_NAMES = tuple(sorted(set(TAGS.values())))
NONCE_HEX = 16

# The escaping rule's fold, by the builder that introduced it. A pinned prefix was escaped with
# its builder's fold and is re-rendered with that fold (``builder.load_plan``); everything new
# is escaped with the current one.
FOLD_3 = 3  # builders before @4: lower-cased, then the look-alike table once
FOLD_4 = 4  # @4: the look-alike table before lower-casing too
FOLD_5 = 5  # @5: each character decomposed (NFKD) and stripped of its marks first, Unicode's
#             confusables of "<", "/" and the tag letters (``lookalikes``), "rn" read as "m"
FOLD_6 = 6  # @6: Unicode's tag characters (U+E0020-U+E007E) read both ways: dropped, as before,
#             and as the ASCII characters they encode (U+E003C as a "<"), as a reader that
#             decodes them sees them
FOLD_7 = 7  # @7: Unicode's confusables of strings read too: of a run of "<" as "<" (U+226A
#             "≪"), of a run of "/" and "\\" as "/" (U+2AFD), of tag letters as those letters
#             (U+11700 as "rn", read as "m"); and an envelope's attributes (its source and id)
#             escaped as its content is, after their ASCII escapes
FOLD_8 = 8  # @8: letters named after a tag letter with a stroke, bar or hook (U+00F8 "ø" as
#             "o"), Unicode's right-to-left confusables (U+0647, Arabic heh, as "o"), and the
#             combining letters (U+0367, COMBINING LATIN SMALL LETTER U) read both ways: dropped,
#             as before, and as the letters they are named after
FOLD_9 = 9  # @9: escapes as fold 8 does. The fold is Region A's rendering generation: @9 ends a
#             deferred index entry's first sentence where a sentence ends, not after "e.g."
#             or inside parentheses (``items.first_sentence``), so a prefix pinned before it is
#             re-rendered with the older entries, as with fold 8 (``builder.load_plan``)
FOLD_10 = 10  # @10: symbols named after a tag letter that no decomposition reads as it, each
#               read as its letter before it is decomposed: Unicode's enclosed letters
#               (U+1F184, NEGATIVE SQUARED LATIN CAPITAL LETTER U; U+24B0, PARENTHESIZED LATIN
#               SMALL LETTER U, "(u)" once decomposed) and regional indicators (U+1F1FA); and
#               symbols and punctuation named after "<" or "/" (U+22D6, LESS-THAN WITH
#               DOT)
FOLD = FOLD_10
FOLDS = (FOLD_10, FOLD_9, FOLD_8, FOLD_7, FOLD_6, FOLD_5, FOLD_4, FOLD_3)  # newest first

# Characters that read as "<" or "/" to a model (folds 3 and 4).
_LT_LIKE = ("<\uff1c\ufe64\u2039\u3008\u2329\u27e8\u276e\u02c2\u1438\u276c\u29fc\u2770"
            "\u3014\u27ea\u2991\u2993\u29d8\u1445\u2264\u227a")
# Letters from other scripts that read as the Latin letters of the tag names (a subset of
# Unicode's confusables, enough for "untrusted", "user" and "memory" in every case).
_CONFUSABLE = str.maketrans({
    # Cyrillic
    "\u0430": "a", "\u0435": "e", "\u043e": "o", "\u0440": "p", "\u0441": "c",
    "\u0443": "y", "\u0445": "x", "\u0455": "s", "\u0456": "i", "\u0457": "i",
    "\u043c": "m", "\u0442": "t", "\u0433": "r", "\u04bb": "h", "\u0501": "d",
    # Greek
    "\u03c5": "u", "\u03bf": "o", "\u03bd": "v", "\u03c4": "t", "\u03b5": "e",
    "\u03c1": "p", "\u03bc": "m", "\u03b9": "i",
    # Armenian
    "\u057d": "u", "\u0578": "n", "\u057c": "n", "\u0585": "o", "\u057a": "n",
    # Latin small capitals and other look-alikes
    "\u1d1c": "u", "\u0274": "n", "\u1d1b": "t", "\u0280": "r", "\ua731": "s",
    "\u1d07": "e", "\u1d05": "d", "\u1d0d": "m", "\u1d0f": "o", "\u028f": "y",
    "\u0131": "i", "\u0261": "g", "\u01b4": "y", "\u13e7": "d",
    # more letters of other scripts and symbols that read as u, n, o or y
    "\ua4f4": "u", "\u222a": "u", "\u03b7": "n", "\u101d": "o", "\u0966": "o",
    "\u03b3": "y", "\u04af": "y",
})
# Characters that read as "/"; a backslash too, as in the escaped form "<\\/untrusted".
_SLASH_LIKE = "/\\\uff0f\u2044\u2215\u29f8\u2571\ufe68\uff3c\u30ce\u2f03\u4e3f"
# Unicode's tag characters that encode the printable ASCII characters, each at U+E0000 above
# the character it encodes (U+E0020 to U+E007E): a reader may drop them, as invisible, or
# decode them (from fold 6 both readings are escaped).
_TAG_FIRST, _TAG_LAST, _TAG_OFFSET = "\U000e0020", "\U000e007e", 0xE0000
_TAG_LT = "\U000e003c"
# What each fold reads as "<" (folds 3 and 4 read the same characters).
_LT_SETS = {FOLD_3: _LT_LIKE, FOLD_4: _LT_LIKE, FOLD_5: lookalikes.LT_LIKE,
            FOLD_6: lookalikes.LT_LIKE + _TAG_LT,
            FOLD_7: lookalikes.LT_LIKE + _TAG_LT + lookalikes.LT_RUN_LIKE,
            FOLD_8: lookalikes.LT_LIKE + _TAG_LT + lookalikes.LT_RUN_LIKE + lookalikes.LT_LIKE_8}
_LT_RES = {fold: re.compile(f"[{re.escape(lt)}]") for fold, lt in _LT_SETS.items()}
_CONFUSABLE_5 = str.maketrans({**{chr(k): v for k, v in _CONFUSABLE.items()
                                  if isinstance(v, str)}, **lookalikes.LETTERS})
_SLASH_LIKE_5 = frozenset(lookalikes.SLASH_LIKE)
_CONFUSABLE_7 = {**_CONFUSABLE_5, **str.maketrans(lookalikes.LETTER_RUNS)}
_SLASH_LIKE_7 = _SLASH_LIKE_5 | frozenset(lookalikes.SLASH_RUN_LIKE)
_CONFUSABLE_8 = {**_CONFUSABLE_7, **str.maketrans(lookalikes.LETTERS_8)}
_SLASH_LIKE_8 = _SLASH_LIKE_7 | frozenset(lookalikes.SLASH_LIKE_8)
# The readings a fold takes of the characters read two ways (``_opens_delimiter``): a tag
# character decoded (from fold 6), a combining letter read as its letter (from fold 8).
_DECODE_TAGS, _DECODE_MARKS = 1, 2
_MARKS = frozenset(("Mn", "Me"))
# Rendered as nothing, or as blank, although not format characters.
_BLANK_LETTERS = frozenset("\u034f\u115f\u1160\u3164\uffa0\u180e\u2800")
# Escaping asks the same questions of the same characters again and again (text dense in "<"
# look-alikes asks at every character, and folding one takes microseconds): each answer is
# kept, per character or per folded name (a few letters), up to this many: more than the
# distinct characters of any script's text (at 4,096, text cycling through 5,000 CJK
# ideographs after "<" missed at every step and ran slower than no cache; an entry is a few
# hundred bytes, so each cache holds at most a few MB)
_CACHED = 65_536


def _invisible(ch: str) -> bool:
    """White space, control characters (a reader may drop them), format characters
    (zero-width, bidi controls, tags: from fold 6 also read decoded, ``_opens_delimiter``),
    combining marks, variation selectors and blank letters: folded away when deciding whether
    text is a delimiter."""
    if ucd.isspace(ch) or ch in _BLANK_LETTERS:
        return True
    code = ord(ch)
    if 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF:
        return True
    # format characters, and combining marks that would decorate the next visible character
    return ucd.category(ch) in ("Cc", "Cf", "Mn", "Me")


@functools.lru_cache(maxsize=_CACHED)
def _could_be_tag(name: str, fold: int = FOLD) -> bool | None:
    """True once ``name`` (the folded text after the slashes) starts with a tag name, False
    once it cannot, None while it is still a prefix of one. From fold 5, "rn" reads as "m"
    (no tag name holds "rn"), and a trailing "r" may still begin one."""
    names = [name]
    if fold >= FOLD_5:
        names = [name.replace("rn", "m")]
        if name.endswith("r"):
            names.append(name[:-1].replace("rn", "m") + "m")
    if any(n.startswith(tag) for n in names for tag in TAG_NAMES):
        return True
    if any(tag.startswith(n) for n in names for tag in TAG_NAMES):
        return None
    return False


def _bare(text: str) -> str:
    """``text`` decomposed (NFKD) without its combining marks: "ü" is "u", "≮" is "<"."""
    return "".join(c for c in ucd.decompose(text) if ucd.category(c) not in _MARKS)


# What each fold from 5 on reads as "/" and the letters it reads other characters as: fold 6
# reads as fold 5 does (it only adds a reading of tag characters); fold 7 adds Unicode's
# confusables of runs of slashes and of strings of tag letters; fold 8 the letters named after
# a tag letter (a stroke, a bar, a hook) and Unicode's right-to-left confusables.
_FOLD_TABLES = {FOLD_5: (_SLASH_LIKE_5, _CONFUSABLE_5), FOLD_6: (_SLASH_LIKE_5, _CONFUSABLE_5),
                FOLD_7: (_SLASH_LIKE_7, _CONFUSABLE_7), FOLD_8: (_SLASH_LIKE_8, _CONFUSABLE_8)}


def _fold(ch: str, fold: int) -> str:
    """One character as ``fold`` (5 or later) reads it: "/" for anything slash-like, else its
    bare form through the fold's look-alike table, lower-cased, and bare again (a capital may
    lower to a letter and a mark). From fold 10 a symbol named after a tag letter is that
    letter before it is decomposed (``_BEFORE_BARE``)."""
    slashes, letters = _FOLD_TABLES[fold]
    bare = _bare(ch.translate(_BEFORE_BARE[fold]) if fold in _BEFORE_BARE else ch)
    if bare in slashes:
        return "/"
    return _bare(ucd.lower(bare.translate(letters)).translate(letters))


def plain_name(name: str) -> bool:
    """Whether ``name`` can be written as the platform's own text: nothing in it reads as an
    envelope tag once folded (``escape_general`` leaves it as it is) and it holds no blank
    letter (a letter rendered as blank space)."""
    return escape_general(name) == name and not any(c in _BLANK_LETTERS for c in name)


def nonce(session_key: str, item_id: str, content: str) -> str:
    """Deterministic per-item nonce: truncated SHA-256 over session key, id and content digest."""
    return canonical_sha256([session_key, item_id, sha256_hex(content)])[:NONCE_HEX]


def _tag(ch: str) -> bool:
    """Whether ``ch`` is a tag character that encodes a printable ASCII character."""
    return _TAG_FIRST <= ch <= _TAG_LAST


@functools.lru_cache(maxsize=_CACHED)
def _reading(ch: str, fold: int, decoded: int = 0) -> str | None:
    """One character as ``fold`` reads it after a "<": None when it is invisible, "/" when
    slash-like, else its folded letters. ``decoded``: the readings that take a character
    otherwise than dropped (``_DECODE_TAGS``: a tag character as the ASCII character it
    encodes, from fold 6; ``_DECODE_MARKS``: a combining letter as the letter it is named
    after, from fold 8)."""
    if decoded & _DECODE_TAGS and _tag(ch):
        ch = chr(ord(ch) - _TAG_OFFSET)
    elif decoded & _DECODE_MARKS and fold >= FOLD_8 and ch in lookalikes.COMBINING_LETTERS:
        ch = lookalikes.COMBINING_LETTERS[ch]
    if _invisible(ch):
        return None
    if fold >= FOLD_5:
        return _fold(ch, fold)
    if ch in _SLASH_LIKE:
        return "/"
    if fold == FOLD_3:
        return ucd.lower(ucd.compose(ch)).translate(_CONFUSABLE)
    # the table before lower-casing too: a capital in it (U+13E7) lowers past it
    return ucd.lower(ucd.compose(ch).translate(_CONFUSABLE)).translate(_CONFUSABLE)


@functools.lru_cache(maxsize=_CACHED)
def _step(name: str, ch: str, fold: int, decoded: int = 0) -> str | bool:
    """One step of ``_scan``, kept per ``name`` (the folded text after the slashes so far) and
    character: the name it reads on to, or the verdict once settled."""
    piece = _reading(ch, fold, decoded)
    if piece is None:
        return name
    if not name:
        piece = piece.lstrip("/")
        if not piece:
            return name  # still the slashes
    name += piece
    verdict = _could_be_tag(name, fold)
    return name if verdict is None else verdict


def _opens_delimiter(text: str, start: int, fold: int = FOLD) -> bool:
    """Does the "<"-like character at ``start`` begin an envelope tag once look-alikes,
    invisible characters, white space and letter case are folded away? There is no window:
    any amount of invisible padding is skipped. Each scan stops at the first character that
    settles the question (another "<" does), and what it keeps is the few letters after the
    slashes, so escaping stays linear in the length of the content.

    From fold 6 a tag character is read both ways a reader may take it: dropped (as any
    invisible character) and decoded to the ASCII character it encodes, so a marker spelled
    partly or wholly in tag characters is escaped too; the second reading is scanned only when
    the first met a tag character before it settled (until then the two read alike). A tag
    "<" (U+E003C) opens only the decoding reading: dropped, it is no "<".

    From fold 8 a combining letter named after a letter (U+0367, COMBINING LATIN SMALL LETTER
    U) is read both ways too, each on its own: dropped, and as that letter, so a reader that
    drops one and reads the next is followed too (``_scan``).

    ``fold``: ``FOLD`` escapes everything new; an older one (``FOLD_9`` to ``FOLD_3``) only
    re-renders a plan its builder pinned (``builder.load_plan``)."""
    if fold < FOLD_6:
        return _scan(text, start, fold, decoded=0)[0]
    if text[start] == _TAG_LT:
        return _scan(text, start, fold, decoded=_DECODE_TAGS)[0]
    opens, met_tag = _scan(text, start, fold, decoded=0)
    return opens or (met_tag and _scan(text, start, fold, decoded=_DECODE_TAGS)[0])


def _scan(text: str, start: int, fold: int, *, decoded: int) -> tuple[bool, bool]:
    """One reading of ``_opens_delimiter``: whether the "<" at ``start`` opens a delimiter, and
    whether a tag character was met before that was settled. From fold 8 each combining
    letter (``lookalikes.COMBINING_LETTERS``) is both dropped and read as its letter, every
    choice followed at once: what the scan keeps is the set of names read so far, each a
    prefix of a tag name (one before fold 8), so a few at most: still linear."""
    names = {""}  # the folded text after the leading slashes: at most a tag name long
    met_tag = False
    for i in range(start + 1, len(text)):
        ch = text[i]
        met_tag = met_tag or _tag(ch)
        ways = ((decoded, decoded | _DECODE_MARKS)
                if fold >= FOLD_8 and ch in lookalikes.COMBINING_LETTERS else (decoded,))
        after: set[str] = set()
        for name in names:
            for way in ways:
                step = _step(name, ch, fold, way)
                if step is True:
                    return True, met_tag
                if step is not False:
                    after.add(step)
        if not after:
            return False, met_tag
        names = after
    return False, met_tag


def escape_general(content: str, *, fold: int = FOLD) -> str:
    """The escaping rule, for any text: every "<"-like character that opens a delimiter once
    folded (``_opens_delimiter``) becomes the entity ``&lt;``."""
    if not _LT_RES[fold].search(content):
        return content
    out: list[str] = []
    last = 0
    for match in _CANDIDATES[fold].finditer(content):
        i = match.start()
        if _opens_delimiter(content, i, fold):
            out.append(content[last:i])
            out.append("&lt;")
            last = i + 1
    out.append(content[last:])
    return "".join(out)


# Fold 9 escapes as fold 8 does (``FOLD_9``): it reads fold 8's tables.
_LT_SETS[FOLD_9], _LT_RES[FOLD_9] = _LT_SETS[FOLD_8], _LT_RES[FOLD_8]
_FOLD_TABLES[FOLD_9] = _FOLD_TABLES[FOLD_8]
# Fold 10 reads as fold 9 does, with the symbols and punctuation named after "<" or "/"
# (``lookalikes.LT_LIKE_10``, ``SLASH_LIKE_10``) and those named after a tag letter
# (``lookalikes.LETTERS_10``), which it reads as their letters before decomposing them:
# U+24B0, PARENTHESIZED LATIN SMALL LETTER U, decomposes to "(u)", never read as a "u".
_LT_SETS[FOLD_10] = _LT_SETS[FOLD_9] + lookalikes.LT_LIKE_10
_LT_RES[FOLD_10] = re.compile(f"[{re.escape(_LT_SETS[FOLD_10])}]")
_FOLD_TABLES[FOLD_10] = (_SLASH_LIKE_8 | frozenset(lookalikes.SLASH_LIKE_10), _CONFUSABLE_8)
_BEFORE_BARE = {FOLD_10: str.maketrans(lookalikes.LETTERS_10)}


# The same rule on ASCII text, as one regex pass. It is derived from the fold, not written
# beside it: in ASCII the only invisible characters are those ``_invisible`` says are (white
# space, including the separators \x1c-\x1f), the only slash-like ones are "/" and "\\", and
# folding is lower-casing (from fold 5 also "0" as "o", and "rn" as "m"). So a delimiter is
# "<", any run of invisible and slash-like characters, then a tag name with invisible
# characters anywhere between its letters. A property test holds the two paths to identical
# output.
_ASCII_INVISIBLE = "".join(c for c in map(chr, range(128)) if _invisible(c))
_ASCII_SLASHES = "".join(c for c in _SLASH_LIKE if c.isascii())
_W = "[" + re.escape(_ASCII_INVISIBLE) + "]*"
# fold 5: each letter of a tag name as the ASCII characters that fold to it
_ASCII_LETTERS_5 = {letter: "|".join(
    [re.escape(letter)] + [re.escape(c) for c, to in lookalikes.LETTERS.items()
                           if c.isascii() and to == letter]
    + (["r" + _W + "n"] if letter == "m" else [])) for letter in set("".join(TAG_NAMES))}


def _ascii_delimiter(fold: int) -> re.Pattern[str]:
    def letter(c: str) -> str:
        return f"(?:{_ASCII_LETTERS_5[c]})" if fold >= FOLD_5 else re.escape(c)
    return re.compile(
        "<(?=[" + re.escape(_ASCII_INVISIBLE + _ASCII_SLASHES) + "]*(?:"
        + "|".join(_W.join(letter(c) for c in name) for name in TAG_NAMES) + "))",
        re.IGNORECASE | re.ASCII)


_ASCII_DELIMITER = {fold: _ascii_delimiter(fold) for fold in FOLDS}
# An ASCII character after "<" that is not invisible, slash-like or what the first letter of a
# tag name folds from (from fold 5, "r" too: it may begin "rn", read as "m"): that "<" cannot
# open a delimiter.
_FIRST = {name[0] for name in TAG_NAMES}
_FIRST_5 = _FIRST | {c for c, to in lookalikes.LETTERS.items() if c.isascii() and to in _FIRST}
_CANNOT_OPEN = {fold: frozenset(
    c for c in map(chr, range(1, 128))
    if c not in _ASCII_INVISIBLE and c not in _ASCII_SLASHES
    and ucd.lower(c) not in (_FIRST_5 | {"r"} if fold >= FOLD_5 else _FIRST)) for fold in FOLDS}


def _candidates(fold: int) -> re.Pattern[str]:
    """The "<"-like characters ``escape_general`` must look at: not those followed by a
    character that settles it without folding (most "<" in HTML) nor by another "<"-like one
    that settles it (every one does: a run of them is passed over in one regex step, not one
    fold at a time)."""
    lt = _LT_SETS[fold]
    settling = "".join(sorted(_CANNOT_OPEN[fold])) + "".join(
        c for c in lt if _step("", c, fold) is False and _step("", c, fold, True) is False)
    if _TAG_LT not in lt:
        return re.compile(f"[{re.escape(lt)}](?![{re.escape(settling)}])")
    # a tag "<" opens only the decoding reading: what settles that one settles it (a run of
    # tag "<" among them, passed over in one regex step as a run of "<" is)
    decoded = settling + "".join(c for c in lt if _step("", c, fold, True) is False)
    others = "".join(c for c in lt if c != _TAG_LT)
    return re.compile(f"[{re.escape(others)}](?![{re.escape(settling)}])"
                      f"|{re.escape(_TAG_LT)}(?![{re.escape(decoded)}])")


_CANDIDATES = {fold: _candidates(fold) for fold in FOLDS}


def escape_content(content: str, *, fold: int = FOLD) -> str:
    """Neutralize every delimiter-like sequence: its "<" becomes the entity ``&lt;``. ASCII
    text takes the one-pass form of the same rule (``escape_general`` is the rule; the two
    agree on ASCII)."""
    if content.isascii():
        return _ASCII_DELIMITER[fold].sub("&lt;", content)
    return escape_general(content, fold=fold)


def escape_attr(value: str) -> str:
    return (value.replace("&", "&amp;").replace('"', "&quot;")
            .replace("<", "&lt;").replace(">", "&gt;").replace("\n", " "))


def envelope(*, trust: TrustLevel, source: str, item_id: str, content: str,
             session_key: str, fold: int = FOLD) -> str:
    """Render ``content`` inside its envelope. Trust at or above TRUSTED_CONFIGURATION is
    returned unchanged: it is not data but configuration or platform text. ``fold``: as
    ``_opens_delimiter``."""
    if not trust.enveloped:
        return content
    tag = TAGS[trust]
    n = nonce(session_key, item_id, content)
    source, item_id = escape_attr(source), escape_attr(item_id)
    if fold >= FOLD_7:  # a look-alike in an attribute no longer reads as a tag either
        source, item_id = escape_general(source, fold=fold), escape_general(item_id, fold=fold)
    return (f'<{tag} source="{source}" id="{item_id}" '
            f'nonce="{n}">\n{escape_content(content, fold=fold)}\n</{tag}:{n}>')
