"""Logit processing: draft and target must see exactly the distributions the user asked for."""

from __future__ import annotations

import math

import pytest
import torch

from adaspec.core.sampling import SamplingParams, process_logits, sample, sample_rows
from adaspec.errors import InputError


def probs_of(values: list[float]) -> torch.Tensor:
    """Logits whose softmax is `values` (zeros become -inf)."""
    return torch.tensor(values).log()


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    for t in (0.3, 1.0, 2.5):
        got = process_logits(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(got, (logits / t).softmax(-1))
    cold = process_logits(logits, SamplingParams(temperature=0.3))
    hot = process_logits(logits, SamplingParams(temperature=2.5))
    assert cold.max() > hot.max()


def test_tiny_temperature_is_a_finite_distribution():
    """logits / 1e-39 overflows to inf; inf - inf would give NaN probabilities."""
    got = process_logits(torch.tensor([1.0, 3.0, 2.0]), SamplingParams(temperature=1e-39))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, 0.0]))


def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 5.0, 2.0], [3.0, -1.0, 2.9]])
    got = process_logits(logits, SamplingParams(temperature=0))
    assert torch.equal(got, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert got.dtype == torch.float32


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([0.5, 3.0, 1.0, 2.0, -1.0, 2.5])
    got = process_logits(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (got > 0).nonzero().flatten().tolist() == [1, 3, 5]
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))
    torch.testing.assert_close(got[[1, 3, 5]], logits[[1, 3, 5]].softmax(-1))


def test_top_k_with_ties_still_keeps_k():
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    got = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert int((got > 0).sum()) == 2
    assert set((got > 0).nonzero().flatten().tolist()) <= {1, 2, 3}


def test_top_k_larger_than_vocab_is_a_no_op():
    logits = torch.tensor([0.5, 3.0, 1.0])
    got = process_logits(logits, SamplingParams(temperature=1.0, top_k=10))
    torch.testing.assert_close(got, logits.softmax(-1))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # sorted masses 0.4, 0.3, 0.2, 0.1 (tokens 2, 0, 3, 1); cumulative 0.4, 0.7, 0.9, 1.0
        (0.3, [0.0, 0.0, 1.0, 0.0]),  # 0.4 already reaches 0.3
        (0.65, [3 / 7, 0.0, 4 / 7, 0.0]),  # 0.4 < 0.65 <= 0.7
        (0.85, [3 / 9, 0.0, 4 / 9, 2 / 9]),  # 0.7 < 0.85 <= 0.9
        (0.95, [0.3, 0.1, 0.4, 0.2]),  # needs every token
    ],
)
def test_top_p_keeps_the_minimal_prefix_reaching_p(top_p, expected):
    logits = probs_of([0.3, 0.1, 0.4, 0.2])
    got = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(got, torch.tensor(expected))


def test_top_k_then_top_p():
    logits = probs_of([0.3, 0.1, 0.4, 0.2])
    # top_k=3 renormalises 0.4, 0.3, 0.2 to 4/9, 3/9, 2/9; top_p 0.5 then needs two of them.
    got = process_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5))
    torch.testing.assert_close(got, torch.tensor([3 / 7, 0.0, 4 / 7, 0.0]))


def test_batch_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    logits[2, :] = 0.0  # a flat row next to peaked ones must not influence them
    for params in (
        SamplingParams(temperature=0.7, top_k=7),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.5),
        SamplingParams(temperature=0),
    ):
        batch = process_logits(logits, params)
        assert batch.shape == logits.shape
        for i in range(logits.shape[0]):
            torch.testing.assert_close(batch[i], process_logits(logits[i], params))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"top_p": "0.9"}, "top_p"),
        ({"top_k": True}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_invalid_params_raise_input_error_naming_the_parameter(kwargs, name):
    with pytest.raises(InputError, match=name):
        SamplingParams(**kwargs)


def test_sample_rows_follows_the_distribution_and_skips_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 100_000
    draws = sample_rows(probs.expand(n, -1), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).double() / n
    assert float(freq[[0, 2, 5]].sum()) == 0.0
    assert 0.5 * float((freq - probs.double()).abs().sum()) < 0.01
    # Rows differ: each row uses its own distribution.
    two = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])  # unnormalised is fine
    assert sample_rows(two, None).tolist() == [0, 2]


def test_sample_is_seeded():
    probs = torch.softmax(torch.arange(10.0), 0)
    a = [sample(probs, g) for g in [torch.Generator().manual_seed(5)] for _ in range(20)]
    b = [sample(probs, g) for g in [torch.Generator().manual_seed(5)] for _ in range(20)]
    assert a == b
    assert SamplingParams(temperature=1, seed=9).generator().initial_seed() == 9


def test_the_largest_seed_seeds_a_generator():
    draws = [int(torch.randint(0, 1000, (1,), generator=SamplingParams(seed=2**64 - 1)
                               .generator())) for _ in range(2)]
    assert draws[0] == draws[1]
