"""The chi-square check of tests/stats_helpers.py: its tail against closed forms, its
false-alarm rate under the null, its zero-probability and pooling rules, and its power on
the smallest difference the exactness tests care about (0.2 against 0.222)."""

from __future__ import annotations

import math

import pytest
import torch

from .stats_helpers import ALPHA, POWER, chi2_sf, fit, fit_counts


def closed_form_sf(x: float, df: int) -> float:
    """Q(df/2, x/2) by the recurrence Q(s + 1, y) = Q(s, y) + y^s e^-y / Gamma(s + 1), from
    Q(1/2, y) = erfc(sqrt(y)) and Q(1, y) = e^-y."""
    y = x / 2
    s, q = (0.5, math.erfc(math.sqrt(y))) if df % 2 else (1.0, math.exp(-y))
    while s < df / 2:
        q += math.exp(s * math.log(y) - y - math.lgamma(s + 1))
        s += 1
    return q


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 10, 25, 40, 63])
def test_tail_matches_closed_forms(df):
    for x in [0.01, 0.5, 1.0, df / 2, df, 2.0 * df, df + 10 * math.sqrt(df), 60.0, 150.0]:
        want = closed_form_sf(x, df)
        assert chi2_sf(x, df) == pytest.approx(want, rel=1e-9, abs=1e-300), (x, df)


def test_known_quantiles():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(2 * math.log(1e6), 2) == pytest.approx(1e-6, rel=1e-9)  # e^{-x/2}
    assert chi2_sf(0.0, 5) == 1.0
    with pytest.raises(ValueError):
        chi2_sf(1.0, 0)


@pytest.mark.parametrize(
    "law",
    [
        pytest.param([0.1, 0.2, 0.3, 0.4], id="4-cells"),
        pytest.param([0.6, 0.3, 0.05, 0.03, 0.01, 0.005, 0.003, 0.002], id="pooled-tail"),
    ],
)
def test_false_alarm_rate_under_the_null(law):
    """Counts drawn from the law itself: the p-values are close to uniform (a chi-square
    approximation that held too loosely would reject far more often than its level)."""
    law = torch.tensor(law, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    runs, n = 4000, 400
    draws = torch.multinomial(law, runs * n, replacement=True, generator=g).view(runs, n)
    counts = torch.stack([torch.bincount(d, minlength=len(law)) for d in draws])
    pvalues = torch.tensor([fit_counts(c, law).pvalue for c in counts])
    for level in (0.01, 0.05, 0.2, 0.5):
        rate = float((pvalues < level).double().mean())
        spread = 4 * math.sqrt(level * (1 - level) / runs)
        assert abs(rate - level) < spread + 0.01, (level, rate)


def test_impossible_cells_reject_and_small_cells_pool():
    law = torch.tensor([0.5, 0.5, 0.0])
    assert fit(torch.tensor([0, 1] * 500), law).pvalue == 1.0  # a perfect fit
    bad = fit(torch.tensor([0, 1] * 500 + [2]), law)
    assert bad.pvalue == 0.0 and bad.impossible == 1
    # 1000 samples, cells expected 500, 497, 2, 1: the last two pool into one of 3
    tail = torch.tensor([0.5, 0.497, 0.002, 0.001])
    assert fit(torch.tensor([0] * 500 + [1] * 497 + [2] * 2 + [3]), tail).df == 1
    # everything tiny: one pool, nothing to test
    assert fit(torch.tensor([0, 1]), torch.tensor([0.5, 0.5])).pvalue == 1.0


def test_power_on_a_few_percent():
    """0.222 observed against a claimed 0.2 (or the reverse), 10^5 samples: far below
    POWER, while the right claim passes."""
    g = torch.Generator().manual_seed(1)
    right = torch.tensor([2 / 9, 7 / 9], dtype=torch.float64)
    wrong = torch.tensor([0.2, 0.8], dtype=torch.float64)
    samples = torch.multinomial(right, 100_000, replacement=True, generator=g)
    assert fit(samples, right).pvalue > ALPHA
    assert fit(samples, wrong).pvalue < POWER
    samples = torch.multinomial(wrong, 100_000, replacement=True, generator=g)
    assert fit(samples, wrong).pvalue > ALPHA
    assert fit(samples, right).pvalue < POWER
