"""What makes a string an id (tenant, session, item, run, call): one rule for requests, the
tokens a deployment mints and the commands that name a tenant."""

from __future__ import annotations

MAX_ID_LENGTH = 256


def identifier_problem(value: str) -> str | None:
    """Why ``value`` is no id (a phrase to follow its name), or None: empty, longer than
    MAX_ID_LENGTH characters, or holding a control character or surrounding white space."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"is {len(value)} characters; at most {MAX_ID_LENGTH}"
    if value != value.strip() or any(ord(c) < 32 for c in value):
        return "must not contain control characters or surrounding white space"
    return None
