"""Length controllers: static k and the heuristic schedule."""

from __future__ import annotations

import pytest

from adaspec.control.heuristic import HeuristicLength
from adaspec.control.static import StaticLength
from adaspec.errors import InputError


def test_static_is_constant():
    c = StaticLength(3)
    for drafted, accepted in [(3, 0), (3, 3), (3, 1)]:
        c.update(drafted, accepted)
        assert c.max_tokens() == 3
    assert c.keep_drafting(0, None)


def test_heuristic_schedule_grows_by_two_and_shrinks_by_one():
    c = HeuristicLength(k=4, k_max=9)
    c.update(4, 4)
    assert c.max_tokens() == 6
    c.update(6, 6)
    assert c.max_tokens() == 8
    c.update(8, 8)
    assert c.max_tokens() == 9  # capped at k_max
    c.update(9, 2)
    assert c.max_tokens() == 8
    for _ in range(20):
        c.update(c.max_tokens(), 0)
    assert c.max_tokens() == 1  # never below 1
    c.begin()
    assert c.max_tokens() == 4  # a new request starts over


def test_heuristic_ignores_empty_drafts():
    c = HeuristicLength(k=2)
    c.update(0, 0)
    assert c.max_tokens() == 2


@pytest.mark.parametrize("k", [0, -1])
def test_bad_k(k):
    with pytest.raises(InputError):
        StaticLength(k)
    with pytest.raises(InputError):
        HeuristicLength(k=k)
