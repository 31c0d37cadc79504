"""Trust levels and regions."""

from __future__ import annotations

import enum


class TrustLevel(enum.Enum):
    """Trust of a piece of content, highest first."""

    PLATFORM = "platform"
    TRUSTED_CONFIGURATION = "trusted_configuration"
    USER = "user"
    MEMORY = "memory"
    EXTERNAL_UNTRUSTED = "external_untrusted"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def enveloped(self) -> bool:
        """Content below TRUSTED_CONFIGURATION renders inside an attributed envelope."""
        return self.rank < _RANK[TrustLevel.TRUSTED_CONFIGURATION]


_RANK = {
    TrustLevel.PLATFORM: 5,
    TrustLevel.TRUSTED_CONFIGURATION: 4,
    TrustLevel.USER: 3,
    TrustLevel.MEMORY: 2,
    TrustLevel.EXTERNAL_UNTRUSTED: 1,
}


def lowest(levels: list[TrustLevel], default: TrustLevel) -> TrustLevel:
    return min(levels, key=lambda t: t.rank) if levels else default


class Region(enum.Enum):
    """A: the frozen prefix, rendered once per plan. B: the turn body, rendered per request."""

    A = "A"
    B = "B"
