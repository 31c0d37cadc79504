"""One rule for every id: no control, format, line or paragraph separator character (Unicode
categories Cc, Cf, Zl, Zp), as the other checks of text the platform prints; the earlier rule
(C0 controls only) for the ids erasure is given, so what was stored under it can be erased."""

from __future__ import annotations

import pytest
from context_engine.domain.identifiers import erasable_identifier_problem, identifier_problem

# Written out from the Unicode character database's categories, not computed by the code under
# test: DEL and the C1 controls (Cc), line and paragraph separators (Zl, Zp), bidi embeddings,
# overrides and isolates, zero-width and tag characters, the byte-order mark (Cf).
REFUSED = ["\x7f", "\x80", "\x85", "\x9b", "\x9f", "\u2028", "\u2029", "\u202a", "\u202e",
           "\u2066", "\u2069", "\u200b", "\u200e", "\u061c", "\ufeff", "\U000e0041", "\x00",
           "\x1f", "\t"]
ACCEPTED = ["run-1", "sess id", "caf\u00e9", "\u65e5\u672c", "a\u0301", "x\u00a0x", "x\u00ff",
            "\U0001f600", "k:1/2?x=y"]


@pytest.mark.parametrize("char", REFUSED)
def test_an_id_holding_a_control_format_or_separator_character_is_refused(char: str) -> None:
    for value in (f"a{char}b", f"{char}ab", f"ab{char}"):
        assert identifier_problem(value) == (
            "must not contain control, format or line-separator characters or surrounding "
            "white space"), repr(value)


@pytest.mark.parametrize("value", ACCEPTED)
def test_an_id_of_printable_text_in_any_script_is_accepted(value: str) -> None:
    assert identifier_problem(value) is None
    assert erasable_identifier_problem(value) is None


def test_the_other_rules_of_an_id() -> None:
    assert identifier_problem("") == "must not be empty"
    assert identifier_problem("x" * 257) == "is 257 characters; at most 256"
    assert identifier_problem("x" * 256) is None
    assert identifier_problem(" x") is not None and identifier_problem("x\u3000") is not None


@pytest.mark.parametrize("value", ["sess\x7f\u202eid", "r\x85x", "key\u2028\x9b", "r\u202ex"])
def test_an_id_a_release_before_accepted_can_still_be_named_for_erasure(value: str) -> None:
    assert identifier_problem(value) is not None
    assert erasable_identifier_problem(value) is None
    assert erasable_identifier_problem("a\x1fb") is not None
    assert erasable_identifier_problem("") == "must not be empty"


def test_purge_tenant_takes_a_tenant_id_the_earlier_rule_took_and_hash_token_does_not() -> None:
    """purge-tenant erases what was stored under an id a release before accepted; hash-token
    mints a token no request could use."""
    from context_engine import cli

    assert cli._tenant_problem("t\x85x", erasing=True) is None
    assert cli._tenant_problem("t\x85x") == (
        "--tenant-id must not contain control, format or line-separator characters or "
        "surrounding white space")
    assert cli._tenant_problem("t\x1fx", erasing=True) is not None


@pytest.mark.parametrize("value", ["caf\udce9", "\ud800", "x\udfffy"])
def test_an_id_holding_a_lone_surrogate_is_refused_by_both_rules(value: str) -> None:
    """What a command line's bytes that are no UTF-8 decode to (``caf\\xe9`` as
    ``caf\\udce9``): `hash-token` minted a tokens-file entry for a tenant no request can name,
    `demo` died encoding it. Neither rule took it as an id; both refuse it now."""
    message = "must be text in UTF-8 (it holds bytes that are not)"
    assert identifier_problem(value) == message
    assert erasable_identifier_problem(value) == message
