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

from collections.abc import Callable

import torch

from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import process_logits
from adaspec.core.token_tree import TokenTree
from adaspec.cost.profile import CostProfile
from adaspec.draft.base import Drafter
from adaspec.draft.head import HeadChain, HeadDrafter
from adaspec.draft.model_tree import draw_children

# a drafted level: its candidates, the head's probability of each, and (sampled) the
# distribution they were drawn from [V]
Level = tuple[list[int], list[float], "torch.Tensor | None"]


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
        wanted = (*self.widths, *(1,) * max(0, max_tokens - len(self.widths)))[:max_tokens]
        widths = fit_widths(wanted, req.tree_nodes)
        chain = self.head.open(req) if widths else None
        if chain is None:
            return Proposal(TokenTree.root(req.context[-1]))
        levels = self._draft(req, chain, widths, controller)
        return self._proposal(req, levels, [len(picks) for picks, _, _ in levels], chain.steps)

    def _draft(self, req: RequestState, chain: HeadChain, widths: tuple[int, ...],
               controller: LengthController, floor: float = 0.0) -> list[Level]:
        """The chain's levels, `widths[d]` candidates at depth d + 1, the first one fed on;
        it stops where the controller says, or where the path to its next token is less
        likely than `floor` by the head's own probabilities."""
        levels: list[Level] = []
        reach = 1.0
        for depth, width in enumerate(widths, start=1):
            small = chain.small_logits()
            levels.append(self._candidates(small, width, req))
            reach *= levels[-1][1][0] if levels[-1][1] else 0.0
            numbers = controller.draft_numbers(small).double().tolist()
            if depth == len(widths) or reach < floor or \
                    not controller.decide(depth - 1, numbers):
                break
            chain.advance(levels[-1][0][0])
        return levels

    def _proposal(self, req: RequestState, levels: list[Level], counts: list[int],
                  steps: int) -> Proposal:
        """The tree of each level's first `counts[d]` candidates, a level below the one
        before's first; the distributions they were drawn from on their parents' rows."""
        tree, firsts = level_tree(req.context[-1], [picks for picks, _, _ in levels], counts)
        # node -> the distribution its children came from (each kept level below its parent)
        rows = {parent: row for parent, (_, _, row) in zip([0, *firsts[:-1]], levels,
                                                            strict=False) if row is not None}
        probs = None
        if rows:
            probs = torch.zeros(max(rows) + 1, self.head.tokens.vocab)
            for node, row in rows.items():
                probs[node] = row
        return Proposal(tree, probs, head_calls=steps,
                        replacement=None if req.sampling.greedy else req.replacement)


# tree=priced: the candidates a level offers and the most nodes a step keeps
PRICED_WIDTH = 4
PRICED_NODES = 16
# a chain stops drafting once the path to its next token is this unlikely
PRICED_REACH = 0.02
# the weight of the head's own probabilities against its measured hits (`_scale`)
CALIBRATION_PRIOR = 4.0


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
        # per depth, over the requests this drafter served: the head's probabilities of its
        # kept nodes whose parent was accepted, summed, and how many of them were accepted
        self.calibration: list[tuple[float, int]] = []
        # the last step's kept nodes: (node, parent, depth - 1, the head's probability)
        self._last: list[tuple[int, int, int, float]] = []

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        chain = self.head.open(req) if max_tokens > 0 else None
        self._last = []
        if chain is None:
            return Proposal(TokenTree.root(req.context[-1]))
        levels = self._draft(req, chain, self.widths * max_tokens, controller, PRICED_REACH)
        probs = [[min(0.99, q * self._scale(d)) for q in level[1]]
                 for d, level in enumerate(levels)]
        room = min(self.max_nodes + 1, req.tree_nodes or self.max_nodes + 1)
        counts = plan(probs, self.profile, room - 1, len(req.context))
        self.kept.append(sum(counts))
        node, parent = 0, 0
        for d, ((_, qs, _), count) in enumerate(zip(levels, counts, strict=False)):
            for j in range(count):
                self._last.append((node + 1 + j, parent, d, qs[j]))
            parent, node = node + 1, node + count
        return self._proposal(req, levels, counts, chain.steps)

    def _scale(self, depth: int) -> float:
        """How far the head's probabilities at depth `depth` + 1 held so far: accepted over
        expected among the kept nodes whose parent was accepted (1 with no evidence)."""
        pred, hits = self.calibration[depth] if depth < len(self.calibration) else (0.0, 0)
        return (hits + CALIBRATION_PRIOR) / (pred + CALIBRATION_PRIOR)

    def commit(self, req: RequestState, path: list[int]) -> None:
        accepted = set(path)
        for node, parent, depth, q in self._last:
            if parent and parent not in accepted:
                continue  # its parent was rejected: no evidence on it
            while len(self.calibration) <= depth:
                self.calibration.append((0.0, 0))
            pred, hits = self.calibration[depth]
            self.calibration[depth] = (pred + q, hits + (node in accepted))
        self._last = []
        super().commit(req, path)


def level_tree(root: int, levels: list[list[int]], counts: list[int]
               ) -> tuple[TokenTree, list[int]]:
    """The tree of each level's first `counts[d]` tokens, a level below the previous level's
    first node, and those first nodes (the chain through the tree)."""
    tree = TokenTree.root(root)
    firsts: list[int] = []
    parent = 0
    for picks, count in zip(levels, counts, strict=False):
        if not count:
            break
        parent = tree.add_level([parent] * count, picks[:count])[0]
        firsts.append(parent)
    return tree, firsts


def plan(levels: list[list[float]], profile: CostProfile, max_nodes: int,
         context: int | None = None) -> list[int]:
    """`best_counts` priced by the profile's target calls."""
    return best_counts(levels, lambda n: profile.target_ms(1 + n, context), max_nodes)


def best_counts(levels: list[list[float]], step_ms: Callable[[int], float], max_nodes: int,
                base: float = 1.0) -> list[int]:
    """How many candidates to keep at each level (a prefix of each level's, in their order;
    a level only below the previous level's first): levels[d] the probabilities that its
    candidates at depth d + 1 are accepted, their parent being. A node's worth is the chance
    its path is accepted (the product of the probabilities down to it); nodes are taken best
    first among those whose parent and earlier siblings are in, and the step keeps the count
    with the most expected tokens (`base`, what a step drafting nothing emits, + the worths)
    per ms of a step verifying that many nodes (`step_ms(n)`)."""
    kept = [0] * len(levels)
    reach = [1.0] * (len(levels) + 1)  # reach[d]: the chance the path to depth d holds
    best, best_rate, worth = list(kept), base / step_ms(0), base
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
        rate = worth / step_ms(n)
        if rate > best_rate:
            best, best_rate = list(kept), rate
    return best
