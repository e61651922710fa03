"""The routing policy: REINFORCE learns a context -> arm mapping; greedy and dynamic picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspec.errors import InputError
from adaspec.route.policy import RouterPolicy, TrainConfig, train_policy


def toy_data(n: int = 256, dim: int = 16, seed: int = 0):
    """Three clusters of prompt states (fixed centres); arm i is best (reward 1) on cluster i,
    the others get 0.6. `seed` draws other points around the same centres."""
    centers = np.random.default_rng(123).normal(0, 3, size=(3, dim))
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 3, size=n)
    x = centers[label] + rng.normal(0, 1, size=(n, dim))
    r = np.full((n, 3), 0.6)
    r[np.arange(n), label] = 1.0
    return x.astype(np.float32), r, label


def test_reinforce_learns_context_to_arm():
    x, r, label = toy_data()
    result = train_policy(x, r, TrainConfig(epochs=20))
    test_x, _, test_label = toy_data(seed=1)  # held-out points
    picks = result.policy.probs(torch.as_tensor(test_x)).argmax(-1).numpy()
    assert (picks == test_label).mean() > 0.95
    assert result.history[-1]["reward"] > result.history[0]["reward"]


def test_optimum_is_the_best_arm_not_a_reward_weighted_mix():
    # Same context everywhere; arm 1 is only a little better. A reward-weighted mixture
    # (-r log pi over all arms) would settle near 0.47 / 0.53; REINFORCE goes to arm 1.
    x = np.zeros((128, 4), dtype=np.float32)
    r = np.tile([0.9, 1.0], (128, 1))
    result = train_policy(x, r, TrainConfig(epochs=60))
    assert float(result.policy.probs(torch.zeros(1, 4))[0, 1]) > 0.9


def test_paper_settings_are_the_defaults():
    cfg = TrainConfig()
    assert (cfg.lr, cfg.weight_decay, cfg.batch_size, cfg.epochs, cfg.hidden) == (
        1e-3, 1e-2, 64, 3, 512,
    )
    policy = RouterPolicy(8, 3)
    linears = [m for m in policy.net if isinstance(m, torch.nn.Linear)]
    tanhs = [m for m in policy.net if isinstance(m, torch.nn.Tanh)]
    assert [m.out_features for m in linears] == [512, 512, 3] and len(tanhs) == 2


def test_training_is_seeded():
    x, r, _ = toy_data(64)
    a = train_policy(x, r, TrainConfig(epochs=2, seed=3)).policy
    b = train_policy(x, r, TrainConfig(epochs=2, seed=3)).policy
    probe = torch.as_tensor(x[:5])
    assert torch.equal(a.probs(probe), b.probs(probe))


def test_greedy_and_dynamic_choice():
    policy = RouterPolicy(4, 3)
    with torch.no_grad():
        policy.net[-1].bias.copy_(torch.tensor([0.0, 5.0, 0.0]))
        policy.net[-1].weight.zero_()
    state = torch.randn(4)
    assert policy.choose(state, "greedy") == 1
    g = torch.Generator().manual_seed(0)
    picks = [policy.choose(state, "dynamic", g) for _ in range(400)]
    assert 0 < picks.count(0) + picks.count(2) < 40  # samples: mostly, not always, arm 1
    with pytest.raises(InputError, match="routing mode"):
        policy.choose(state, "best")


@pytest.mark.parametrize(
    "x, r, message",
    [
        (np.zeros((0, 4)), np.zeros((0, 2)), "N >= 1"),
        (np.zeros((3, 4)), np.zeros((2, 2)), "N >= 1"),
        (np.full((2, 4), np.nan), np.zeros((2, 2)), "NaN"),
    ],
)
def test_bad_training_data(x, r, message):
    with pytest.raises(InputError, match=message):
        train_policy(x, r)


def test_bad_training_config():
    with pytest.raises(InputError, match="lr"):
        train_policy(np.zeros((2, 4)), np.zeros((2, 2)), TrainConfig(lr=0))
    with pytest.raises(InputError, match="epochs"):
        train_policy(np.zeros((2, 4)), np.zeros((2, 2)), TrainConfig(epochs=0))
