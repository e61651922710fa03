"""One request being decoded: the object its drafter and hooks are handed.

The engine creates a `RequestState` when a request starts and is the only writer of it: it
extends the context as tokens are accepted and counts what is emitted. A drafter reads
from it what it needs to propose (`Drafter.begin(req)`, `propose(req, ...)`,
`commit(req, path)`): the accepted context, the sampling settings and random generator,
the budget left and, decoded with other requests, its place in their round. So nothing
sets a drafter's attributes from outside, and the per-request inputs of a step are in one
place (llama.cpp's `common_speculative` takes the same shape: one handle per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from adaspec.core.metrics import RequestStats
from adaspec.core.sampling import SamplingParams

if TYPE_CHECKING:
    from adaspec.core.grammar import Constraint
    from adaspec.cost.batch import Seat


class StepHook(Protocol):
    """Sees a request's verifications (online distillation's `online.record.Recorder`, the
    draft head's `online.head.HeadRecorder`)."""

    def begin(self, prompt_ids: list[int]) -> None: ...

    def step(self, root: int, depth: int, path: list[int], target_logits: torch.Tensor,
             features: torch.Tensor | None = None) -> None:
        """`features`: the target's states [1 + len(path), H] of the root and the accepted
        nodes, where its runtime records them (a draft head drafts)."""


@dataclass(eq=False)
class RequestState:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    # how the verifier draws sibling candidates (a drafter of trees follows it)
    replacement: bool = False
    # decoded with other requests: its place in their round, which a drafter that prices
    # its drafts prices them against (None: priced as a request alone)
    seat: Seat | None = None
    recorder: StepHook | None = None
    # prompt + accepted tokens; the last one is the root of the next draft
    context: list[int] = field(default_factory=list)
    emitted: int = 0  # tokens handed to the caller so far
    # the target's final-normed states [n, H] of the accepted positions features_start ..
    # features_start + n - 1, from the passes that scored them (a draft head's input; None:
    # the runtime gives none)
    features: torch.Tensor | None = None
    features_start: int = 0
    # what the output must match (`sampling.grammar` compiled for this request), advanced by
    # the engine with the accepted tokens; None: unconstrained
    constraint: Constraint | None = None
    # the most tokens (root included) the target scores as one tree at this step (its
    # cache's layout, `ModelBackend.tree_room`), told by the engine before each proposal;
    # None: any tree
    tree_nodes: int | None = None

    def __post_init__(self) -> None:
        if not self.context:
            self.context = list(self.prompt_ids)

    @classmethod
    def of(cls, context: list[int], sampling: SamplingParams | None = None,
           generator: torch.Generator | None = None, replacement: bool = False,
           remaining: int = 0, seat: Seat | None = None) -> RequestState:
        """A request at `context` outside an engine (a drafter driven by hand: tests, the
        lab), with `remaining` tokens of budget left (0: not known)."""
        return cls(list(context), remaining, sampling or SamplingParams(), generator,
                   replacement=replacement, seat=seat, context=list(context))

    @property
    def remaining(self) -> int:
        """Tokens the request may still emit, counting the one its next step always makes
        (its budget left); 0: not known."""
        return max(0, self.max_new_tokens - self.emitted) if self.max_new_tokens else 0

    @property
    def generated(self) -> list[int]:
        """The accepted tokens after the prompt."""
        return self.context[len(self.prompt_ids):]

    def accept(self, tokens: list[int]) -> None:
        """The engine's: `tokens` were accepted after the context."""
        self.context = self.context + list(tokens)

    def keep_features(self, start: int, rows: torch.Tensor) -> None:
        """The engine's: the target's states [n, H] of positions start .. start + n - 1
        (those from `start` on replace what was kept; a gap starts the record again)."""
        if self.features is None or start > self.features_start + len(self.features) \
                or start < self.features_start:
            self.features, self.features_start = rows, start
            return
        self.features = torch.cat([self.features[: start - self.features_start], rows])

    def features_of(self, start: int, end: int) -> tuple[int, torch.Tensor | None]:
        """The kept states of positions [max(start, first kept), end): (that first position,
        rows [n, H]); rows None where none of them is kept."""
        if self.features is None:
            return start, None
        first = max(start, self.features_start)
        last = min(end, self.features_start + len(self.features))
        if last <= first:
            return first, None
        return first, self.features[first - self.features_start : last - self.features_start]

    def count_emitted(self, n: int) -> None:
        """The engine's: `n` more tokens went out to the caller."""
        self.emitted += n
