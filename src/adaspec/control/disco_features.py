"""DISCO's per-step features, the one definition shared by data collection and inference.

A feature vector describes one drafted token: the draft's top-k probabilities (sorted), the
entropy of its distribution, the token's position in the current draft and, optionally, its
position in the generation. Collection computes the distribution part for every position of
a teacher-forced pass at once; the controller computes it for one row of logits; both go
through `distribution_features` and `assemble`, so the two can never drift apart.

Cost: one float32 log-softmax and one `torch.topk` over the vocabulary, no Python loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

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


def distribution_features(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] raw logits -> [..., TOP_K + 1]: the top-10 probabilities, then the entropy
    (nats). Computed in float32 whatever the model's dtype."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1).values.exp()
    if top.shape[-1] < TOP_K:  # a vocabulary smaller than TOP_K: the rest have probability 0
        top = torch.nn.functional.pad(top, (0, TOP_K - top.shape[-1]))
    entropy = -(logp.exp() * logp).nan_to_num().sum(dim=-1, keepdim=True)  # 0 * -inf = 0
    return torch.cat([top, entropy], dim=-1)


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
