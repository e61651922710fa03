"""DISCO features: what they contain, and that one row (inference) equals the same row of a
batch (collection)."""

from __future__ import annotations

import pytest
import torch

from adaspec.control.disco_features import (
    TOP_K,
    FeatureSpec,
    assemble,
    distribution_features,
    draft_positions,
)
from adaspec.errors import InputError


def test_distribution_features_are_sorted_top_probabilities_and_entropy():
    logits = torch.randn(3, 50) * 3
    dist = distribution_features(logits)
    p = logits.softmax(-1)
    assert dist.shape == (3, TOP_K + 1)
    torch.testing.assert_close(dist[:, :TOP_K], p.sort(-1, descending=True).values[:, :TOP_K])
    torch.testing.assert_close(dist[:, TOP_K], -(p * p.log()).sum(-1))


def test_bf16_logits_and_tiny_vocabularies():
    dist = distribution_features(torch.tensor([10.0, -1e4, 0.0]).to(torch.bfloat16))
    assert dist.dtype == torch.float32 and dist.shape == (TOP_K + 1,)
    assert dist[3:TOP_K].eq(0).all()  # padded: a 3-token vocabulary
    assert torch.isfinite(dist).all()


def test_one_row_equals_the_row_of_a_batch():
    """The controller featurises one row of logits, collection a whole teacher-forced pass."""
    torch.manual_seed(0)
    logits = torch.randn(7, 1000) * 4
    spec = FeatureSpec(generation_position=True)
    batch = assemble(distribution_features(logits), torch.arange(7) % 3, torch.arange(7), spec)
    for i in range(7):
        row = assemble(distribution_features(logits[i]), i % 3, i, spec)
        torch.testing.assert_close(row, batch[i], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "spec,size",
    [
        (FeatureSpec(), TOP_K + 2),
        (FeatureSpec(generation_position=True), TOP_K + 3),
        (FeatureSpec(top_k=3, entropy=False, draft_position=False), 3),
    ],
)
def test_spec_columns(spec, size):
    dist = distribution_features(torch.randn(4, 30))
    x = assemble(dist, 2, torch.tensor([5, 6, 7, 8]), spec)
    assert x.shape == (4, size) == (4, spec.size)
    if spec.draft_position:
        col = spec.top_k + int(spec.entropy)
        assert x[:, col].eq(2).all()
    if spec.generation_position:
        assert x[:, -1].tolist() == [5, 6, 7, 8]


def test_spec_round_trip_and_errors():
    spec = FeatureSpec(top_k=5, generation_position=True)
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(InputError):
        FeatureSpec.from_dict({"top_k": 11})
    with pytest.raises(InputError):
        FeatureSpec.from_dict({"colour": "red"})


def test_draft_positions_count_since_the_last_mismatch():
    hits = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
    # token 0 is the prefill's; a draft starts at 1, and again after each miss
    assert draft_positions(hits).tolist() == [0, 0, 1, 2, 0, 1, 2, 0, 0]
