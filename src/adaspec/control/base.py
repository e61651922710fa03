"""The length-controller interface.

`max_tokens` bounds the next draft; `keep_drafting` is asked after each drafted token (DISCO
and confidence thresholds decide here); `update` learns from the verification result. A rule
that stops chains splits `keep_drafting` in two: `draft_numbers`, computed where the draft's
logits are, and `decide` on those numbers read back, so a drafter on a GPU reads them
together with the token's id.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from adaspec.errors import InputError


class LengthController(ABC):
    name: str = "controller"

    def begin(self) -> None:
        """A new request begins."""

    @abstractmethod
    def max_tokens(self) -> int:
        """Upper bound on the number of tokens to draft in the next step (>= 1)."""

    @property
    def stops_early(self) -> bool:
        """Whether the rule can end a chain before `max_tokens` (the base's never does): a
        drafter then reads its numbers after each drafted token; otherwise it may draft the
        whole chain on the device and read its ids once."""
        return type(self).decide is not LengthController.decide

    def draft_numbers(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The few numbers [m] the rule decides by, from a drafted token's raw logits [V],
        computed where they are (a GPU's memory)."""
        return draft_logits[:0].float()

    def decide(self, position: int, numbers: list[float]) -> bool:
        """After drafting token `position` (0-based), on its `draft_numbers` read back
        (empty for a drafter without a distribution, e.g. n-gram): go on drafting?"""
        return True

    def keep_drafting(self, position: int, draft_logits: torch.Tensor | None) -> bool:
        """`decide` on raw `draft_logits` [V] (None for a drafter without a distribution).
        A rule implements `draft_numbers` and `decide`, not this."""
        numbers = [] if draft_logits is None else self.draft_numbers(draft_logits).tolist()
        return self.decide(position, numbers)

    def needs_distribution(self, numbers: list[float]) -> None:
        """For a rule that reads the draft's distribution: a clear error when a drafter
        without one (n-gram) gave it no numbers."""
        if not numbers:
            raise InputError(f"ctrl={self.name} needs a drafter with a distribution (draft:...)")

    def update(self, drafted: int, accepted: int) -> None:
        """The target accepted `accepted` of `drafted` tokens."""
