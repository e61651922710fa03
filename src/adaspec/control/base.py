"""The length-controller interface.

`max_tokens` bounds the next draft; `keep_drafting` is asked after each drafted token (DISCO
and confidence thresholds decide here); `update` learns from the verification result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LengthController(ABC):
    name: str = "controller"

    def start(self) -> None:
        """A new request begins."""

    @abstractmethod
    def max_tokens(self) -> int:
        """Upper bound on the number of tokens to draft in the next step (>= 1)."""

    @property
    def stops_early(self) -> bool:
        """Whether `keep_drafting` can end a chain before `max_tokens` (the base's never
        does): a drafter then reads what it decides by after each drafted token; otherwise
        it may draft the whole chain on the device and read its ids once."""
        return type(self).keep_drafting is not LengthController.keep_drafting

    def keep_drafting(self, position: int, draft_logits: torch.Tensor | None) -> bool:
        """After drafting token `position` (0-based) from raw `draft_logits` [V] (None for a
        drafter without a distribution, e.g. n-gram): go on drafting? The logits are where
        the draft ran (a GPU's memory): a rule computes its numbers there and reads back
        only those."""
        return True

    def update(self, drafted: int, accepted: int) -> None:
        """The target accepted `accepted` of `drafted` tokens."""
