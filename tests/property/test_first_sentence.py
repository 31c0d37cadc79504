"""The deferred index's "first sentence of its description" (spec: the deferred tool index;
``items.first_sentence``) over generated descriptions: words of several scripts and cases,
abbreviations, initials, sentence marks, brackets balanced or not, white space of every kind.

- the sentence is a prefix of the description with its white space flattened, ending at a
  mark followed by a space, or the whole text;
- it never ends inside a parenthesis, bracket or brace the description closes later, nor after
  an abbreviation or an initial;
- on plain prose (sentences in any case, no abbreviation, no brackets) it is the sentence
  builder@8 cut, so a plan @8 pinned over such descriptions renders the same bytes under @9
  (``plan.SAME_BYTES``); and under ``FOLD_8`` it is @8's cut, whatever the text, which a plan
  @8 pinned is re-rendered with (``builder.load_plan``).
"""

from __future__ import annotations

import re

from context_engine.domain import ucd
from context_engine.domain.envelope import FOLD_8
from context_engine.domain.items import ABBREVIATIONS, first_sentence
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None)

WORDS = ["Search", "search", "the", "web", "Returns", "links", "API", "x", "N", "J", "Über",
         "über", "Ωmega", "ωmega", "日本", "42", "1.5", "e.g.", "i.e.", "E.g.", "etc.", "Dr.",
         "vs.", "No.", "U.S.", "approx.", "cf.", "Smith's", '"Quoted"', "'quoted'"]
MARKS = [".", "!", "?", "", "", ""]
SPACES = [" ", "  ", "\n", "\t", " \u3000 "]
PAIRS = {"(": ")", "[": "]", "{": "}"}


def old_rule(text: str) -> str:
    """builder@8's cut, written out: up to the first mark followed by a space or the end."""
    flat = " ".join(text.split())
    found = re.match(r".*?[.!?](?= |$)", flat)
    return found.group() if found else flat


@st.composite
def words(draw: st.DrawFn) -> str:
    return draw(st.sampled_from(WORDS)) + draw(st.sampled_from(MARKS))


@st.composite
def balanced(draw: st.DrawFn, depth: int = 0) -> str:
    """A description whose brackets are all balanced (groups nested up to three deep)."""
    parts: list[str] = []
    for _ in range(draw(st.integers(1, 8))):
        if depth < 3 and draw(st.integers(0, 4)) == 0:
            opening = draw(st.sampled_from(sorted(PAIRS)))
            parts.append(opening + draw(balanced(depth + 1)) + PAIRS[opening]
                         + draw(st.sampled_from(MARKS)))
        else:
            parts.append(draw(words()))
    return "".join(p + draw(st.sampled_from(SPACES)) for p in parts).strip()


anything = st.lists(st.one_of(words(), st.sampled_from(["(", ")", "[", "]", "{", "}", ". "])),
                    max_size=20).flatmap(
    lambda parts: st.tuples(*[st.sampled_from(SPACES) for _ in parts]).map(
        lambda spaces: "".join(p + s for p, s in zip(parts, spaces, strict=True))))


@SETTINGS
@given(anything)
def test_the_sentence_is_a_prefix_of_the_flattened_text_ending_at_a_mark(text: str) -> None:
    flat = " ".join(text.split())
    sentence = first_sentence(text)
    assert flat.startswith(sentence)
    if sentence != flat:
        assert sentence[-1] in ".!?" and flat[len(sentence)] == " "
        last = sentence.rsplit(" ", 1)[-1].lstrip("([{\"'\u201c\u2018")[:-1]
        if sentence[-1] == ".":  # not after an abbreviation or an initial
            assert ucd.lower(last) not in ABBREVIATIONS
            assert not re.fullmatch(r"[^\W\d_](\.[^\W\d_])+", last)
            assert not (len(last) == 1 and last.isupper())
    assert first_sentence(text) == sentence  # deterministic


@SETTINGS
@given(balanced())
def test_the_sentence_never_ends_inside_brackets_the_text_closes(text: str) -> None:
    sentence = first_sentence(text)
    for opening, closing in PAIRS.items():
        assert sentence.count(opening) == sentence.count(closing), (text, sentence)


@SETTINGS
@given(st.lists(st.lists(st.sampled_from(["Search", "the", "web", "links", "42", "Ωmega",
                                          "日本", "Returns"]), min_size=1, max_size=6)
                .flatmap(lambda ws: st.sampled_from([ws[0], ws[0].capitalize(),
                                                     ws[0].lower()])
                         .map(lambda first: " ".join([first, *ws[1:]]))), min_size=1,
                max_size=4),
       st.lists(st.sampled_from([".", "!", "?"]), min_size=4, max_size=4),
       st.sampled_from(SPACES))
def test_plain_prose_is_cut_as_builder8_cut_it(sentences: list[str], marks: list[str],
                                               space: str) -> None:
    """Whatever the case its sentences begin with: a description without abbreviations or
    brackets renders the bytes @8 rendered (``SAME_BYTES``)."""
    text = space.join(s + m for s, m in zip(sentences, marks, strict=False))
    assert first_sentence(text) == old_rule(text)


@SETTINGS
@given(st.one_of(anything, balanced()))
def test_builder8s_cut_is_kept_for_the_plans_it_pinned(text: str) -> None:
    assert first_sentence(text, FOLD_8) == old_rule(text)
