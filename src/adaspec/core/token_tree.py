"""Token trees: shape configs, the flattened layout, attention masks and positions.

A tree hangs below its root, the last accepted context token. Node 0 is the root; the drafted
nodes follow level by level (breadth-first), siblings in the order they were drawn, so every
parent comes before its children and the nodes of one level are contiguous. Scoring the
flattened tree in one forward pass gives row i = the distribution of the token after the path
root -> ... -> node i, which is what the verifier needs at node i. A chain is a tree whose
every node has one child.

Which shape pays depends on the machine: where verifying more tokens is nearly free (a GPU)
wide trees buy accepted tokens cheaply; where every verified token costs a good part of a
forward (a CPU), a chain is usually best. `draft.model_tree.choose_branching` picks the shape
with the most expected tokens per millisecond under a cost profile (`tree=priced`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from adaspec.errors import InputError

DEFAULT_MAX_NODES = 64
PRICED_TREE = "priced"
OLD_PRICED_TREE = "auto"  # PRICED_TREE's name before issue 32: an InputError naming the new one

# The shapes `tree=priced` chooses from: chains of 1..8 tokens, and trees that spend their
# width at the first levels, where one more candidate catches the most misses.
CANDIDATE_SHAPES: tuple[tuple[int, ...], ...] = (
    *((1,) * k for k in range(1, 9)),
    (2, 1), (2, 1, 1), (2, 2, 1), (2, 2, 1, 1), (2, 2, 2, 1), (3, 2, 1), (3, 2, 1, 1),
    (4, 1), (4, 2, 1), (4, 2, 1, 1), (4, 2, 2, 1), (4, 2, 2, 1, 1), (4, 4, 2, 1),
    (8, 1), (8, 2, 1), (8, 4, 2, 1),
)
class PricedBranching(tuple):
    """`tree=priced`: no fixed shape, the drafter picks one per step
    (`draft.model_tree.choose_branching`).
    As a shape it is empty; it keeps the node limit and the depth bound of the candidates."""

    max_nodes: int

    def __new__(cls, max_nodes: int = DEFAULT_MAX_NODES) -> PricedBranching:
        obj = super().__new__(cls, ())
        obj.max_nodes = max_nodes
        return obj

    def candidates(self) -> list[tuple[int, ...]]:
        return [c for c in CANDIDATE_SHAPES if tree_node_count(c) <= self.max_nodes]

    @property
    def max_depth(self) -> int:
        return max(len(c) for c in self.candidates())

    def __repr__(self) -> str:
        return f"PricedBranching(max_nodes={self.max_nodes})"


def parse_branching(text: str, max_nodes: int = DEFAULT_MAX_NODES) -> tuple[int, ...]:
    """Parse a branching config such as ``4x2x2x1`` (4 candidates at depth 1, 2 children per
    node at depth 2, ...). The budget is the product of the factors (the number of
    root-to-leaf paths); the tree has sum over depths of the running product nodes, and that
    count must not exceed `max_nodes`. ``priced`` gives a PricedBranching (a shape per
    step)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("tree config is empty: give branching factors like 4x2x2x1")
    if text.strip().lower() == OLD_PRICED_TREE:
        raise InputError(f"tree={OLD_PRICED_TREE} is now tree={PRICED_TREE}")
    if text.strip().lower() == PRICED_TREE:
        if max_nodes < 1:
            raise InputError(f"tree={PRICED_TREE} needs max_nodes >= 1, got {max_nodes}")
        return PricedBranching(max_nodes)
    parts = text.strip().lower().split("x")
    factors: list[int] = []
    for part in parts:
        part = part.strip()
        if not part.isdigit():
            raise InputError(
                f"tree config {text!r}: {part!r} is not a positive integer; "
                "write the branching per level separated by 'x', e.g. 4x2x2x1"
            )
        factors.append(int(part))
    if any(f < 1 for f in factors):
        raise InputError(f"tree config {text!r}: every branching factor must be >= 1")
    nodes = tree_node_count(factors)
    if nodes > max_nodes:
        raise InputError(
            f"tree config {text!r} has {nodes} nodes (budget {math.prod(factors)} paths), "
            f"over the limit of {max_nodes} nodes; use smaller factors or raise max_nodes"
        )
    return tuple(factors)


def fit_shape(factors: Sequence[int], tokens: int | None) -> tuple[int, ...]:
    """`factors`, or where its nodes and root exceed `tokens` (what the target scores as one
    tree at this step, `RequestState.tree_nodes`; None: any) the chain of as many levels as
    fit."""
    shape = tuple(factors)
    if tokens is None or tree_node_count(shape) + 1 <= tokens:
        return shape
    return (1,) * min(len(shape), max(0, tokens - 1))


def tree_node_count(factors: Sequence[int]) -> int:
    """Drafted nodes (root excluded) of a regular tree with these branching factors."""
    total, width = 0, 1
    for f in factors:
        width *= f
        total += width
    return total


@dataclass
class TokenTree:
    """tokens[0] is the root (the last context token); parents[0] == -1 and
    parents[i] < i for i >= 1; nodes are in level order (depths never decrease)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        self.depths = [0] * len(self.tokens)
        self.children = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            par = self.parents[i]
            if not 0 <= par < i:
                raise ValueError(f"node {i}: parent {par} must come before it")
            if self.depths[par] + 1 < max(self.depths[i - 1], 1):
                raise ValueError(f"node {i}: nodes must be in level order")
            self.depths[i] = self.depths[par] + 1
            self.children[par].append(i)

    @classmethod
    def root(cls, token: int) -> TokenTree:
        return cls([int(token)], [-1])

    def add_level(self, parents: list[int], tokens: list[int]) -> list[int]:
        """Append one level of nodes (each with its parent, in order); return their indices."""
        start = len(self.tokens)
        for par, tok in zip(parents, tokens, strict=True):
            i = len(self.tokens)
            self.tokens.append(int(tok))
            self.parents.append(int(par))
            self.depths.append(self.depths[par] + 1)
            self.children.append([])
            self.children[par].append(i)
        return list(range(start, len(self.tokens)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return self.depths[-1]

    @property
    def drafted(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.tokens) - 1

    def level(self, d: int) -> list[int]:
        return [i for i, di in enumerate(self.depths) if di == d]

    def path(self, node: int) -> list[int]:
        """Node indices from the first level down to `node` (the root excluded)."""
        out: list[int] = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: True where node i may attend to node j (j is i or an ancestor)."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask

    def positions(self, root_position: int) -> torch.Tensor:
        """[n] absolute positions: the root's, plus each node's depth."""
        return torch.tensor(self.depths, dtype=torch.long) + root_position

    def flatten(self, root_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [n], positions [n], mask [n, n]) for one forward pass over the tree."""
        return (
            torch.tensor(self.tokens, dtype=torch.long),
            self.positions(root_position),
            self.ancestor_mask(),
        )

    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)
