"""Train a DISCO artifact from a data file: the classifier on the train split of the chosen
suites, F1 on validation beside the F1 of the best static speculation length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_classifier import DiscoClassifier
from adaspec.control.disco_features import FeatureSpec
from adaspec.errors import InputError
from adaspec.lab.disco.dataset import DiscoData, Sample, rows
from adaspec.lab.disco.simulate import DEFAULT_SL_MAXES


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

UNTUNED_TAU = 0.5  # the classifier's own decision boundary, until `adaspec disco tune`


def select(data: DiscoData, split: str, suites: Sequence[str]) -> list[Sample]:
    unknown = set(suites) - set(data.suites)
    if unknown:
        raise InputError(
            f"suite(s) {', '.join(sorted(unknown))} not in the data (it has {data.suites})"
        )
    return [s for s in data.split(split) if s.suite in suites]


def classification_metrics(
    samples: Sequence[Sample],
    classifier: DiscoClassifier,
    spec: FeatureSpec,
    tau: float,
    static_k: int | None = None,
    static_ks: Sequence[int] = DEFAULT_SL_MAXES,
) -> dict:
    """F1 of the classifier at tau and of static lengths seen as classifiers (keep drafting
    before position k - 1). static_k given: that length only (chosen elsewhere); otherwise
    the best F1 over static_ks."""
    x, y, pos = rows(samples, spec)
    if len(y) == 0:
        return {"rows": 0}
    pred = classifier.accept_probability(x) >= tau
    statics = {k: f1_scores(static_predictions(pos, k), y) for k in static_ks}
    k_best = static_k or max(statics, key=lambda k: statics[k]["f1_macro"])
    return {
        "rows": len(y),
        "accept_rate": float(y.float().mean()),
        "tau": tau,
        "classifier": f1_scores(pred, y),
        "static_k": k_best,
        "static": f1_scores(static_predictions(pos, k_best), y),
        "static_all": {str(k): v["f1_macro"] for k, v in statics.items()},
    }


def train_artifact(
    data: DiscoData,
    suites: Sequence[str],
    spec: FeatureSpec,
    hidden: int = 32,
    epochs: int = 400,
    seed: int = 0,
) -> DiscoArtifact:
    train, val = select(data, "train", suites), select(data, "val", suites)
    if not train or not val:
        raise InputError(
            f"suites {list(suites)} need prompts in both the train and val splits of the data "
            f"(train {len(train)}, val {len(val)}): collect more prompts"
        )
    x_tr, y_tr, _ = rows(train, spec)
    x_va, y_va, _ = rows(val, spec)
    torch.manual_seed(seed)
    result = train_classifier(x_tr, y_tr, x_va, y_va, hidden=hidden, epochs=epochs, seed=seed)
    prov = data.provenance
    val_metrics = classification_metrics(val, result.model, spec, UNTUNED_TAU)
    metrics = {
        "train_rows": len(y_tr),
        "train_accept_rate": float(y_tr.float().mean()),
        "epochs": result.epochs,
        "best_epoch": result.best_epoch,
        "val_loss": result.val_loss,
        "val": val_metrics,
    }
    provenance = {
        "data": prov,
        "train_suites": list(suites),
        "train_prompts": [s.prompt_id for s in train],
        "val_prompts": [s.prompt_id for s in val],
    }
    return DiscoArtifact(
        classifier=result.model,
        spec=spec,
        tau=UNTUNED_TAU,
        sl_max=max(DEFAULT_SL_MAXES),
        target=str(prov.get("target", "")),
        draft=str(prov.get("draft", "")),
        provenance=provenance,
        metrics=metrics,
    )
