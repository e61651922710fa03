"""What the engine keeps of a request for distillation: the target's distribution (top-k
probabilities; the rest of the mass is their complement) at verified positions where the
draft's token was rejected, or at every drafted position, plus the request's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

RECORD_MODES = ("rejected", "all")


@dataclass
class RequestRecord:
    """One finished request. Position p is the target's distribution of tokens[p] given
    tokens[:p]; `top_ids`/`top_probs` are [n, k] for the n recorded positions."""

    tokens: list[int]  # prompt + generated tokens
    prompt_len: int
    positions: list[int]
    top_ids: torch.Tensor  # [n, k] int64
    top_probs: torch.Tensor  # [n, k] float32
    domain: str = "default"
    drafted: int = 0  # the request's speculation stats (drafted / accepted tokens)
    accepted: int = 0

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def __len__(self) -> int:
        return len(self.positions)


def compact(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution at temperature 1, kept as its top-k ids and probabilities
    (computed where the logits are; only those come back to the host)."""
    probs = torch.softmax(logits.float(), dim=-1)
    k = min(top_k, probs.shape[-1])
    values, ids = torch.topk(probs, k, dim=-1)
    return ids.to(torch.int64).cpu(), values.cpu()


@dataclass
class Recorder:
    """A request's hook (`RequestState.recorder`, handed in with `stream_steps(recorder=)`):
    `begin` at its start, `step` after every verification; `take` hands its record over."""

    top_k: int = 32
    mode: str = "rejected"
    _prompt: list[int] = field(default_factory=list)
    _positions: list[int] = field(default_factory=list)
    _ids: list[torch.Tensor] = field(default_factory=list)
    _probs: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in RECORD_MODES:
            raise ValueError(f"record mode must be one of {RECORD_MODES}, got {self.mode!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")

    def begin(self, prompt_ids: list[int]) -> None:
        self._prompt = list(prompt_ids)
        self._positions, self._ids, self._probs = [], [], []

    def step(self, root: int, depth: int, path: list[int], target_logits: torch.Tensor,
             features: torch.Tensor | None = None) -> None:
        """After a verification: `root` is the last context token's position, `depth` the
        proposal's levels (0: nothing drafted), `path` the accepted nodes (row i of
        `target_logits` is node i's prediction, row 0 the root's)."""
        if depth == 0:
            return
        if self.mode == "rejected":
            if len(path) == depth:
                return  # all accepted: nothing missed
            rows = [path[-1] if path else 0]
            first = root + 1 + len(path)
        else:
            rows = [0, *path]
            first = root + 1
        ids, probs = compact(target_logits[rows], self.top_k)
        self._positions.extend(range(first, first + len(rows)))
        self._ids.append(ids)
        self._probs.append(probs)

    def take(self, generated: list[int], domain: str = "default", drafted: int = 0,
             accepted: int = 0) -> RequestRecord:
        """The record of the request that just ended (positions past its last kept token,
        cut by a stop string, are dropped)."""
        tokens = self._prompt + list(generated)
        k = self.top_k
        ids = torch.cat(self._ids) if self._ids else torch.zeros(0, k, dtype=torch.int64)
        probs = torch.cat(self._probs) if self._probs else torch.zeros(0, k)
        keep = [i for i, p in enumerate(self._positions) if p < len(tokens)]
        record = RequestRecord(tokens, len(self._prompt), [self._positions[i] for i in keep],
                               ids[keep], probs[keep], domain, drafted, accepted)
        self.begin([])
        return record
