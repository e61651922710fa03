"""The draft head's trees: its chain, with the head's next candidates beside each token.

One head step gives a distribution over the next token; a chain takes its first candidate
and feeds it back. A tree (MCSD's, EAGLE's) also keeps the next few candidates of that step
as siblings: where the target rejects the first, it may accept a sibling, and its row (the
target scored every node) gives the token after it. The siblings cost target rows only, no
head step. Shape: `widths[d]` candidates at depth d + 1, the first one continuing the chain;
deeper levels (up to the length controller's k) one. At temperature 0 the candidates are the
head's top tokens; above it they are drawn from its processed distribution with or without
replacement, as the request's verifier needs (MCSS, `verify/multi_candidate.py`).

`tree=priced` (`PricedHeadTree`) shapes each step's tree from the head's own confidence: a
node's worth is the chance the target accepts the path to it (the head is calibrated: the
product of its probabilities along the path), and the step keeps the nodes that give the
most expected tokens per millisecond of the target's call under the cost profile, so where
rows are dear (a CPU) it keeps a short chain and where they are nearly free (a GPU) a wide
tree.
"""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import process_logits
from adaspec.core.token_tree import TokenTree
from adaspec.cost.profile import CostProfile
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
                    ) -> tuple[list[int], list[float], torch.Tensor | None]:
        """`width` candidates from the head's kept-token logits `small` [N]: its top tokens
        at temperature 0, else draws from its processed distribution by the verifier's rule
        with that distribution [V] (the row the verifier reads); and the head's
        probability of each (what the target accepts it with: the head is calibrated)."""
        if req.sampling.greedy:
            top = torch.topk(torch.softmax(small, -1), min(width, small.shape[-1]))
            return (self.head.tokens.token_ids[top.indices].tolist(), top.values.tolist(),
                    None)
        probs = process_logits(self.head.tokens.full_logits(small)[None], req.sampling)
        picks = draw_children(probs, width, req.generator, req.replacement)[0]
        return picks, probs[0, picks].tolist(), probs[0]

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
            picks, _, row = self._candidates(small, width, req)
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


# tree=priced: the candidates a level offers and the most nodes a step keeps
PRICED_WIDTH = 4
PRICED_NODES = 16
# a chain stops drafting once the path to its next token is this unlikely
PRICED_REACH = 0.02


class PricedHeadTree(HeadTreeDrafter):
    """`tree=priced`: each step the head drafts its chain with `PRICED_WIDTH` candidates a
    level, then keeps the nodes with the most expected tokens per ms of the target's call
    (`plan`)."""

    def __init__(self, head: HeadDrafter, profile: CostProfile, width: int = PRICED_WIDTH,
                 max_nodes: int = PRICED_NODES) -> None:
        super().__init__(head, (width,))
        self.profile = profile
        self.max_nodes = max_nodes
        self.kept: list[int] = []  # nodes kept per step (for reports)

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        context = req.context
        chain = self.head.open(req) if max_tokens > 0 else None
        tree = TokenTree.root(context[-1])
        if chain is None:
            return Proposal(tree)
        levels: list[tuple[list[int], list[float], torch.Tensor | None]] = []
        reach = 1.0
        for depth in range(1, max_tokens + 1):
            small = chain.small_logits()
            picks, probs, row = self._candidates(small, self.widths[0], req)
            levels.append((picks, probs, row))
            reach *= probs[0] if probs else 0.0
            numbers = controller.draft_numbers(small).double().tolist()
            if depth == max_tokens or reach < PRICED_REACH or \
                    not controller.decide(depth - 1, numbers):
                break
            chain.advance(picks[0])
        room = min(self.max_nodes + 1, req.tree_nodes or self.max_nodes + 1)
        keep = plan([probs for _, probs, _ in levels], self.profile, room - 1, len(context))
        self.kept.append(sum(keep))
        rows: dict[int, torch.Tensor] = {}
        parent = 0
        for (picks, _, row), count in zip(levels, keep, strict=False):
            if not count:
                break
            new = tree.add_level([parent] * count, picks[:count])
            if row is not None:
                rows[parent] = row
            parent = new[0]
        probs_t = None
        if rows:
            probs_t = torch.zeros(max(rows) + 1, self.head.tokens.vocab)
            for node, r in rows.items():
                probs_t[node] = r
        return Proposal(tree, probs_t, head_calls=chain.steps,
                        replacement=None if req.sampling.greedy else req.replacement)


def plan(levels: list[list[float]], profile: CostProfile, max_nodes: int,
         context: int | None = None) -> list[int]:
    """How many candidates to keep at each level (a prefix of each level's, in their order;
    a level only below the previous level's first): levels[d] the head's probabilities of
    its candidates at depth d + 1. A node's worth is the chance its path is accepted (the
    product of the probabilities down to it); nodes are taken best first among those whose
    parent and earlier siblings are in, and the step keeps the count with the most expected
    tokens (1 + the worths) per ms of a target call of that many rows."""
    kept = [0] * len(levels)
    reach = [1.0] * (len(levels) + 1)  # reach[d]: the chance the path to depth d holds
    best, best_rate, worth = list(kept), 1.0 / profile.target_ms(1, context), 1.0
    for n in range(1, max_nodes + 1):
        options = [(reach[d] * levels[d][kept[d]], d) for d in range(len(levels))
                   if kept[d] < len(levels[d]) and (d == 0 or kept[d - 1] > 0)]
        if not options:
            break
        gain, d = max(options)
        kept[d] += 1
        if kept[d] == 1:
            reach[d + 1] = reach[d] * levels[d][0]
        worth += gain
        rate = worth / profile.target_ms(1 + n, context)
        if rate > best_rate:
            best, best_rate = list(kept), rate
    return best
