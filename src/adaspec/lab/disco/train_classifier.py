"""Train a DISCO artifact from a data file: the classifier on the train split of the chosen
suites, F1 on validation beside the F1 of the best static speculation length."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_classifier import (
    DiscoClassifier,
    f1_scores,
    static_predictions,
    train_classifier,
)
from adaspec.control.disco_features import FeatureSpec
from adaspec.errors import InputError
from adaspec.lab.disco.dataset import DiscoData, Sample, rows
from adaspec.lab.disco.simulate import DEFAULT_SL_MAXES

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
