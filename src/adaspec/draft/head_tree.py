"""The draft head's trees: its chain, with the head's next candidates beside each token.

One head step gives a distribution over the next token; a chain takes its first candidate
and feeds it back. A tree (MCSD's, EAGLE's) also keeps the next few candidates of that step
as siblings: where the target rejects the first, it may accept a sibling, and its row (the
target scored every node) gives the token after it. The siblings cost target rows only, no
head step. Shape: `widths[d]` candidates at depth d + 1, the first one continuing the chain;
deeper levels (up to the length controller's k) one. At temperature 0 the candidates are the
head's top tokens; above it they are drawn from its processed distribution with or without
replacement, as the request's verifier needs (MCSS, `verify/multi_candidate.py`).
"""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import process_logits
from adaspec.core.token_tree import TokenTree
from adaspec.draft.base import Drafter
from adaspec.draft.head import HeadDrafter
from adaspec.draft.model_tree import draw_children


def fit_widths(widths: tuple[int, ...], tokens: int | None) -> tuple[int, ...]:
    """`widths` with its last levels cut until its nodes and root fit in `tokens` (what the
    target scores as one tree this step; None: any); where not even the first level fits,
    a chain of as many tokens as fit."""
    if tokens is None:
        return widths
    cut = widths
    while cut and sum(cut) + 1 > tokens:
        cut = cut[:-1]
    if cut or not widths:
        return cut
    return (1,) * min(len(widths), max(0, tokens - 1))


class HeadTreeDrafter(Drafter):
    """A head drafter's chain with sibling candidates; the head's cache and its lifecycle
    stay the chain drafter's (`head`)."""

    name = "head"
    drafts_trees = True
    needs_features = True

    def __init__(self, head: HeadDrafter, widths: tuple[int, ...]) -> None:
        if not widths or min(widths) < 1:
            raise ValueError("a head tree needs one or more candidates per level")
        self.head = head
        self.widths = tuple(int(w) for w in widths)

    def begin(self, req: RequestState) -> None:
        self.head.begin(req)

    def commit(self, req: RequestState, path: list[int]) -> None:
        self.head.commit(req, path)

    def _candidates(self, small: torch.Tensor, width: int, req: RequestState
                    ) -> tuple[list[int], torch.Tensor | None]:
        """`width` candidates from the head's kept-token logits `small` [N]: its top tokens
        at temperature 0, else draws from its processed distribution by the verifier's rule,
        with that distribution [V] (the row the verifier reads)."""
        if req.sampling.greedy:
            top = torch.topk(small, min(width, small.shape[-1])).indices
            return self.head.tokens.token_ids[top].tolist(), None
        probs = process_logits(self.head.tokens.full_logits(small)[None], req.sampling)
        return draw_children(probs, width, req.generator, req.replacement)[0], probs[0]

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        context, params = req.context, req.sampling
        wanted = (*self.widths, *(1,) * max(0, max_tokens - len(self.widths)))[:max_tokens]
        levels = fit_widths(wanted, req.tree_nodes)
        chain = self.head.open(req) if levels else None
        tree = TokenTree.root(context[-1])
        if chain is None:
            return Proposal(tree)
        rows: dict[int, torch.Tensor] = {}  # node -> the distribution its children came from
        parent = 0
        for depth, width in enumerate(levels, start=1):
            small = chain.small_logits()
            picks, row = self._candidates(small, width, req)
            if row is not None:
                rows[parent] = row
            new = tree.add_level([parent] * len(picks), picks)
            numbers = controller.draft_numbers(small).double().tolist()
            if depth == len(levels) or not controller.decide(depth - 1, numbers):
                break
            chain.advance(picks[0])
            parent = new[0]
        probs = None
        if rows:
            probs = torch.zeros(max(rows) + 1, self.head.tokens.vocab)
            for node, row in rows.items():
                probs[node] = row
        return Proposal(tree, probs, head_calls=chain.steps,
                        replacement=None if params.greedy else req.replacement)
