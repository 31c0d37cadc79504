"""The response side of incremental Build, piece by piece: the byte spans of a JSON body (cut
on UTF-8 character boundaries, read back exactly) and the message spans found by identity and,
failing that, by value (a history cut that moved forward starts past the base's first messages).
Read back by tests/support/delta.py's independent reading of the contract."""

from __future__ import annotations

from types import SimpleNamespace

from context_engine.api.incremental import BaseLookup, message_spans, text_spans
from context_engine.build_cache import BuildBase
from context_engine.domain.request import Message, Role
from context_engine.domain.trust import TrustLevel
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.delta import _text


def spans(found: list[tuple[int, int, int]]) -> list[SimpleNamespace]:
    return [SimpleNamespace(base_start=s, base_count=c, new_count=n) for s, c, n in found]


def read_back(base: str, new: str) -> str:
    found, sent = text_spans(base.encode(), new.encode())
    return _text(spans(found), base, sent)


def test_a_multibyte_character_at_the_cut_is_never_split() -> None:
    base = '{"messages":["日本語 first"],"x":1}'
    new = '{"messages":["日本人 first","✓ second"],"x":1}'
    found, sent = text_spans(base.encode(), new.encode())
    assert found and found[0][1] > 0  # a head is shared
    assert sent.encode() in new.encode()
    assert read_back(base, new) == new


def test_characters_sharing_a_lead_or_a_last_byte_stay_whole() -> None:
    # é and è share their lead byte (C3), ā and Á their last (81): a cut by bytes alone would
    # end the shared head, or start the shared tail, inside a character
    for base, new in (("xé", "xè"), ("āx", "Áx"), ("{é}", "{è}"), ("é", "è")):
        _found, sent = text_spans(base.encode(), new.encode())
        assert sent == new[len(new) - len(sent):] or sent in new
        assert read_back(base, new) == new


ALPHABET = "ab日✓éèāÁ{}\""


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40), st.text(alphabet=ALPHABET, max_size=40),
       st.text(alphabet=ALPHABET, max_size=40), st.text(alphabet=ALPHABET, max_size=40))
def test_any_body_reads_back_exactly(head: str, mid_a: str, mid_b: str, tail: str) -> None:
    base, new = head + mid_a + tail, head + mid_b + tail
    assert read_back(base, new) == new
    assert read_back(new, base) == base


def test_long_bodies_are_compared_chunk_by_chunk() -> None:
    base = "é" * 200_000 + "x" + "ü" * 100_000
    new = "é" * 200_000 + "yz" + "ü" * 100_000
    _found, sent = text_spans(base.encode(), new.encode())
    assert sent == "yz"
    assert read_back(base, new) == new


def msg(text: str) -> Message:
    return Message(row=10, role=Role.USER, trust=TrustLevel.USER, item_id=text, text=text)


def base_of(messages: tuple[Message, ...], indexed: bool = False) -> BuildBase:
    """A base of ``messages`` (``indexed``: its index already built, as after a response that
    looked up more messages than the lookup scans for)."""
    return BuildBase(tenant_id="t", session_id="s", incarnation=1, build_id="b", items=(),
                     item_bytes=(0,), messages=messages, message_entries=(), prefix=((), ()),
                     prefix_bytes=0, texts=(b"", b"", b""), response_bytes=0,
                     positions=BuildBase.index(messages) if indexed else None)


def test_a_cut_that_moved_forward_starts_past_the_base_s_first_messages() -> None:
    held = tuple(msg(f"m{i}") for i in range(6))
    base = base_of(held)
    now = [*held[2:5], msg("changed"), msg("new")]
    found, sent = message_spans(base, now)
    assert found == [(2, 3, 2)] and sent == [3, 4]
    # read back
    got = [x for s, c, n in found for x in (*held[s:s + c], *[now[j] for j in sent][:n])]
    assert got == now


def test_a_message_rendered_again_is_matched_by_value() -> None:
    held = tuple(msg(f"m{i}") for i in range(4))
    base = base_of(held)
    again = [held[0], msg("m1"), msg("m2"), held[3]]  # equal values, other objects
    found, sent = message_spans(base, again)
    assert found == [(0, 4, 0)] and sent == []
    # a copy matched by value, then a run of the base's own objects: the span takes the run
    mixed = [held[0], msg("m1"), held[2], held[3]]
    assert message_spans(base, mixed) == ([(0, 4, 0)], [])


def test_nothing_in_common_sends_everything_without_spans() -> None:
    base = base_of(tuple(msg(f"m{i}") for i in range(3)))
    found, sent = message_spans(base, [msg("x"), msg("y")])
    assert found == [] and sent == [0, 1]


