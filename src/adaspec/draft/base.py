"""The drafter interface, small enough that every drafting strategy implements it.

A drafter is handed the request it drafts for (`core.request.RequestState`) at each point of
the begin / propose / commit lifecycle, and reads from it what it needs: the accepted
context, the sampling settings, the budget left, its place in a batch. Nothing outside sets
a drafter's attributes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState


class Drafter(ABC):
    name: str = "drafter"
    # Proposals may branch (token trees): the target's backend must score tree masks, and
    # the default verifier above temperature 0 is a multi-candidate one.
    drafts_trees: bool = False
    # A drafter of trees that proposes chains for a constrained request (`_siblings` of
    # `auto`): constrained output, verified on chains, is then allowed.
    chains_when_constrained: bool = False
    # It reads the target's final-normed states of the accepted positions
    # (`RequestState.features`): the engine asks the target's runtime to record them.
    needs_features: bool = False

    def begin(self, req: RequestState) -> None:
        """`req` is about to draft for the first time (called after its first token, never
        for a request that ends there); a model drafter prefills the prompt here, which the
        engine times as the request's draft prefill."""

    @abstractmethod
    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        """Propose tokens to follow `req.context` (prompt + accepted so far), at most
        `max_tokens` levels deep, below the root req.context[-1], drawn with
        `req.sampling` and `req.generator`; a drafter that branches draws sibling
        candidates by `req.replacement` (the verifier's rule)."""

    def cut(self, req: RequestState, depth: int) -> None:
        """The engine verifies only the first `depth` levels of the last proposal (a batch
        of requests priced the rest out); a drafter crediting its proposals hears it here."""

    def commit(self, req: RequestState, path: list[int]) -> None:
        """Verification is done: `path` are the accepted nodes of the last proposal and
        `req.context` the new accepted prefix (roll caches back to it)."""

    def learn_with(self, other: Drafter) -> None:
        """Learn across requests together with `other`, the same method's drafter on another
        sequence of the same models (a server's slots): a drafter that keeps estimates across
        requests shares them; the rest do nothing."""

    def learn(self) -> None:
        """The request is over (a server says so as soon as it ends): a drafter that learns
        across requests (the cross-request history) takes it in now."""
