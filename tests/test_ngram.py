"""Prompt lookup drafter: what it proposes, and that the incremental index stays right."""

from __future__ import annotations

import random

import pytest

from adaspec.control.base import LengthController
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams
from adaspec.draft.ngram import NgramDrafter
from adaspec.errors import InputError


class Always(LengthController):
    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.asked: list[tuple[int, list[float]]] = []

    def max_tokens(self) -> int:
        return 8

    def decide(self, position: int, numbers: list[float]) -> bool:
        self.asked.append((position, numbers))
        return self.stop_after is None or position < self.stop_after


def propose(context: list[int], max_tokens: int = 8, drafter=None, **kwargs) -> list[int]:
    drafter = drafter or NgramDrafter(**kwargs)
    proposal = drafter.propose(RequestState.of(context, SamplingParams()), max_tokens, Always())
    assert proposal.probs is None and proposal.forward_calls == 0
    return proposal.tokens


def reference(context: list[int], max_tokens: int, n_max: int, n_min: int) -> list[int]:
    """Brute force: scan back for the latest earlier occurrence, longest n first."""
    size = len(context)
    for n in range(min(n_max, size), n_min - 1, -1):
        suffix = context[size - n :]
        for start in range(size - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : min(start + n + max_tokens, size)]
    return []


def test_latest_match_wins():
    context = [1, 2, 9, 5, 1, 2, 7, 3, 1, 2]
    assert propose(context, 3, n_max=2) == [7, 3, 1]


def test_longer_ngram_preferred():
    context = [5, 6, 7, 8, 0, 6, 7, 9, 5, 6, 7]
    assert propose(context, 2, n_max=3) == [8, 0]  # "5 6 7" matched at the start
    assert propose(context, 2, n_max=2) == [9, 5]  # the latest "6 7" is later


def test_stops_at_max_tokens_and_end_of_context():
    context = [1, 2, 3, 1, 2]
    assert propose(context, 10) == [3, 1, 2]
    assert propose(context, 2) == [3, 1]
    assert propose(context, 0) == []


def test_overlapping_match():
    assert propose([4, 4, 4, 4], 5) == [4]  # "4 4 4" last seen ending at index 3


def test_no_match_gives_empty_proposal():
    assert propose([1, 2, 3, 4]) == []
    assert propose([1, 2, 3, 2], n_min=2) == []  # "2" alone would match, but n_min is 2
    assert propose([7]) == []


def test_keep_drafting_stop_is_honoured():
    drafter = NgramDrafter()
    controller = Always(stop_after=1)
    proposal = drafter.propose(RequestState.of([1, 2, 3, 4, 5, 1, 2], SamplingParams()),
                               8, controller)
    assert proposal.tokens == [3, 4]
    assert controller.asked == [(0, []), (1, [])]  # no distribution: no numbers


def test_incremental_index_matches_brute_force():
    rng = random.Random(0)
    for n_max, n_min in [(3, 1), (4, 2), (1, 1)]:
        prompt = [rng.randrange(6) for _ in range(30)]
        drafter = NgramDrafter(n_max=n_max, n_min=n_min)
        drafter.begin(RequestState.of(prompt))
        context = list(prompt)
        for _ in range(60):
            got = propose(context, 5, drafter=drafter)
            assert got == reference(context, 5, n_max, n_min)
            context = context + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            if rng.random() < 0.5:
                drafter.commit(RequestState.of(context), [])


def test_new_context_without_start_rebuilds():
    drafter = NgramDrafter()
    assert propose([1, 2, 3, 1, 2], drafter=drafter) == [3, 1, 2]
    assert propose([9, 8, 7, 9], drafter=drafter) == [8, 7, 9]  # not an extension: reindexed


def naive_lookup(context: list[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Rescan the whole context: the latest earlier match of the longest suffix n-gram."""
    for n in range(n_max, n_min - 1, -1):
        suffix = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i : i + n] == suffix:
                return context[i + n : i + n + k]
    return []


def test_incremental_index_agrees_with_a_full_rescan_on_a_long_context():
    rng = random.Random(1)
    context = [rng.randrange(500) for _ in range(4000)]
    drafter = NgramDrafter()
    drafter.begin(RequestState.of(context))
    for _ in range(60):
        tokens = propose(context, 8, drafter=drafter)
        assert tokens == naive_lookup(context, 8)
        context = context + (tokens[:2] or [rng.randrange(500)])
        drafter.commit(RequestState.of(context), [])


@pytest.mark.parametrize(("n_max", "n_min"), [(0, 0), (2, 3), (3, 0)])
def test_invalid_sizes_raise(n_max, n_min):
    with pytest.raises(InputError, match="n_min"):
        NgramDrafter(n_max=n_max, n_min=n_min)
