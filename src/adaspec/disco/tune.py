"""Choose tau and SL_max by simulated latency on the validation split, and tune the
baselines the same way (best static k; the confidence rule's threshold and bound), so every
method is tuned on the same data with the same measured costs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaspec.control.disco_features import FeatureSpec, assemble
from adaspec.disco.classifier import DiscoClassifier
from adaspec.disco.data import Sample
from adaspec.disco.simulate import NEVER_STOP, Costs, SimResult, simulate_all

DEFAULT_TAUS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95
DEFAULT_SL_MAXES = tuple(range(1, 9))  # the static k = 1..8
ORACLE_CAP = 16  # the oracle controller's default k_max


@torch.inference_mode()
def disco_scores(
    sample: Sample, classifier: DiscoClassifier, spec: FeatureSpec, positions: int
) -> torch.Tensor:
    """[n, positions]: P(accepted) of token i if it were drafted at draft position d."""
    n = len(sample.hits)
    dist = sample.dist.unsqueeze(1).expand(n, positions, sample.dist.shape[-1])
    x = assemble(dist, torch.arange(positions)[None, :], torch.arange(n)[:, None], spec)
    return classifier.accept_probability(x)


def confidence_scores(sample: Sample, positions: int) -> torch.Tensor:
    """[n, positions]: the draft's top probability, whatever the draft position."""
    return sample.dist[:, :1].expand(len(sample.hits), positions)


def _best(table: list[dict]) -> dict:
    """Lowest simulated ms/token; ties go to the shorter draft, then the higher threshold."""
    return min(table, key=lambda r: (round(r["ms_per_token"], 6), r["sl_max"], -r["threshold"]))


def _row(threshold: float, sl_max: int, res: SimResult) -> dict:
    return {"threshold": threshold, "sl_max": sl_max, **res.to_dict()}


def tune(
    samples: Sequence[Sample],
    costs: Costs,
    classifier: DiscoClassifier,
    spec: FeatureSpec,
    taus: Sequence[float] = DEFAULT_TAUS,
    sl_maxes: Sequence[int] = DEFAULT_SL_MAXES,
    oracle_cap: int = ORACLE_CAP,
) -> dict:
    """Simulated latency of every setting on `samples`; the best of each family."""
    positions = max(sl_maxes)
    hits = [s.hits.tolist() for s in samples]
    d_scores = [disco_scores(s, classifier, spec, positions) for s in samples]
    c_scores = [confidence_scores(s, positions) for s in samples]
    nones = [None] * len(samples)
    static = [
        _row(NEVER_STOP, k, simulate_all(hits, nones, NEVER_STOP, k, costs)) for k in sl_maxes
    ]
    disco = [_row(t, k, simulate_all(hits, d_scores, t, k, costs)) for t in taus for k in sl_maxes]
    conf = [_row(t, k, simulate_all(hits, c_scores, t, k, costs)) for t in taus for k in sl_maxes]
    oracle = simulate_all(hits, nones, NEVER_STOP, oracle_cap, costs, oracle=True)
    ar = costs.target(1)  # plain decoding: one target forward per token
    return {
        "prompts": len(samples),
        "tokens": sum(len(h) for h in hits),
        "costs": costs.to_dict(),
        "ar_ms_per_token": ar,
        "static": static,
        "disco": disco,
        "confidence": conf,
        "oracle": {"sl_max": oracle_cap, **oracle.to_dict()},
        "best": {
            "static": _best(static),
            "disco": _best(disco),
            "confidence": _best(conf),
        },
    }


def evaluate(
    samples: Sequence[Sample],
    costs: Costs,
    classifier: DiscoClassifier,
    spec: FeatureSpec,
    settings: dict[str, dict],
    oracle_cap: int = ORACLE_CAP,
) -> dict[str, dict]:
    """Simulated latency of fixed settings (e.g. the tuned ones, on the test split):
    settings = {"disco": {"threshold", "sl_max"}, "static": {...}, "confidence": {...}}."""
    hits = [s.hits.tolist() for s in samples]
    out: dict[str, dict] = {}
    for family, st in settings.items():
        k, t = int(st["sl_max"]), float(st["threshold"])
        if family == "disco":
            scores = [disco_scores(s, classifier, spec, k) for s in samples]
        elif family == "confidence":
            scores = [confidence_scores(s, k) for s in samples]
        else:
            scores, t = [None] * len(samples), NEVER_STOP
        out[family] = _row(t, k, simulate_all(hits, scores, t, k, costs))
    oracle = simulate_all(hits, [None] * len(samples), NEVER_STOP, oracle_cap, costs, oracle=True)
    out["oracle"] = {"sl_max": oracle_cap, **oracle.to_dict()}
    return out
