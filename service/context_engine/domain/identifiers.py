"""What makes a string an id (tenant, session, item, run, call, idempotency key): one rule for
requests, the tokens a deployment mints and the commands that name a tenant."""

from __future__ import annotations

from context_engine.domain import ucd

MAX_ID_LENGTH = 256

# What an id may not hold, as the other checks of text the platform prints as its own words
# (runtime metadata, references): a control character (C0, DEL, C1 such as NEL or CSI), a format
# character (bidi embeddings, overrides and isolates, zero-width ones, tag characters), a line or
# a paragraph separator: each breaks, reorders or hides part of a line an id is printed in.
_NOT_IN_AN_ID = frozenset({"Cc", "Cf", "Zl", "Zp"})
ID_CHARACTERS_RULE = ("must not contain control, format or line-separator characters or "
                      "surrounding white space")


def bad_id_characters(value: str) -> bool:
    """Whether ``value`` holds a character no id may hold (``_NOT_IN_AN_ID``) or surrounding
    white space. Printable ASCII holds none of them, so only other text is searched."""
    return value != value.strip() or (not (value.isascii() and value.isprintable()) and any(
        ucd.category(c) in _NOT_IN_AN_ID for c in value))


def identifier_problem(value: str) -> str | None:
    """Why ``value`` is no id (a phrase to follow its name), or None: empty, longer than
    MAX_ID_LENGTH characters, or holding a control, format, line or paragraph separator
    character (Unicode categories Cc, Cf, Zl, Zp) or surrounding white space."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"is {len(value)} characters; at most {MAX_ID_LENGTH}"
    if bad_id_characters(value):
        return ID_CHARACTERS_RULE
    return _unencodable(value)


def _unencodable(value: str) -> str | None:
    """A lone surrogate (what a command line's bytes that are no UTF-8 decode to): no request
    can carry it, nor can PostgreSQL store it."""
    if value.isascii() or not any("\ud800" <= c <= "\udfff" for c in value):
        return None
    return "must be text in UTF-8 (it holds bytes that are not)"


def erasable_identifier_problem(value: str) -> str | None:
    """``identifier_problem`` for an id that names what may already be stored (the session
    ``DeleteSession`` erases, the tenant ``purge-tenant`` erases): the rule of the releases
    before the rule above, which refused only C0 controls, so that a session or a tenant stored
    under an id they accepted (one holding DEL, a C1 control, a separator or a bidi control)
    can still be erased, though nothing else can name it any more."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"is {len(value)} characters; at most {MAX_ID_LENGTH}"
    if value != value.strip() or any(ord(c) < 32 for c in value):
        return "must not contain C0 control characters or surrounding white space"
    return _unencodable(value)
