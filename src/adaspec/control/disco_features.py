"""DISCO's per-step features, the one definition shared by data collection and inference.

A feature vector describes one drafted token: the draft's top-k probabilities (sorted), the
entropy of its distribution, the token's position in the current draft and, optionally, its
position in the generation. Collection computes the distribution part for every position of
a teacher-forced pass at once; the controller computes it for one row of logits; both go
through `distribution_features` and `assemble`, so the two can never drift apart.

Cost (one 151,936-token row, one thread of this CPU): about 0.15 ms: two full passes
that write (x - max, its exp), two that only read, and a top-k on block maxima
(`top_values`) instead of over the whole vocabulary; no Python loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from adaspec.core.sampling import may_hold
from adaspec.errors import InputError

TOP_K = 10  # the paper's top-10 draft probabilities


@dataclass(frozen=True)
class FeatureSpec:
    """Which features a classifier reads; saved in the artifact so inference matches."""

    top_k: int = TOP_K
    entropy: bool = True
    draft_position: bool = True
    generation_position: bool = False

    @property
    def size(self) -> int:
        return (
            self.top_k
            + int(self.entropy)
            + int(self.draft_position)
            + int(self.generation_position)
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        try:
            spec = cls(**data)
        except TypeError as exc:
            raise InputError(f"unknown DISCO feature spec {data!r} ({exc})") from None
        if not 1 <= spec.top_k <= TOP_K:
            raise InputError(f"DISCO feature spec needs 1 <= top_k <= {TOP_K}, got {spec.top_k}")
        return spec


BLOCK = 128  # block width of the two-stage top-k: 151,936 = 1,187 blocks of 128


def top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values along the last dimension, sorted descending; equal to
    `x.topk(k).values`. `torch.topk` over a 151,936-wide row costs ~0.35 ms on this CPU, so
    it runs on the maxima of blocks of BLOCK logits first: the k best blocks by maximum hold
    k values at least as large as any value elsewhere, so the k largest values are among
    them (ties included)."""
    width = x.shape[-1]
    n_blocks = width // BLOCK
    if n_blocks <= k:  # a small vocabulary: one topk is cheap
        return x.topk(k, dim=-1).values
    lead = x.shape[:-1]
    blocks = x[..., : n_blocks * BLOCK].reshape(*lead, n_blocks, BLOCK)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices
    candidates = blocks.gather(-2, best.unsqueeze(-1).expand(*lead, k, BLOCK)).flatten(-2)
    if n_blocks * BLOCK < width:  # the tail that fills no block competes as it is
        candidates = torch.cat([candidates, x[..., n_blocks * BLOCK :]], dim=-1)
    return candidates.topk(k, dim=-1).values


def distribution_features(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] raw logits -> [..., TOP_K + 1]: the top-10 probabilities, then the entropy
    (nats). Computed in float32 whatever the model's dtype.

    The top-k runs on the raw logits (softmax keeps the order), so no normalised copy of
    the row is needed: with m the largest logit, e = exp(x - m) and Z = sum(e), the top
    probabilities are exp(top - m) / Z and the entropy is log Z - sum(e * (x - m)) / Z.
    Shifting by m keeps the terms small, so the float32 error stays below that of a
    log-softmax over the row."""
    x = logits.float()
    top = top_values(x, min(TOP_K, x.shape[-1]))
    shifted = x - top[..., :1]
    e = shifted.exp()
    z = e.sum(dim=-1, keepdim=True)
    weighted = torch.linalg.vecdot(e, shifted).unsqueeze(-1)
    if may_hold(~torch.isfinite(weighted)):  # -inf logits: e = 0 there, 0 * -inf = 0
        weighted = torch.linalg.vecdot(e, torch.where(e > 0, shifted, 0.0)).unsqueeze(-1)
    top = (top - top[..., :1]).exp() / z
    if top.shape[-1] < TOP_K:  # a vocabulary smaller than TOP_K: the rest have probability 0
        top = torch.nn.functional.pad(top, (0, TOP_K - top.shape[-1]))
    return torch.cat([top, z.log() - weighted / z], dim=-1)


def assemble(
    dist: torch.Tensor,
    draft_position: torch.Tensor | int,
    generation_position: torch.Tensor | int,
    spec: FeatureSpec,
) -> torch.Tensor:
    """Feature rows [..., spec.size] from `distribution_features` output and positions
    (tensors broadcast against the leading dimensions of `dist`)."""
    lead = dist.shape[:-1]
    parts = [dist[..., : spec.top_k]]
    if spec.entropy:
        parts.append(dist[..., TOP_K : TOP_K + 1])
    for wanted, pos in (
        (spec.draft_position, draft_position),
        (spec.generation_position, generation_position),
    ):
        if wanted:
            col = torch.as_tensor(pos, dtype=torch.float32).expand(lead)
            parts.append(col.unsqueeze(-1))
    return torch.cat(parts, dim=-1)


def draft_positions(hits: torch.Tensor) -> torch.Tensor:
    """Position in the current draft for each generated token, simulated from teacher-forced
    hits: the count of tokens since the last mismatch. A mismatch ends a draft (the target's
    correction is emitted, the next draft starts at position 0); token 0 comes from the
    prefill, so the first draft starts at token 1, position 0."""
    hits = hits.to(torch.bool)
    out = torch.zeros(hits.shape, dtype=torch.long)
    for i in range(2, int(hits.numel())):  # a few hundred entries per prompt, collection only
        out[i] = out[i - 1] + 1 if hits[i - 1] else 0
    return out
