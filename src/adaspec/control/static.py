"""Static speculation length: always draft k tokens."""

from __future__ import annotations

from adaspec.control.base import LengthController
from adaspec.errors import InputError


class StaticLength(LengthController):
    name = "static"

    def __init__(self, k: int = 4) -> None:
        if not isinstance(k, int) or k < 1:
            raise InputError(f"speculation length k must be an integer >= 1, got {k!r}")
        self.k = k

    def max_tokens(self) -> int:
        return self.k
