"""The drafter interface, small enough that every drafting strategy implements it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.sampling import SamplingParams

if TYPE_CHECKING:
    from adaspec.cost.batch import Seat


class Drafter(ABC):
    name: str = "drafter"
    # Proposals may branch (token trees): the target's backend must score tree masks, and
    # the default verifier above temperature 0 is a multi-candidate one.
    drafts_trees: bool = False
    # Requests decoded together: this request's place in the round whose call its
    # proposals join, for a drafter that prices its drafts (None: priced as a request
    # alone). `Engine.join_batch`.
    batch: Seat | None = None
    # Tokens the request may still emit, counting the one its next step always makes (its
    # budget left), as of its next proposal; the engine sets it before every `propose`
    # (0: not known). A drafter with a one-time cost to start (a draft model's prompt
    # prefill) prices it over what is left.
    remaining: int = 0

    def begin(self, prompt_ids: list[int]) -> None:
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
        replacement: bool = False,
    ) -> Proposal:
        """Propose tokens to follow `context` (prompt + generated so far), at most
        `max_tokens` levels deep, below the root context[-1]. `replacement`: how to draw
        sibling candidates (the verifier's rule), for drafters that branch."""

    def cut(self, depth: int) -> None:
        """The engine verifies only the first `depth` levels of the last proposal (a batch
        of requests priced the rest out); a drafter crediting its proposals hears it here."""

    def commit(self, context: list[int], path: list[int]) -> None:
        """Verification is done: `path` are the accepted nodes of the last proposal and
        `context` the new accepted prefix (roll caches back to it)."""
