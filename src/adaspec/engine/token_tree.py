"""Token trees: shape configs, the flattened layout, attention masks and positions.

A tree hangs below its root, the last accepted context token. Node 0 is the root; the drafted
nodes follow level by level (breadth-first), siblings in the order they were drawn, so every
parent comes before its children and the nodes of one level are contiguous. Scoring the
flattened tree in one forward pass gives row i = the distribution of the token after the path
root -> ... -> node i, which is what the verifier needs at node i. A chain is a tree whose
every node has one child.

Which shape pays depends on the machine: where verifying more tokens is nearly free (a GPU)
wide trees buy accepted tokens cheaply; where every verified token costs a good part of a
forward (a CPU), a chain is usually best. `choose_branching` picks the shape with the most
expected tokens per millisecond under a cost profile (`tree=auto`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from adaspec.errors import InputError

if TYPE_CHECKING:
    from adaspec.cost.profile import CostProfile

DEFAULT_MAX_NODES = 64
AUTO_TREE = "auto"

# The shapes `tree=auto` chooses from: chains of 1..8 tokens, and trees that spend their
# width at the first levels, where one more candidate catches the most misses.
CANDIDATE_SHAPES: tuple[tuple[int, ...], ...] = (
    *((1,) * k for k in range(1, 9)),
    (2, 1), (2, 1, 1), (2, 2, 1), (2, 2, 1, 1), (2, 2, 2, 1), (3, 2, 1), (3, 2, 1, 1),
    (4, 1), (4, 2, 1), (4, 2, 1, 1), (4, 2, 2, 1), (4, 2, 2, 1, 1), (4, 4, 2, 1),
    (8, 1), (8, 2, 1), (8, 4, 2, 1),
)
# Assumed acceptance per candidate rank, before a request has shown its own: the chance that
# the draft's r-th candidate is the target's token given that the ones before it were not.
# Rank 1 agrees about 60% of the time for a small draft of the same family; a second
# candidate catches about a third of the misses, further ones fewer and fewer (top-2 covers
# 74%, top-4 82%, top-8 88%). A running estimate per request replaces them as steps are
# verified (`draft.model_tree.AutoTreeDrafter`).
DEFAULT_RANK_RATES = (0.6, 0.35, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05)


class AutoBranching(tuple):
    """`tree=auto`: no fixed shape, the drafter picks one per step (`choose_branching`).
    As a shape it is empty; it keeps the node limit and the depth bound of the candidates."""

    max_nodes: int

    def __new__(cls, max_nodes: int = DEFAULT_MAX_NODES) -> AutoBranching:
        obj = super().__new__(cls, ())
        obj.max_nodes = max_nodes
        return obj

    def candidates(self) -> list[tuple[int, ...]]:
        return [c for c in CANDIDATE_SHAPES if tree_node_count(c) <= self.max_nodes]

    @property
    def max_depth(self) -> int:
        return max(len(c) for c in self.candidates())

    def __repr__(self) -> str:
        return f"AutoBranching(max_nodes={self.max_nodes})"


def parse_branching(text: str, max_nodes: int = DEFAULT_MAX_NODES) -> tuple[int, ...]:
    """Parse a branching config such as ``4x2x2x1`` (4 candidates at depth 1, 2 children per
    node at depth 2, ...). The budget is the product of the factors (the number of
    root-to-leaf paths); the tree has sum over depths of the running product nodes, and that
    count must not exceed `max_nodes`. ``auto`` gives an AutoBranching (a shape per step)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("tree config is empty: give branching factors like 4x2x2x1")
    if text.strip().lower() == AUTO_TREE:
        if max_nodes < 1:
            raise InputError(f"tree=auto needs max_nodes >= 1, got {max_nodes}")
        return AutoBranching(max_nodes)
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


def tree_node_count(factors: tuple[int, ...] | list[int]) -> int:
    """Drafted nodes (root excluded) of a regular tree with these branching factors."""
    total, width = 0, 1
    for f in factors:
        width *= f
        total += width
    return total


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
