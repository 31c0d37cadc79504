"""Where two sequences stop beginning alike: what a cache kept from the last Build resumes from."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, count
from operator import is_not
from typing import Any


def shared_prefix(old: Sequence[Any], new: Sequence[Any]) -> int:
    """How many leading items ``new`` has equal to ``old``'s: compared whole at C speed when
    one is a prefix of the other (the usual case); otherwise the first item that is not the
    same object is found at C speed, and items are compared by equality from there on."""
    n = min(len(old), len(new))
    if old[:n] == new[:n]:
        return n
    same = next(compress(count(), map(is_not, old, new)), n)
    return next((i for i in range(same, n) if old[i] != new[i]), n)
