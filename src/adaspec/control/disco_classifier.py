"""The DISCO classifier: a 2-layer feed-forward net that reads one feature row and gives the
probability that the token just drafted will be accepted (keep drafting when >= tau)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from adaspec.errors import InputError


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


@dataclass
class TrainResult:
    model: DiscoClassifier
    epochs: int
    best_epoch: int
    val_loss: float


def train_classifier(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    hidden: int = 32,
    epochs: int = 400,
    lr: float = 1e-2,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> TrainResult:
    """Full-batch Adam on cross-entropy (a few thousand rows: a second on one core); keeps the
    weights of the epoch with the lowest validation loss."""
    if len(x_train) == 0 or len(x_val) == 0:
        raise InputError("DISCO training needs rows in both the train and validation splits")
    if x_train.shape[1] != x_val.shape[1]:
        raise InputError("train and validation features have different widths")
    torch.manual_seed(seed)
    model = DiscoClassifier(x_train.shape[1], hidden)
    std = x_train.std(dim=0)
    model.mean.copy_(x_train.mean(dim=0))
    model.std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    y_train, y_val = y_train.long(), y_val.long()
    best = (float("inf"), 0, {k: v.clone() for k, v in model.state_dict().items()})
    for epoch in range(1, epochs + 1):
        model.train()
        opt.zero_grad()
        loss = loss_fn(model(x_train), y_train)
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            val = float(loss_fn(model(x_val), y_val))
        if val < best[0]:
            best = (val, epoch, {k: v.clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    model.eval()
    return TrainResult(model=model, epochs=epochs, best_epoch=best[1], val_loss=best[0])


def f1_scores(pred: torch.Tensor, label: torch.Tensor) -> dict:
    """F1 of each class (1 = accepted / keep drafting, 0 = rejected / stop) and their mean."""
    pred, label = pred.bool(), label.bool()
    out = {}
    for name, p, t in (("f1_accept", pred, label), ("f1_reject", ~pred, ~label)):
        tp = int((p & t).sum())
        fp = int((p & ~t).sum())
        fn = int((~p & t).sum())
        out[name] = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0
    out["f1_macro"] = (out["f1_accept"] + out["f1_reject"]) / 2
    out["accuracy"] = float((pred == label).float().mean()) if len(label) else 0.0
    return out


def static_predictions(draft_pos: torch.Tensor, k: int) -> torch.Tensor:
    """A static speculation length k as a classifier: keep drafting after positions 0..k-2,
    stop after position k-1."""
    return draft_pos < k - 1
