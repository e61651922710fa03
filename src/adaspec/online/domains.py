"""Which domain's draft serves a request: one shared draft, the request's `domain` field, or
a classifier that learns from the requests that name their domain and labels the others."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaspec.errors import InputError

DOMAIN_SOURCES = ("shared", "field", "classifier")
DEFAULT = "default"


class DomainClassifier:
    """Nearest centroid over the prompt's token counts hashed into `dims` buckets (unit
    length): cheap, online, and enough to tell code from translation from chat."""

    def __init__(self, dims: int = 4096) -> None:
        self.dims = dims
        self.sums: dict[str, torch.Tensor] = {}

    def features(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        v = torch.zeros(self.dims)
        ids = torch.tensor(list(prompt_ids), dtype=torch.int64) % self.dims
        v.index_add_(0, ids, torch.ones(len(ids)))
        return v / v.norm().clamp_min(1e-9)

    def learn(self, prompt_ids: Sequence[int], domain: str) -> None:
        f = self.features(prompt_ids)
        self.sums[domain] = self.sums.get(domain, torch.zeros(self.dims)) + f

    def predict(self, prompt_ids: Sequence[int]) -> str | None:
        if not self.sums:
            return None
        f = self.features(prompt_ids)
        scores = {d: float(f @ (s / s.norm().clamp_min(1e-9))) for d, s in self.sums.items()}
        return max(scores, key=scores.__getitem__)


class DomainChooser:
    def __init__(self, source: str = "shared") -> None:
        if source not in DOMAIN_SOURCES:
            raise InputError(f"domains must be one of {DOMAIN_SOURCES}, got {source!r}")
        self.source = source
        self.classifier = DomainClassifier() if source == "classifier" else None

    def choose(self, requested: str | None, prompt_ids: Sequence[int]) -> str:
        if self.source == "shared":
            return DEFAULT
        if requested:
            if self.classifier is not None:
                self.classifier.learn(prompt_ids, requested)
            return requested
        if self.classifier is not None:
            return self.classifier.predict(prompt_ids) or DEFAULT
        return DEFAULT
