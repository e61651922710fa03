"""What a request's decode loop yields (`Engine.steps`): the chunks of text and tokens it
emits, its final result, and the target calls it needs a driver (`engine/batch.py`) to run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from adaspec.backends.base import ForwardOutput, ModelBackend
from adaspec.core.metrics import RequestStats
from adaspec.core.proposal import Proposal
from adaspec.core.sampling import TokenLogprob


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: RequestStats
    finish_reason: str  # "eos" | "length" | "stop"
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them


# How a token came out of a step: a drafted token the target accepted, the target's own token
# after a rejected draft (correction) or after a fully accepted one (bonus), or a step that
# drafted nothing (plain). The first token, from the prefill, is plain.
ACCEPTED, CORRECTION, BONUS, PLAIN = "accepted", "correction", "bonus", "plain"


@dataclass
class StreamChunk:
    text: str  # newly final text (held back while it could still be part of a stop string)
    token_ids: list[int]  # tokens accepted in this step
    sources: list[str] = field(default_factory=list)  # per token: ACCEPTED | CORRECTION | ...
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked for


@dataclass
class TargetCall:
    """A target pass a request needs: `Engine.steps` yields it, a driver runs it alone
    (`run`) or with other requests' calls in one runtime call (engine/batch.py) and sets
    `out`. A step's call carries its chain or tree; a batch may cut a chain shorter first."""

    backend: ModelBackend
    tokens: torch.Tensor  # [n]
    positions: torch.Tensor | None = None  # [n], tree steps
    mask: torch.Tensor | None = None  # [n, n], tree steps
    prompt_reuse: int | None = None  # a prompt: leading tokens the cache may keep (prefill)
    cached: int = 0  # a prompt: leading tokens its cache held (set where the runner knows it)
    proposal: Proposal | None = None  # a step's: the root and the drafted nodes
    root: int = 0  # a step's: cache index and position of the root
    fixed: bool = False  # a step whose draft may not be cut (its random draws depend on it)
    out: ForwardOutput | None = None
    remaining: int = 0  # tokens its request may still emit (its budget left)
    seconds: float = 0.0  # how long the pass took, the device's queue drained (run alone)

    def run(self) -> ForwardOutput:
        t0 = time.perf_counter()
        if self.prompt_reuse is not None:
            self.out = self.backend.prefill(self.tokens, reuse=self.prompt_reuse)
            self.cached = self.out.cached
        else:
            self.out = self.backend.forward(self.tokens, self.positions, self.mask)
        self.backend.synchronize()  # the step's one wait for the device; its read-back is next
        self.seconds = time.perf_counter() - t0
        return self.out

    def cut(self, k: int) -> None:
        """Verify the chain's first k drafted tokens only."""
        assert self.proposal is not None and self.out is None
        self.proposal = self.proposal.cut(k)
        self.tokens, self.positions, self.mask = self.proposal.target_inputs(self.root)
