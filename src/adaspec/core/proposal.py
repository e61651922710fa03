"""What a drafter hands the engine: one type for chains and trees.

A proposal is a token tree below the root (the last accepted context token); a chain is the
tree whose every node has one child. The engine scores every node in one target pass and a
verifier walks the tree from the root, so chain and tree steps differ only in this object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaspec.core.token_tree import TokenTree


@dataclass
class Proposal:
    """tree: the drafted tokens below the root (node 0).
    probs: [m, V] processed draft distributions, row i = the one node i's children were
        drawn from, for every node with children (the first m nodes; for a chain of k
        tokens, row i drew token i + 1); None when the tokens are deterministic (n-gram
        lookup, temperature 0): they then count as probability 1.
    replacement: how sibling candidates were drawn (i.i.d. or without replacement); the
        verifier checks it matches the rule it needs. None: no siblings were sampled.
    """

    tree: TokenTree
    probs: torch.Tensor | None = None
    forward_calls: int = 0  # draft model forward passes spent on it
    head_calls: int = 0  # draft head steps spent on it (a few % of a draft model's pass)
    replacement: bool | None = None
    # drafted tokens per part of the drafter that produced them (S2D: per exit), if it says
    drafted_by: dict[str, int] | None = None
    # the drafter's estimate, per drafted level, that it is accepted when the levels before
    # it are (a batch of requests prices how much of each draft to verify with it)
    accept: list[float] | None = None

    @classmethod
    def chain(
        cls,
        root: int,
        tokens: list[int],
        probs: torch.Tensor | None = None,
        forward_calls: int = 0,
        drafted_by: dict[str, int] | None = None,
        accept: list[float] | None = None,
        head_calls: int = 0,
    ) -> Proposal:
        tree = TokenTree([int(root), *map(int, tokens)], list(range(-1, len(tokens))))
        return cls(tree, probs, forward_calls, head_calls, drafted_by=drafted_by,
                   accept=accept)

    @property
    def depth(self) -> int:
        """Drafted positions (levels): what acceptance rates count, for chains and trees."""
        return self.tree.depth

    @property
    def is_chain(self) -> bool:
        return len(self.tree) == self.tree.depth + 1

    @property
    def tokens(self) -> list[int]:
        """The drafted tokens in node order (for a chain: the draft, in order)."""
        return self.tree.tokens[1:]

    def cut(self, k: int) -> Proposal:
        """The chain's first k drafted tokens (a batch verifies no more of it)."""
        if not self.is_chain:
            raise ValueError("only a chain is cut")
        if k >= self.depth:
            return self
        return Proposal.chain(
            self.tree.tokens[0], self.tokens[:k],
            None if self.probs is None or k == 0 else self.probs[:k], self.forward_calls,
            drafted_by={p: min(n, k) for p, n in (self.drafted_by or {}).items()} or None,
            accept=None if self.accept is None else self.accept[:k],
            head_calls=self.head_calls,
        )

    def tokens_on(self, path: list[int]) -> list[int]:
        return [self.tree.tokens[i] for i in path]

    def target_inputs(
        self, root_position: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens, positions, mask) for the target's one pass over root + drafted nodes; a
        chain needs neither positions nor a mask (the cache's own order is causal)."""
        if self.is_chain:
            return torch.tensor(self.tree.tokens, dtype=torch.long), None, None
        return self.tree.flatten(root_position)
