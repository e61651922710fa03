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
    top_values,
)
from adaspec.errors import InputError


def test_distribution_features_are_sorted_top_probabilities_and_entropy():
    logits = torch.randn(3, 50) * 3
    dist = distribution_features(logits)
    p = logits.softmax(-1)
    assert dist.shape == (3, TOP_K + 1)
    torch.testing.assert_close(dist[:, :TOP_K], p.sort(-1, descending=True).values[:, :TOP_K])
    torch.testing.assert_close(dist[:, TOP_K], -(p * p.log()).sum(-1))


def log_softmax_features(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The original definition (full log-softmax, top-k over it, entropy from it), kept
    here as the reference the fast route must reproduce."""
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    top = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1).values.exp()
    if top.shape[-1] < TOP_K:
        top = torch.nn.functional.pad(top, (0, TOP_K - top.shape[-1]))
    entropy = -(logp.exp() * logp).nan_to_num().sum(dim=-1, keepdim=True)
    return torch.cat([top, entropy], dim=-1).float()


QWEN_VOCAB = 151_936


@pytest.mark.parametrize("scale,shift", [(1.0, 0.0), (3.0, 0.0), (10.0, 0.0), (3.0, 30.0)])
def test_features_equal_the_log_softmax_route(scale, shift):
    """Real vocabulary width, logits from flat to peaked and offset like a real model's."""
    g = torch.Generator().manual_seed(int(scale * 10 + shift))
    logits = torch.randn(3, QWEN_VOCAB, generator=g) * scale + shift
    logits[1, 17] += 4 * scale  # one confident row
    fast = distribution_features(logits)
    old = log_softmax_features(logits, torch.float32)
    exact = log_softmax_features(logits, torch.float64)
    torch.testing.assert_close(fast, old, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-5)
    # One row alone (inference) vs in a batch (collection): the same up to the order of the
    # 151,936-term sums, which differs with the row count on some CPUs (AVX2: ~1e-6 relative).
    torch.testing.assert_close(distribution_features(logits[1]), fast[1], rtol=1e-5, atol=1e-6)


def test_features_with_masked_and_bf16_logits():
    """-inf entries (probability 0) and bf16 logits give the reference's finite values."""
    logits = torch.randn(2, 5000) * 3
    logits[:, ::3] = float("-inf")
    torch.testing.assert_close(
        distribution_features(logits), log_softmax_features(logits, torch.float64)
    )
    half = (torch.randn(4, 3000) * 4).to(torch.bfloat16)
    torch.testing.assert_close(
        distribution_features(half), log_softmax_features(half, torch.float64)
    )


@pytest.mark.parametrize("width", [5, 1290, 128 * 40, 128 * 40 + 77])
def test_top_values_equal_topk_even_with_ties(width):
    g = torch.Generator().manual_seed(width)
    spread = torch.randn(2, 3, width, generator=g) * 5
    ties = torch.randint(0, 4, (2, 3, width), generator=g).float()  # many equal maxima
    for x in (spread, ties):
        k = min(TOP_K, width)
        assert torch.equal(top_values(x, k), x.topk(k, dim=-1).values)
    winner = torch.zeros(width)
    winner[-1] = 1.0  # the maximum alone, in the tail that fills no block
    assert top_values(winner, 2).tolist() == [1.0, 0.0]


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
