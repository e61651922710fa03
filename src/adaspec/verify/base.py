"""The verifier interface for a chain of drafted tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafted tokens the target accepted (a prefix of the draft)
    next_token: int  # the correction token (on rejection) or the bonus token (all accepted)


class Verifier(ABC):
    """Walks a drafted chain against the target's processed distributions.

    draft_tokens: the k proposed token ids.
    draft_probs: [k, V] processed draft distributions that the tokens were sampled from, or
        None for a deterministic drafter (n-gram): then each token had probability 1.
    target_probs: [k + 1, V] processed target distributions; row i scores the token after
        draft_tokens[:i]; the last row gives the bonus token.
    """

    name: str

    @abstractmethod
    def verify(
        self,
        draft_tokens: list[int],
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Verdict: ...
