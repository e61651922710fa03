"""The exactness classifier: a divergence at a near-tie of the reference's top two logits is
numerics, anything wider is a bug; the tolerance is the target runtime's own."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.base import ForwardOutput, ModelBackend
from adaspec.lab.bench.exactness import classify, first_difference


class GapBackend(ModelBackend):
    """Scores every context with the same logits: token 1 leads token 2 by `gap`."""

    name = "gap"
    vocab_size = 4
    max_context = 64
    num_layers = 1
    hidden_size = 1
    bytes_per_forward = 1

    def __init__(self, gap: float, tie_tolerance: float | None = None) -> None:
        self.gap = gap
        self.seen: list[list[int]] = []
        if tie_tolerance is not None:
            self.tie_tolerance = tie_tolerance

    @property
    def cache_len(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def forward(self, tokens, positions=None, tree_mask=None, hidden_layer=None):
        self.seen.append([int(t) for t in tokens])
        row = torch.tensor([0.0, 5.0, 5.0 - self.gap, 1.0])
        return ForwardOutput(logits=row.expand(len(tokens), 4).clone())

    def truncate(self, length: int) -> None:
        pass

    def keep(self, indices) -> None:
        pass


@pytest.mark.parametrize(
    "gap, tolerance, kind",
    [(0.01, None, "tie"), (0.125, None, "tie"), (0.3, None, "bug"), (0.3, 0.5, "tie"),
     (2.0, 0.5, "bug")],
)
def test_divergences_are_classified_by_the_reference_gap(gap, tolerance, kind):
    target = GapBackend(gap, tolerance)
    div = classify(target, [3, 3], reference=[1, 1, 2, 1], output=[1, 1, 1, 2])
    assert div is not None and div.index == 2 and div.kind == kind
    assert div.gap == pytest.approx(gap, abs=1e-5)
    assert target.seen[-1] == [3, 3, 1, 1]  # scored the reference's context at that token


def test_equal_outputs_are_not_a_divergence_and_early_stops_are_judged():
    assert classify(GapBackend(3.0), [3], [1, 2], [1, 2]) is None
    assert first_difference([1, 2, 3], [1, 2]) == 2
    div = classify(GapBackend(3.0), [3], [1, 2, 3], [1, 2])  # one stopped early
    assert div is not None and div.index == 2 and div.kind == "bug"
