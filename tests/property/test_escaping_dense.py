"""Escaping text dense in "<" look-alikes (gate_trust).

Each non-ASCII "<" look-alike once cost a fold of the character after it
(NFKD, the look-alike table, lower-casing: about 7 microseconds), so one 16 MiB item of "≤"
held a Build for some 44 s against 0.3 s for plain text. The scan's steps are now kept per
character, and a run of look-alikes is passed over in one regex step. The output must be the
same bytes as before: ``reference`` below is the scan as it was written before (each "<"-like
character scanned on its own, every character folded anew), held against ``escape_general``
over generated text, for the older folds pinned plans are re-rendered with; and the folds from
builder@8's (which read Unicode's tag characters both dropped and decoded, Unicode's
confusables of strings, and combining letters both dropped and as letters; builder@10's
symbols named after a tag letter, "<" or "/" too) against that scan run over the text every
way.
"""

from __future__ import annotations

import signal
import unicodedata

import pytest
from context_engine.domain import envelope as E
from context_engine.domain import lookalikes
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import envelope_parser as P

pytestmark = pytest.mark.gate_trust


def _reference_opens(text: str, start: int, fold: int) -> bool:
    name = ""
    for i in range(start + 1, len(text)):
        ch = text[i]
        if E._invisible(ch):
            continue
        if fold >= E.FOLD_5:
            piece = E._fold(ch, fold)
        elif ch in E._SLASH_LIKE:
            piece = "/"
        elif fold == E.FOLD_3:
            piece = unicodedata.normalize("NFKC", ch).lower().translate(E._CONFUSABLE)
        else:
            piece = (unicodedata.normalize("NFKC", ch)
                     .translate(E._CONFUSABLE).lower().translate(E._CONFUSABLE))
        if not name:
            piece = piece.lstrip("/")
            if not piece:
                continue
        name += piece
        verdict = E._could_be_tag.__wrapped__(name, fold)
        if verdict is not None:
            return verdict
    return False


def reference(content: str, fold: int) -> str:
    if fold >= E.FOLD_6:
        return reference_6(content, fold)
    lt = E._LT_LIKE if fold < E.FOLD_5 else lookalikes.LT_LIKE
    return "".join("&lt;" if ch in lt and _reference_opens(content, i, fold) else ch
                   for i, ch in enumerate(content))


def _reference_opens_8(text: str, start: int, fold: int) -> bool:
    """Fold 8's scan (and a later ``fold``'s) written as a search: at each combining letter
    (U+0367) both ways are followed, dropped and as the letter it is named after; each
    character folded anew."""
    seen: set[tuple[int, str]] = set()

    def go(i: int, name: str) -> bool:
        while i < len(text):
            ch = text[i]
            if ch in lookalikes.COMBINING_LETTERS:
                if (i, name) in seen:
                    return False
                seen.add((i, name))
                read = _reference_step(name, lookalikes.COMBINING_LETTERS[ch], fold)
                if read is True or (isinstance(read, str) and go(i + 1, read)):
                    return True
                i += 1  # dropped, as a mark
                continue
            read = _reference_step(name, ch, fold)
            if isinstance(read, bool):
                return read
            name = read
            i += 1
        return False

    return go(start + 1, "")


def _reference_step(name: str, ch: str, fold: int) -> str | bool:
    if E._invisible(ch):
        return name
    piece = E._fold(ch, fold)
    if not name:
        piece = piece.lstrip("/")
        if not piece:
            return name
    name += piece
    verdict = E._could_be_tag.__wrapped__(name, fold)
    return name if verdict is None else verdict


def reference_6(content: str, fold: int) -> str:
    """Fold 5's scan (fold 7's for fold 7) over the text as it is (tag characters invisible)
    and over the text with tag characters decoded (one character each, so positions agree): a
    "<" look-alike is escaped when either reading opens a tag there, a tag "<" (U+E003C) when
    the decoded one does. Fold 7 reads the confusables of runs of "<" as "<" too; fold 8 reads
    each combining letter both dropped and as its letter, one by one; fold 10 the symbols
    named after "<" as "<" too."""
    decoded = P.decode_tags(content)
    reading = E.FOLD_5 if fold == E.FOLD_6 else fold
    lt = (lookalikes.LT_LIKE + (lookalikes.LT_RUN_LIKE if fold >= E.FOLD_7 else "")
          + (lookalikes.LT_LIKE_8 if fold >= E.FOLD_8 else "")
          + (lookalikes.LT_LIKE_10 if fold >= E.FOLD_10 else ""))

    def opens_at(text: str, i: int) -> bool:
        return (_reference_opens_8(text, i, fold) if fold >= E.FOLD_8
                else _reference_opens(text, i, reading))

    out = []
    for i, ch in enumerate(content):
        if ch in lt:
            opens = opens_at(content, i) or opens_at(decoded, i)
        else:
            opens = ch == "\U000e003c" and opens_at(decoded, i)
        out.append("&lt;" if opens else ch)
    return "".join(out)


