"""Router rewards: token-level Rouge-L (rouge-score), the paper's and the measured cost."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaspec.errors import InputError
from adaspec.lab.router.reward import measured_costs, param_costs, rewards, rouge_l


def test_rouge_l_on_token_ids():
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == pytest.approx(1.0)
    assert rouge_l([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(0.0)
    # LCS 3 of 4 and 4 tokens: P = R = F = 0.75; ids are tokens, not characters
    assert rouge_l([1, 2, 3, 4], [1, 2, 9, 4]) == pytest.approx(0.75)
    assert rouge_l([12, 3], [1, 23]) == pytest.approx(0.0)
    assert rouge_l([], []) == 1.0


def test_param_costs_follow_the_paper():
    c = param_costs([1_780_000_000, 630_000_000, 0])
    assert c[0] == pytest.approx(0.0)
    assert c[1] == pytest.approx(1 - math.exp(0.63 - 1.78))
    assert c[2] == pytest.approx(1 - math.exp(-1.78))


def test_measured_costs_relative_to_fastest_arm():
    c = measured_costs(np.array([[100.0, 50.0, 200.0]]))
    assert c.tolist() == [[0.5, 1.0, 0.25]]
    with pytest.raises(InputError, match="positive"):
        measured_costs(np.array([[0.0, 1.0]]))


def test_rewards_mix_similarity_and_cost():
    sim = np.array([[0.4, 1.0]])
    ms = np.array([[100.0, 125.0]])
    assert rewards(sim, ms, [10, 5], alpha=1.0).tolist() == [[0.4, 1.0]]
    assert rewards(sim, ms, [10, 5], alpha=0.0).tolist() == [[1.0, 0.8]]
    r = rewards(sim, ms, [2_000_000_000, 0], alpha=0.0, cost="params")
    assert r[0, 0] == pytest.approx(0.0) and r[0, 1] > 0.8
    with pytest.raises(InputError, match="alpha"):
        rewards(sim, ms, [1, 1], alpha=1.5)
    with pytest.raises(InputError, match="unknown cost"):
        rewards(sim, ms, [1, 1], alpha=0.5, cost="flops")
