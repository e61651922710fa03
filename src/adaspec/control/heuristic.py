"""The heuristic schedule of Hugging Face assisted generation: grow k by 2 after a fully
accepted draft, shrink it by 1 otherwise."""

from __future__ import annotations

from adaspec.control.base import LengthController
from adaspec.errors import InputError


class HeuristicLength(LengthController):
    name = "heuristic"

    def __init__(self, k: int = 4, k_max: int = 16) -> None:
        if k < 1 or k_max < k:
            raise InputError(f"heuristic schedule needs 1 <= k <= k_max, got k={k}, k_max={k_max}")
        self.k0 = k
        self.k_max = k_max
        self.k = k

    def begin(self) -> None:
        self.k = self.k0

    def max_tokens(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, 1)
