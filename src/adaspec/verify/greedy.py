"""Greedy verification: keep the drafted path the target's argmax agrees with.

At temperature 0 this makes the output token-for-token the target's greedy output, whatever
the drafter proposed, because every emitted token is the argmax of a target row.
"""

from __future__ import annotations

import torch

from adaspec.core.proposal import Proposal
from adaspec.core.sampling import argmax
from adaspec.verify.base import Verdict, Verifier


class GreedyVerifier(Verifier):
    """Follow the child equal to the target's argmax while there is one; emit the argmax.

    Rows of `target_probs` may be one-hot or any distribution (logits work too): only their
    argmax matters. Draft distributions and `generator` are ignored, so a greedy step is
    deterministic.
    """

    name = "greedy"
    greedy = True
    summary = "follow the target's argmax; exact at temperature 0 only"

    def verify(
        self,
        proposal: Proposal,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Verdict:
        self.check(proposal, target_probs)
        # The argmax runs where the rows are (a GPU's memory); one read brings back n ids.
        best = argmax(target_probs).tolist()
        tree = proposal.tree
        if proposal.is_chain:
            drafted = tree.tokens[1:]  # out-of-vocabulary draft ids simply never match
            accepted = next((i for i, t in enumerate(drafted) if best[i] != t), len(drafted))
            return Verdict(list(range(1, accepted + 1)), best[accepted])
        node = 0
        path: list[int] = []
        while True:
            want = best[node]
            nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
            if nxt is None:
                return Verdict(path, want)
            path.append(nxt)
            node = nxt
