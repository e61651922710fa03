"""Hand-set DISCO classifiers and artifacts for tests: their decisions are known in advance."""

from __future__ import annotations

import torch

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.control.disco_classifier import DiscoClassifier
from adaspec.control.disco_features import TOP_K, FeatureSpec

SPEC = FeatureSpec(generation_position=True)
DRAFT_POS = TOP_K + 1  # column of the position in the current draft under SPEC


def classifier_on(column: int, weight: float, bias: float, spec: FeatureSpec = SPEC):
    """P(accept) = sigmoid(weight * relu(feature[column]) + bias)."""
    model = DiscoClassifier(spec.size, hidden=4)
    with torch.no_grad():
        for p in model.net.parameters():
            p.zero_()
        model.net[0].weight[0, column] = 1.0
        model.net[2].weight[1, 0] = weight
        model.net[2].bias[1] = bias
    return model.eval()


def constant_classifier(p_accept: float, spec: FeatureSpec = SPEC):
    logit = float(torch.logit(torch.tensor(p_accept)))
    return classifier_on(0, 0.0, logit, spec)


def stop_at_position(n: int, spec: FeatureSpec = SPEC):
    """Accept probability high at draft positions < n - 1, low from n - 1 on: drafts n."""
    return classifier_on(DRAFT_POS, -20.0, 20.0 * (n - 1.5), spec)


def artifact(classifier, tau=0.5, sl_max=6, target="tiny-target", draft="tiny-draft", spec=SPEC):
    return DiscoArtifact(
        classifier=classifier, spec=spec, tau=tau, sl_max=sl_max, target=target, draft=draft
    )
