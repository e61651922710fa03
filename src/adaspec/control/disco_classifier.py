"""The DISCO classifier: a 2-layer feed-forward net that reads one feature row and gives the
probability that the token just drafted will be accepted (keep drafting when >= tau)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn import functional as F


class DiscoClassifier(nn.Module):
    """Standardise the features (statistics of the training set, kept as buffers so they
    travel with the weights), then Linear -> ReLU -> Linear to two classes."""

    mean: torch.Tensor  # buffers, registered in __init__
    std: torch.Tensor

    def __init__(self, n_features: int, hidden: int = 32) -> None:
        super().__init__()
        self.n_features = n_features
        self.hidden = hidden
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std)

    def accept_probability(self, x: torch.Tensor) -> torch.Tensor:
        """[..., F] features -> [...] P(accepted). The same arithmetic as `forward`, written
        as plain tensor ops on the current weights: the controller calls this after every
        drafted token, and the module-call machinery would cost more than the maths."""
        first, second = cast(nn.Linear, self.net[0]), cast(nn.Linear, self.net[2])
        with torch.inference_mode():
            hidden = F.linear((x - self.mean) / self.std, first.weight, first.bias).relu_()
            return F.linear(hidden, second.weight, second.bias).softmax(dim=-1)[..., 1]
