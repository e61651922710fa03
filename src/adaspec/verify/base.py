"""The verifier interface, one for chains and trees.

A verifier walks a proposal from the root against the target's processed distributions and
returns the accepted path plus one token of its own (the correction after a rejection, or
the bonus token after the last accepted node). Every rule here keeps the emitted tokens
distributed exactly as the target's (the exactness contract, docs/exactness.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from adaspec.core.proposal import Proposal
from adaspec.errors import InputError


def check_token_ids(ids: torch.Tensor, vocab: int, what: str) -> None:
    """Ids from the host must lie in [0, vocab); ids already on a device were drawn there,
    and checking them would read them back."""
    if ids.numel() and ids.device.type == "cpu" and (
        int(ids.min()) < 0 or int(ids.max()) >= vocab
    ):
        raise InputError(f"{what} token ids must be in [0, {vocab}), got {ids.tolist()}")


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted node indices, first level first (the root excluded)
    next_token: int  # the correction token (on rejection) or the bonus token (all accepted)

    @property
    def accepted(self) -> int:
        return len(self.path)


class Verifier(ABC):
    """target_probs: [n, V], row i = the target's processed distribution after the path
    root -> node i (raw logits for a greedy verifier: only the argmax matters)."""

    name: str
    summary: str = ""
    walks_trees: bool = True  # False: verifies chains only
    greedy: bool = False  # reads only the argmax: exact at temperature 0 only
    replacement: bool = False  # how the drafter should draw sibling candidates for it
    # True: the rule is only exact when siblings were drawn as `replacement` says (MCSS).
    needs_matching_draws: bool = False

    @abstractmethod
    def verify(
        self,
        proposal: Proposal,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Verdict: ...

    def check(self, proposal: Proposal, target_probs: torch.Tensor) -> None:
        """Shapes, and that the proposal was drawn the way this rule assumes."""
        n = len(proposal.tree)
        if target_probs.dim() != 2 or target_probs.shape[0] != n:
            raise InputError(
                f"target_probs must be [n, V] = [{n}, V] for a proposal of {n} nodes "
                f"(root included), got {list(target_probs.shape)}"
            )
        if not self.walks_trees and not proposal.is_chain:
            raise InputError(f"verifier {self.name!r} checks chains, not token trees")
        if (
            self.needs_matching_draws
            and not proposal.is_chain
            and proposal.probs is not None
            and proposal.replacement is not None
            and proposal.replacement != self.replacement
        ):
            drawn = "with" if proposal.replacement else "without"
            wanted = "with" if self.replacement else "without"
            raise InputError(
                f"verifier {self.name!r} needs sibling candidates drawn {wanted} replacement; "
                f"this proposal's were drawn {drawn}"
            )
