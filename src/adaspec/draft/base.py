"""The drafter interface, small enough that every drafting strategy implements it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from adaspec.control.base import LengthController
from adaspec.engine.sampling import SamplingParams


@dataclass
class DraftProposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V] processed draft distributions, None if deterministic
    forward_calls: int = 0  # draft model forward passes spent on this proposal


class Drafter(ABC):
    name: str = "drafter"

    def start(self, prompt_ids: list[int]) -> None:
        """A request with this prompt is about to draft for the first time (called after
        its first token, never for a request that ends there); a model drafter prefills the
        prompt here, which the engine times as the request's draft prefill."""

    @abstractmethod
    def propose(
        self,
        context: list[int],
        max_tokens: int,
        controller: LengthController,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        """Propose up to `max_tokens` tokens to follow `context` (prompt + generated so far)."""

    def commit(self, context: list[int]) -> None:
        """Verification is done: `context` is the new accepted prefix (roll caches back to it)."""
