"""Tree drafting: the draft model proposes several candidates per node, level by level.

One draft forward per level scores the whole frontier: the new level's nodes are fed as one
sequence with a mask over the draft's cache, so each node sees the context and its own
ancestors (earlier levels stay in the draft cache) and positions = depth after the context.
Children are drawn from the node's processed draft distribution q, with replacement (i.i.d.,
for MCSS Algorithm 1) or without (each next candidate from q renormalised without the ones
already drawn: Algorithm 2 and the naive verifier); at temperature 0 they are the top-k
distinct tokens. After verification `accept_path` compacts the draft cache to the accepted
path, so it holds exactly the accepted context, as the target's does.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from adaspec.control.base import LengthController
from adaspec.draft.base import Drafter, DraftProposal
from adaspec.draft.model import feed, prefill_prompt, roll_back_to_common_prefix
from adaspec.models.backend import ModelBackend
from adaspec.sampling import SamplingParams, process_logits
from adaspec.tree import TokenTree, TreeProposal


class TreeDrafter(Drafter):
    """A drafter that proposes token trees; the engine runs its tree step for these."""

    branching: tuple[int, ...]

    @abstractmethod
    def propose_tree(
        self,
        context: list[int],
        max_depth: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        replacement: bool,
    ) -> TreeProposal:
        """A tree below context[-1], at most `max_depth` levels deep."""

    def accept_path(self, path: list[int]) -> None:
        """The verifier accepted these nodes of the last proposed tree (root excluded)."""


def draw_children(
    probs: torch.Tensor, count: int, generator: torch.Generator | None, replacement: bool
) -> list[list[int]]:
    """`count` candidates from each row of probs [f, V] (processed, rows sum to 1).

    With replacement: i.i.d. by inverse CDF, one cumsum per row. Without: one draw at a time
    from the row with the earlier draws zeroed (sampling from the renormalised remainder);
    a row whose support runs out gets fewer children.
    """
    if replacement:
        cdf = probs.cumsum(-1, dtype=torch.float64)
        total = cdf[:, -1:].contiguous()
        u = torch.rand(probs.shape[0], count, generator=generator, dtype=torch.float64)
        index = torch.searchsorted(cdf, u * total, right=True)
        last = torch.searchsorted(cdf, total, right=False)  # last token with positive mass
        return torch.minimum(index, last).tolist()
    rest = probs.to(torch.float64).clone()
    out: list[list[int]] = [[] for _ in range(probs.shape[0])]
    for _ in range(count):
        mass = rest.sum(-1)
        live = mass > 0
        if not bool(live.any()):
            break
        cdf = rest.cumsum(-1)
        u = torch.rand(rest.shape[0], 1, generator=generator, dtype=torch.float64)
        index = torch.searchsorted(cdf, u * mass.unsqueeze(1), right=True)
        index = torch.minimum(index, torch.searchsorted(cdf, mass.unsqueeze(1), right=False))
        rest.scatter_(1, index, 0.0)
        for row, tok in enumerate(index.squeeze(1).tolist()):
            if live[row]:
                out[row].append(tok)
    return out


class ModelTreeDrafter(TreeDrafter):
    """A draft model with its own KV cache that expands a regular tree level by level."""

    name = "draft-tree"

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

    def start(self, prompt_ids: list[int]) -> None:
        self._cached = prefill_prompt(self.backend, prompt_ids)
        self._tree = None
        self._fed = 0

    def _sync(self, context: list[int]) -> None:
        """Drop tree nodes left in the cache, then roll back to the common prefix."""
        if self._fed or self.backend.cache_len > len(self._cached):
            self.backend.truncate(len(self._cached))
            self._fed = 0
            self._tree = None
        roll_back_to_common_prefix(self.backend, self._cached, context)

    def propose_tree(
        self,
        context: list[int],
        max_depth: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        replacement: bool,
    ) -> TreeProposal:
        self._sync(context)
        if len(self._cached) == len(context):  # feed at least the root: its logits
            self.backend.truncate(len(context) - 1)
            del self._cached[-1:]
        pending = context[len(self._cached) :]
        logits = feed(self.backend, pending)[-1:]
        self._cached.extend(pending)
        calls = 1
        base = len(context)  # cache index of the first tree node; the root sits at base - 1
        tree = TokenTree.root(context[-1])
        frontier = [0]
        rows: list[torch.Tensor] = []
        levels = self.branching[: max(0, max_depth)]
        for depth, count in enumerate(levels, start=1):
            if params.greedy:
                k = min(count, logits.shape[-1])
                picks = torch.topk(logits.float(), k, dim=-1).indices.tolist()
            else:
                probs = process_logits(logits, params)
                rows.append(probs)
                picks = draw_children(probs, count, generator, replacement)
            parents = [par for par, kids in zip(frontier, picks, strict=True) for _ in kids]
            new = tree.add_level(parents, [t for kids in picks for t in kids])
            if depth == len(levels):
                break  # the leaves need no draft logits
            mask = tree.ancestor_mask()[new[0] : new[-1] + 1, 1 : new[-1] + 1]
            full = torch.cat([torch.ones(len(new), base, dtype=torch.bool), mask], dim=1)
            logits = self.backend.forward(
                torch.tensor([tree.tokens[i] for i in new]),
                torch.full((len(new),), base - 1 + depth, dtype=torch.long),
                tree_mask=full,
            ).logits
            calls += 1
            self._fed = new[-1]
            frontier = new
        self._tree = tree
        return TreeProposal(
            tree=tree,
            probs=torch.cat(rows) if rows else None,
            forward_calls=calls,
            replacement=replacement,
        )

    def accept_path(self, path: list[int]) -> None:
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

    def propose(
        self,
        context: list[int],
        max_tokens: int,
        controller: LengthController,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        """A chain, for the chain step: a tree with one child per node, whose nodes sit in
        the cache exactly where the sequence would."""
        saved = self.branching
        self.branching = (1,) * max_tokens
        try:
            proposal = self.propose_tree(context, max_tokens, params, generator, True)
        finally:
            self.branching = saved
        self._cached.extend(proposal.tree.tokens[1 : self._fed + 1])
        self._fed = 0
        self._tree = None
        return DraftProposal(
            tokens=proposal.tree.tokens[1:],
            probs=proposal.probs,
            forward_calls=proposal.forward_calls,
        )

    def commit(self, context: list[int]) -> None:
        self._sync(context)
