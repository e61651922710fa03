"""Request statistics arithmetic."""

from __future__ import annotations

import pytest

from adaspec.core.metrics import RequestStats


def test_derived_figures():
    s = RequestStats(new_tokens=20, target_calls=5, drafted=16, accepted=12, wall_time=2.0)
    s.prefill_time, s.draft_time, s.verify_time = 0.2, 0.8, 0.7
    assert s.acceptance_rate == 0.75
    assert s.mean_accepted_tokens == 4.0
    assert s.tokens_per_s == 10.0
    assert s.ms_per_token == 100.0
    assert s.other_time == pytest.approx(0.3)
    d = s.to_dict()
    assert d["acceptance_rate"] == 0.75 and d["other_time"] == pytest.approx(0.3)
    assert "MAT 4.00" in s.summary_line() and "75.0% (12/16)" in s.summary_line()


def test_empty_request_has_no_division_by_zero():
    s = RequestStats()
    assert s.acceptance_rate == 0 and s.mean_accepted_tokens == 0 and s.tokens_per_s == 0
    assert s.ms_per_token == 0 and s.acceptance_by_position() == []


def test_acceptance_by_position():
    s = RequestStats(steps=[(3, 3), (3, 1), (2, 0), (1, 1)])
    # position 0: drafted 4 times, accepted 3; position 1: 3 and 1; position 2: 2 and 1
    assert s.acceptance_by_position() == [0.75, pytest.approx(1 / 3), 0.5]
