"""Tree drafting: the draft model proposes several candidates per node, level by level.

One draft forward per level scores the whole frontier: the new level's nodes are fed as one
sequence with a mask over the draft's cache, so each node sees the context and its own
ancestors (earlier levels stay in the draft cache) and positions = depth after the context.
Children are drawn from the node's processed draft distribution q, with replacement (i.i.d.,
for MCSS Algorithm 1) or without (each next candidate from q renormalised without the ones
already drawn: Algorithm 2 and the naive verifier); at temperature 0 they are the top-k
distinct tokens. After verification `commit` compacts the draft cache to the accepted
path, so it holds exactly the accepted context, as the target's does.

`PricedTreeDrafter` (`tree=priced`) picks the shape every step: the chain or tree with the most
expected tokens per millisecond under the machine's cost profile, from this request's own
acceptance per candidate rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from adaspec.backends.base import ModelBackend
from adaspec.control.base import LengthController
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState
from adaspec.core.sampling import may_hold, process_logits, uniforms
from adaspec.core.token_tree import (
    CANDIDATE_SHAPES,
    DEFAULT_MAX_NODES,
    PricedBranching,
    TokenTree,
    fit_shape,
    tree_node_count,
)
from adaspec.cost.profile import CostProfile
from adaspec.draft.base import Drafter
from adaspec.draft.model import feed, prefill_prompt, roll_back_to_common_prefix
from adaspec.draft.rates import RateEstimate
from adaspec.errors import InputError

# Assumed acceptance per candidate rank, before a request has shown its own: the chance that
# the draft's r-th candidate is the target's token given that the ones before it were not.
# Rank 1 agrees about 60% of the time for a small draft of the same family; a second
# candidate catches about a third of the misses, further ones fewer and fewer (top-2 covers
# 74%, top-4 82%, top-8 88%). A running estimate per request replaces them as steps are
# verified (`draft.model_tree.PricedTreeDrafter`).
DEFAULT_RANK_RATES = (0.6, 0.35, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05)




def level_hit(rates: Sequence[float], candidates: int) -> float:
    """P(one of the first `candidates` candidates below a node is the target's token), from
    per-rank rates (rates[r]: rank r + 1 matches given the ones before it missed; ranks past
    the last rate take the last)."""
    miss = 1.0
    for r in range(candidates):
        miss *= 1.0 - rates[min(r, len(rates) - 1)]
    return 1.0 - miss


def expected_tokens(branching: Sequence[int], rates: Sequence[float]) -> float:
    """Tokens a step with this regular tree emits on average: 1 (the target's own) + the
    expected accepted depth, sum over levels of P(a path is accepted down to that level)."""
    value, p = 1.0, 1.0
    for b in branching:
        p *= level_hit(rates, b)
        value += p
    return value


def tree_step_ms(
    branching: Sequence[int], profile: CostProfile, context: int | None = None
) -> float:
    """What one tree step costs under `profile`, as `draft.model_tree.ModelTreeDrafter` runs it:
    one draft forward for the root, one per further level over that level's nodes, then
    one target pass over every node and the root, plus the loop's overhead."""
    ms = profile.target_ms(tree_node_count(branching) + 1, context) + profile.overhead_ms
    if branching:
        ms += profile.draft_ms(1, context)
        width = 1
        for b in branching[:-1]:
            width *= b
            ms += profile.draft_ms(width, context)
    return ms


def choose_branching(
    profile: CostProfile,
    rates: Sequence[float] = DEFAULT_RANK_RATES,
    candidates: Sequence[tuple[int, ...]] = CANDIDATE_SHAPES,
    max_depth: int | None = None,
    max_nodes: int = DEFAULT_MAX_NODES,
    context: int | None = None,
) -> tuple[int, ...]:
    """The candidate shape (cut to `max_depth` levels) with the most expected tokens per ms
    of measured cost; among equals the one with fewer nodes."""
    shapes = {c[:max_depth] if max_depth is not None else c for c in candidates}
    shapes = {c for c in shapes if c and tree_node_count(c) <= max_nodes}
    if not shapes:
        raise InputError(f"no candidate tree fits max_depth {max_depth}, max_nodes {max_nodes}")
    return max(
        sorted(shapes),
        key=lambda c: (
            expected_tokens(c, rates) / tree_step_ms(c, profile, context),
            -tree_node_count(c),
        ),
    )


def draw_with_replacement(probs: torch.Tensor, count: int,
                          generator: torch.Generator | None) -> torch.Tensor:
    """[f, count] i.i.d. draws from each row of probs [f, V] by inverse CDF, where the rows
    are (nothing read back)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    u = uniforms((probs.shape[0], count), generator, torch.float64, probs.device)
    index = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # last token with positive mass
    return torch.minimum(index, last)


def draw_children(
    probs: torch.Tensor, count: int, generator: torch.Generator | None, replacement: bool
) -> list[list[int]]:
    """`count` candidates from each row of probs [f, V] (processed, rows sum to 1).

    With replacement: i.i.d. by inverse CDF, one cumsum per row. Without: one draw at a time
    from the row with the earlier draws zeroed (sampling from the renormalised remainder);
    a row whose support runs out gets fewer children.
    """
    rows = probs.shape[0]
    if replacement:
        return draw_with_replacement(probs, count, generator).tolist()
    rest = probs.to(torch.float64).clone()
    draws: list[torch.Tensor] = []  # [rows, 2] per draw: the token, and whether it is real
    for _ in range(count):
        mass = rest.sum(-1)
        live = mass > 0
        if not may_hold(live):
            break
        cdf = rest.cumsum(-1)
        u = uniforms((rows, 1), generator, torch.float64, probs.device)
        index = torch.searchsorted(cdf, u * mass.unsqueeze(1), right=True)
        index = torch.minimum(index, torch.searchsorted(cdf, mass.unsqueeze(1), right=False))
        rest.scatter_(1, index, 0.0)
        draws.append(torch.cat([index, live.long().unsqueeze(1)], dim=1))
    out: list[list[int]] = [[] for _ in range(rows)]
    for drawn in torch.stack(draws).tolist() if draws else []:  # one read for all draws
        for row, (tok, real) in enumerate(drawn):
            if real:
                out[row].append(tok)
    return out


class ModelTreeDrafter(Drafter):
    """A draft model with its own KV cache that expands a regular tree level by level."""

    name = "draft-tree"
    drafts_trees = True

    def __init__(self, backend: ModelBackend, branching: tuple[int, ...]) -> None:
        self.backend = backend
        self.branching = tuple(branching)
        self._cached: list[int] = []  # context tokens in the draft cache (a prefix of it)
        self._tree: TokenTree | None = None
        self._fed = 0  # tree nodes (root excluded) in the cache, after the context

    @property
    def cached_tokens(self) -> list[int]:
        """The context tokens whose keys/values the draft cache holds (tree nodes aside)."""
        return list(self._cached)

    def begin(self, req: RequestState) -> None:
        self._cached = prefill_prompt(self.backend, req.prompt_ids)
        self._tree = None
        self._fed = 0

    def _sync(self, context: list[int]) -> None:
        """Drop tree nodes left in the cache, then roll back to the common prefix."""
        if self.backend.cache_len > len(self._cached):  # fed nodes of an uncommitted tree
            self.backend.truncate(len(self._cached))
            self._fed = 0
            self._tree = None
        roll_back_to_common_prefix(self.backend, self._cached, context)

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        """A tree of at most `max_tokens` levels (the controller only bounds the depth: a
        tree's shape is fixed before drafting)."""
        context, params, generator = req.context, req.sampling, req.generator
        replacement = req.replacement
        self._sync(context)
        if len(self._cached) == len(context):  # feed at least the root: its logits
            self.backend.truncate(len(context) - 1)
            del self._cached[-1:]
        pending = context[len(self._cached) :]
        logits = feed(self.backend, pending)[-1:]  # where the draft ran
        self._cached.extend(pending)
        calls = 1
        base = len(context)  # cache index of the first tree node; the root sits at base - 1
        tree = TokenTree.root(context[-1])
        frontier = [0]
        rows: list[torch.Tensor] = []
        levels = fit_shape(self.branching[: max(0, max_tokens)], req.tree_nodes)
        # every parent gets `count` children (the top k, or draws with replacement): the
        # levels' tokens stay where the draft ran, fed back from there, read once at the end
        on_device = params.greedy or replacement
        drawn: list[torch.Tensor] = []  # each level's tokens [nodes], on_device only
        for depth, count in enumerate(levels, start=1):
            if params.greedy:
                k = min(count, logits.shape[-1])
                chosen = torch.topk(logits.float(), k, dim=-1).indices
            else:
                probs = process_logits(logits, params)
                rows.append(probs)
                if on_device:
                    chosen = draw_with_replacement(probs, count, generator)
            if on_device:
                level = chosen.reshape(-1)
                drawn.append(level)
                width = chosen.shape[1]
                new = tree.add_level([p for p in frontier for _ in range(width)],
                                     [0] * level.shape[0])  # ids filled in after the read
            else:
                picks = draw_children(probs, count, generator, replacement)
                parents = [par for par, kids in zip(frontier, picks, strict=True) for _ in kids]
                new = tree.add_level(parents, [t for kids in picks for t in kids])
                level = torch.tensor([tree.tokens[i] for i in new])
            if depth == len(levels):
                break  # the leaves need no draft logits
            mask = tree.ancestor_mask()[new[0] : new[-1] + 1, 1 : new[-1] + 1]
            full = torch.cat([torch.ones(len(new), base, dtype=torch.bool), mask], dim=1)
            logits = self.backend.forward(
                level,
                torch.full((len(new),), base - 1 + depth, dtype=torch.long),
                tree_mask=full,
            ).device_logits
            calls += 1
            self._fed = new[-1]
            frontier = new
        if drawn:
            tree.tokens[1:] = torch.cat(drawn).tolist()  # the tree's one read
        self._tree = tree
        return Proposal(
            tree=tree,
            probs=torch.cat(rows) if rows else None,
            forward_calls=calls,
            replacement=replacement if rows else None,
        )

    def commit(self, req: RequestState, path: list[int]) -> None:
        self._accept_path(path)
        self._sync(req.context)

    def _accept_path(self, path: list[int]) -> None:
        """Keep the context and the accepted nodes that were fed (all but a leaf)."""
        tree = self._tree
        if tree is None:
            return
        fed = [node for node in path if node <= self._fed]
        if fed == list(range(1, len(fed) + 1)):  # a prefix of the cache: just cut
            self.backend.truncate(len(self._cached) + len(fed))
        else:
            keep = list(range(len(self._cached))) + [len(self._cached) + i - 1 for i in fed]
            self.backend.keep(torch.tensor(keep, dtype=torch.long))
        self._cached.extend(tree.tokens[i] for i in fed)
        self._tree = None
        self._fed = 0


class PricedTreeDrafter(ModelTreeDrafter):
    """`tree=priced`: before each step, the candidate shape (chains of 1..8, trees such as
    4x2x2x1) with the most expected tokens per ms under `profile`; expected tokens from a
    running acceptance estimate per candidate rank, which starts at `prior` (the assumed
    DEFAULT_RANK_RATES) and learns from every verified step of the request: at each level the
    walk reached, the accepted candidate's rank is a hit and the ranks before it misses; at
    the level where it stopped, every candidate a miss."""

    name = "draft-tree-priced"

    def __init__(
        self,
        backend: ModelBackend,
        profile: CostProfile,
        max_nodes: int = DEFAULT_MAX_NODES,
        prior: Sequence[float] = DEFAULT_RANK_RATES,
    ) -> None:
        if profile.draft is None:
            raise InputError("tree=priced prices draft forwards: it needs a cost profile that "
                             "measured the draft (adaspec profile, with a draft model)")
        self.candidates = PricedBranching(max_nodes).candidates()
        super().__init__(backend, self.candidates[0])
        self.profile = profile
        self.max_nodes = max_nodes
        self.prior = tuple(prior)
        self.shapes: Counter[tuple[int, ...]] = Counter()  # chosen this request, for reports
        self._reset_rates()

    def _reset_rates(self) -> None:
        self.rank_rates = [RateEstimate(p) for p in self.prior]

    @property
    def rates(self) -> list[float]:
        return [r.rate for r in self.rank_rates]

    def begin(self, req: RequestState) -> None:
        super().begin(req)
        self._reset_rates()
        self.shapes = Counter()

    def propose(self, req: RequestState, max_tokens: int,
                controller: LengthController) -> Proposal:
        self.branching = choose_branching(
            self.profile, self.rates, self.candidates, max_tokens, self.max_nodes,
            len(req.context)
        )
        self.shapes[self.branching] += 1
        return super().propose(req, max_tokens, controller)

    def _accept_path(self, path: list[int]) -> None:
        if self._tree is not None:
            self._observe(self._tree, path)
        super()._accept_path(path)

    def _observe(self, tree: TokenTree, path: list[int]) -> None:
        last = len(self.rank_rates) - 1
        node = 0
        for level in range(1, tree.depth + 1):
            kids = tree.children[node]
            if not kids:
                break
            hit = path[level - 1] if level <= len(path) else None
            rank = kids.index(hit) if hit in kids else len(kids)
            for r in range(min(rank + 1, len(kids))):
                self.rank_rates[min(r, last)].add(1, int(r == rank))
            if hit is None or rank == len(kids):
                break
            node = hit
