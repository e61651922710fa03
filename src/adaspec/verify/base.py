"""The verifier interface for a chain of drafted tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from adaspec.errors import InputError


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


def check_chain_shapes(
    k: int, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> None:
    """Both chain verifiers need target rows for k drafts + 1 and, if given, k draft rows."""
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise InputError(
            f"target_probs must be [k + 1, V] = [{k + 1}, V] for {k} draft tokens, "
            f"got {list(target_probs.shape)}"
        )
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != k):
        raise InputError(
            f"draft_probs must be [k, V] = [{k}, V] or None, got {list(draft_probs.shape)}"
        )
