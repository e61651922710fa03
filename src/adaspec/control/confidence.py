"""Confidence threshold: stop drafting once the draft's top probability falls below a
threshold (the dynamic schedule Hugging Face assisted generation uses by default, with
`assistant_confidence_threshold` 0.4), never drafting more than k tokens."""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.control.disco_features import distribution_features
from adaspec.errors import InputError

HF_DEFAULT_THRESHOLD = 0.4


class ConfidenceLength(LengthController):
    name = "confidence"

    def __init__(self, threshold: float = HF_DEFAULT_THRESHOLD, k: int = 8) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise InputError(f"confidence threshold must be in [0, 1], got {threshold}")
        if k < 1:
            raise InputError(f"confidence schedule needs k >= 1, got {k}")
        self.threshold = threshold
        self.k = k

    def max_tokens(self) -> int:
        return self.k

    def draft_numbers(self, draft_logits: torch.Tensor) -> torch.Tensor:
        # The same top-1 probability the tuner reads from collected data.
        return distribution_features(draft_logits)[:1]

    def decide(self, position: int, numbers: list[float]) -> bool:
        self.needs_distribution(numbers)
        return numbers[0] >= self.threshold