def walked_spans(base: BuildBase, messages: list[Message]
                 ) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The reference: ``message_spans`` one message at a time (its definition: a message is
    copied when it is the very base message after the one copied just before it, or one of
    the base's (its last position), or equals the base message after the one copied just
    before it; consecutive copies extend a span; a message sent counts in the span
    before)."""
    where = {id(m): i for i, m in enumerate(base.messages)}
    spans: list[list[int]] = []
    sent: list[int] = []
    expect = -1
    for j, m in enumerate(messages):
        follows = 0 <= expect < len(base.messages)
        i = expect if follows and base.messages[expect] is m else where.get(id(m))
        if i is None and follows and base.messages[expect] == m:
            i = expect
        if i is None:
            if not spans:
                spans.append([0, 0, 0])
            spans[-1][2] += 1
            sent.append(j)
            expect = -1
            continue
        if spans and spans[-1][2] == 0 and i == spans[-1][0] + spans[-1][1]:
            spans[-1][1] += 1
        else:
            spans.append([i, 1, 0])
        expect = i + 1
    if not any(c for _, c, _ in spans):
        return [], list(range(len(messages)))
    return [(s, c, n) for s, c, n in spans], sent


MIXES = (st.integers(0, 12), st.integers(0, 14), st.booleans(),
         st.lists(st.tuples(st.sampled_from(("run", "held", "again", "new")),
                            st.integers(0, 14)), max_size=16))


def drawn(held_count: int, lead: int, twice: bool, picks: list[tuple[str, int]]
          ) -> tuple[BuildBase, list[Message]]:
    """A base and a mix of its own messages (the first ``lead`` of them first, in place: the
    usual Build), equal copies and new messages; ``twice``: the base holds one object twice."""
    held = tuple(msg(f"m{i % 5}") for i in range(held_count))  # equal values repeat
    if twice and held:
        held = (*held, held[held_count // 2], *held[:1])
    base = base_of(held)
    now: list[Message] = list(held[:lead])
    for kind, k in picks:
        if kind == "run" and held:
            now += held[k % held_count:k % held_count + 1 + k % 4]
        elif kind == "held" and held:
            now.append(held[k % held_count])
        elif kind == "again":
            now.append(msg(f"m{k % 5}"))
        else:
            now.append(msg(f"new{k}"))
    return base, now


@settings(max_examples=800, deadline=None)
@given(*MIXES)
def test_message_spans_are_the_walks(held_count: int, lead: int, twice: bool,
                                     picks: list[tuple[str, int]]) -> None:
    """Any mix of the base's own messages (runs of consecutive ones, single ones, repeats, out
    of order; its first ones in place), equal copies of them (matched only right after a copy
    of the one before) and new messages, over bases that hold an object twice or do not, with
    their index built before or not (looked up by scans, then by the index)."""
    base, now = drawn(held_count, lead, twice, picks)
    expected = walked_spans(base, now)
    assert message_spans(base, now) == expected
    assert message_spans(base_of(base.messages, indexed=True), now) == expected


def test_a_turn_appended_sends_only_the_turn() -> None:
    """The usual Build: the cut moved on (the history starts further into the base), a turn
    appended, the row after the history as before: found by scans, the base's index never
    built."""
    held = tuple(msg(f"m{i}") for i in range(40))
    base = base_of(held)
    now = [*held[5:39], msg("call"), msg("result"), held[39]]
    assert message_spans(base, now) == ([(5, 34, 2), (39, 1, 0)], [34, 35])
    assert base.positions is None
    past = [*held[30:], msg("after the base's last")]  # from inside the base past its end
    assert message_spans(base, past) == ([(30, 10, 1)], [10]) == walked_spans(base, past)
    many = [*held[5:39], *(msg(f"new{i}") for i in range(50)), held[39], held[0], held[20]]
    assert message_spans(base, many) == walked_spans(base, many)
    assert base.positions is None  # the base holds each object once: no index
    twice = base_of((*held, held[3]))
    assert message_spans(twice, many) == walked_spans(twice, many)
    assert twice.positions == BuildBase.index(twice.messages)  # held twice: the index


def test_a_message_the_base_holds_twice_is_found_at_its_last_position() -> None:
    held = tuple(msg(f"m{i}") for i in range(6))
    twice = (*held, held[1])
    for base in (base_of(twice), base_of(twice, indexed=True)):
        find = BaseLookup(base)
        assert find(held[1]) == 6 and find(held[0]) == 0 and find(msg("m2")) is None
    once = BaseLookup(base_of(held))
    for hint in range(7):  # found before the hint as after it
        assert [once(m, hint) for m in held] == list(range(6))
    # a copy that continues the run takes the object there, not its last position
    assert message_spans(base_of(twice), [held[0], held[1], held[2]]) == ([(0, 3, 0)], [])
    assert message_spans(base_of(twice), [held[1], held[2]]) == ([(6, 1, 0), (2, 1, 0)], [])
