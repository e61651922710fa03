"""DISCO length controller: after each drafted token a small classifier reads the draft's
distribution features and says whether that token will be accepted; below tau the draft
hands over to the target. At most SL_max tokens per draft. Both come from the tuned artifact
(`adaspec disco tune`) unless the method string overrides them."""

from __future__ import annotations

import torch

from adaspec.control.base import LengthController
from adaspec.control.cursor import GenerationCursor
from adaspec.control.disco_features import assemble, distribution_features
from adaspec.disco.artifact import DiscoArtifact
from adaspec.errors import InputError


class DiscoLength(LengthController):
    name = "disco"

    def __init__(
        self, artifact: DiscoArtifact, tau: float | None = None, sl_max: int | None = None
    ) -> None:
        self.artifact = artifact
        self.tau = artifact.tau if tau is None else tau
        self.sl_max = artifact.sl_max if sl_max is None else sl_max
        if not 0.0 <= self.tau <= 1.0:
            raise InputError(f"DISCO threshold tau must be in [0, 1], got {self.tau}")
        if self.sl_max < 1:
            raise InputError(f"DISCO sl_max must be >= 1, got {self.sl_max}")
        self.cursor = GenerationCursor()
        self.last_probability: float | None = None

    @classmethod
    def from_file(cls, path: str, tau: float | None = None, sl_max: int | None = None):
        if not path:
            raise InputError(
                "ctrl=disco needs disco=PATH, an artifact from `adaspec disco train` / `tune`"
            )
        return cls(DiscoArtifact.load(path), tau, sl_max)

    def check_models(self, target: str, draft: str) -> None:
        """Called by build_engine with the backends' names."""
        self.artifact.check_pair(target, draft)

    def start(self) -> None:
        self.cursor.start()

    def max_tokens(self) -> int:
        self.cursor.begin_step()
        return self.sl_max

    @torch.inference_mode()
    def keep_drafting(self, position: int, draft_logits: torch.Tensor | None) -> bool:
        if draft_logits is None:
            raise InputError("ctrl=disco needs a drafter with a distribution (draft:...)")
        x = assemble(
            distribution_features(draft_logits),
            position,
            self.cursor.next + position,
            self.artifact.spec,
        )
        self.last_probability = float(self.artifact.classifier.accept_probability(x))
        return self.last_probability >= self.tau

    def update(self, drafted: int, accepted: int) -> None:
        self.cursor.end_step(accepted)
