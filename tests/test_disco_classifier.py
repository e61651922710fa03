"""The DISCO classifier learns a separable problem; F1 and static lengths as classifiers."""

from __future__ import annotations

import pytest
import torch

from adaspec.errors import InputError
from adaspec.lab.disco.train_classifier import f1_scores, static_predictions, train_classifier


def toy(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 4, generator=g) * torch.tensor([1.0, 10.0, 1.0, 100.0])
    y = (x[:, 0] + 0.05 * x[:, 1] > 0.8).long()  # separable, features on different scales
    return x, y


def test_learns_a_separable_problem():
    x, y = toy(600, 0)
    xv, yv = toy(200, 1)
    res = train_classifier(x, y, xv, yv, epochs=300)
    xt, yt = toy(300, 2)
    pred = res.model.accept_probability(xt) >= 0.5
    assert f1_scores(pred, yt)["f1_macro"] > 0.95
    assert 1 <= res.best_epoch <= 300


def test_accept_probability_is_the_modules_softmax():
    """`accept_probability` skips the module call for speed; it must give what the trained
    module gives, for one row and for a batch."""
    x, y = toy(200, 3)
    model = train_classifier(x, y, x[:50], y[:50], epochs=20).model
    with torch.no_grad():
        want = model(x).softmax(dim=-1)[:, 1]
    torch.testing.assert_close(model.accept_probability(x), want)
    torch.testing.assert_close(model.accept_probability(x[7]), want[7])


def test_training_needs_rows():
    with pytest.raises(InputError):
        train_classifier(torch.empty(0, 3), torch.empty(0), torch.rand(2, 3), torch.ones(2))


def test_f1_scores():
    pred = torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool)
    label = torch.tensor([1, 0, 0, 1, 1], dtype=torch.bool)
    f = f1_scores(pred, label)
    assert f["f1_accept"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert f["f1_reject"] == pytest.approx(2 * 1 / (2 * 1 + 1 + 1))
    assert f["accuracy"] == pytest.approx(0.6)


def test_static_k_keeps_drafting_before_its_last_position():
    pos = torch.tensor([0, 1, 2, 3, 0])
    assert static_predictions(pos, 1).tolist() == [False] * 5
    assert static_predictions(pos, 3).tolist() == [True, True, False, False, True]