PIECES = ("<", "\u2264", "\uff1c", "\u2039", "\u16b2", "\u226e", "/", "\\", "\uff0f",
          "u", "U", "\u00fc", "\u028b", "n", "t", "r", "rn", "s", "e", "d", "m", "M", "\u043c",
          "o", "0", "y", "\u0443", "ntrusted", "ser", "emory", " ", "\n", "\u200b", "\u0301",
          "a", "\u00e9", "b>", ":0123456789abcdef>", "&lt;",
          # confusables of strings (builder@7): "<<", "//", "\\\\", "rn", "oo"
          "\u226a", "\u2afd", "\u244a", "\U00011700", "\ua74f",
          # builder@8: letters with a stroke or bar, a right-to-left "o", combining letters
          "\u00f8", "\u0111", "\u0289", "\u0647", "\u0367", "\u1de4", "\u036b", "\u0366",
          # builder@10: enclosed letters (negative squared and circled, parenthesized),
          # regional indicators, "<" and "/" as named
          "\U0001f184", "\U0001f182", "\U0001f15c", "\u24b0", "\u24ae", "\U0001f124",
          "\U0001f1fa", "\U0001f1f8", "\U0001f1ea", "\u22d6", "\u2a79", "\u29f6",
          # tag characters: "<", "/", "u", "U", "m", "s", "e", "r", a space, CANCEL TAG
          "\U000e003c", "\U000e002f", "\U000e0075", "\U000e0055", "\U000e006d",
          "\U000e0073", "\U000e0065", "\U000e0072", "\U000e0020", "\U000e007f")


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=40)
       .map("".join), st.sampled_from(E.FOLDS))
def test_escaping_gives_the_bytes_it_gave_before_it_was_made_fast(text: str, fold: int) -> None:
    assert E.escape_general(text, fold=fold) == reference(text, fold)


@pytest.mark.parametrize("fold", E.FOLDS)
def test_runs_of_look_alikes_give_the_bytes_they_gave_before(fold: int) -> None:
    for text in ("\u2264" * 50 + "/untrusted>", "\u2264\u00fc" * 20 + "ntrusted",
                 "<" * 30 + "\u00e9</user>", "\uff1c" * 10 + "\u200b/memory",
                 "a\u2264", "\u2264", "\u2264" * 5 + "r" + "n" + "emory",
                 "\U000e003c" * 5 + "\U000e002fuser", "<" * 5 + "\U000e002f\U000e0075ser"):
        assert E.escape_general(text, fold=fold) == reference(text, fold), text


def test_text_dense_in_look_alikes_escapes_in_about_the_time_of_plain_text() -> None:
    """1.5 million "≤" (4.5 MB) and 400,000 "≤ü" (each "ü" reads as "u", a tag's first letter,
    so its "≤" is scanned on): well under a second each here, about 15 s and 3 s when every
    character was folded anew. The alarm stops a regression rather than waiting for it."""

    def too_slow(signum: int, frame: object) -> None:
        raise TimeoutError("escaping text dense in '<' look-alikes is slow")

    previous = signal.signal(signal.SIGALRM, too_slow)
    # each text under its own alarm: the dense one takes about 0.05 s here and 5 s when every
    # character was folded anew, so 2 s parts the two by a wide margin either way (one alarm
    # of 5 s over both let that regression pass on a faster run)
    try:
        signal.alarm(2)
        dense = "\u2264" * 1_500_000
        assert E.escape_content(dense) == dense
        signal.alarm(5)
        pairs = "\u2264\u00fc" * 400_000
        assert E.escape_content(pairs) == pairs
    except TimeoutError as exc:
        # failed without the interrupted frames (one may carry no line number, which pytest's
        # report of the traceback cannot print)
        pytest.fail(str(exc), pytrace=False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_run_of_tag_lt_is_passed_over_without_a_scan_each(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A tag "<" (U+E003C) followed by another settles its only reading (the decoded one):
    each was scanned on its own, about a microsecond a character (16 MiB of them, 4.6 s of one
    event loop). Counted, not timed: only the last of a run is looked at."""
    scanned: list[int] = []
    opens = E._opens_delimiter

    def counted(text: str, start: int, fold: int = E.FOLD) -> bool:
        scanned.append(start)
        return opens(text, start, fold)

    monkeypatch.setattr(E, "_opens_delimiter", counted)
    run = "\U000e003c" * 10_000
    assert E.escape_general(run + "x") == run + "x"
    assert len(scanned) <= 1
    scanned.clear()
    marker = run + "\U000e002f\U000e0075ntrusted:0123456789abcdef>"
    assert E.escape_general(marker) == run[:-1] + "&lt;" + marker[len(run):]
    assert scanned == [len(run) - 1]
