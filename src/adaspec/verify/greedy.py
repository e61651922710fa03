"""Greedy verification: keep the drafted prefix the target's argmax agrees with.

At temperature 0 this makes the output token-for-token the target's greedy output, whatever
the drafter proposed, because every emitted token is the argmax of a target row.
"""

from __future__ import annotations

import torch

from adaspec.engine.sampling import argmax
from adaspec.verify.base import Verdict, Verifier, check_chain_shapes


class GreedyVerifier(Verifier):
    """Accept the longest prefix equal to the target's argmax; emit the argmax after it.

    Rows of `target_probs` may be one-hot or any distribution (logits work too): only their
    argmax matters. `draft_probs` and `generator` are ignored, so a greedy step is
    deterministic.
    """

    name = "greedy"

    def verify(
        self,
        draft_tokens: list[int],
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Verdict:
        k = len(draft_tokens)
        check_chain_shapes(k, None, target_probs)
        best = argmax(target_probs)
        if k == 0:
            return Verdict(accepted=0, next_token=int(best[0]))
        # Out-of-vocabulary draft ids simply never match an argmax.
        drafted = torch.tensor(draft_tokens, dtype=best.dtype)
        matches = best[:k] == drafted
        accepted = int(matches.int().cumprod(0).sum())
        return Verdict(accepted=accepted, next_token=int(best[accepted]))
