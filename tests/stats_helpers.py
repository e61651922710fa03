"""One statistical check for every exactness test: a chi-square goodness of fit of observed
token (or token-path) counts against the exact target distribution.

- Cells the target gives probability 0 are not part of the statistic: one sample there
  rejects outright (p-value 0), whatever the rest looks like.
- Cells whose expected count is below `MIN_EXPECTED` are pooled (smallest first) until the
  pool reaches it, so the chi-square approximation holds; the degrees of freedom are the
  cells left minus one.
- The tail is the regularised upper incomplete gamma function, Q(df / 2, x / 2)
  (torch.special.gammaincc, float64; scipy is not a dependency). tests/test_stats_helpers.py
  checks it against closed forms and checks the false-alarm rate under the null.

A right verifier passes when every p-value is above ALPHA (one false alarm in a million per
law checked; the seeds are fixed, so a run is reproducible). A deliberately broken one must
give a p-value below POWER (1e-12): the samples per test are chosen so each classic bug is
rejected by a wide margin, not at the edge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALPHA = 1e-6  # false alarm per law checked
POWER = 1e-12  # what a broken verifier's p-value must fall below
MIN_EXPECTED = 5.0  # pool cells expected fewer times than this


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X chi-square with df degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if statistic <= 0:
        return 1.0
    s = torch.tensor(df / 2, dtype=torch.float64)
    x = torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(s, x))


@dataclass(frozen=True)
class Fit:
    statistic: float
    df: int
    pvalue: float
    n: int
    impossible: int  # samples in cells of probability 0

    def __str__(self) -> str:
        extra = f", {self.impossible} samples where p = 0" if self.impossible else ""
        return (f"chi2 {self.statistic:.1f} on {self.df} df, p = {self.pvalue:.3g} "
                f"(n = {self.n}{extra})")


def fit_counts(
    counts: torch.Tensor, exact: torch.Tensor, min_expected: float = MIN_EXPECTED
) -> Fit:
    """Chi-square goodness of fit of `counts` [C] against the law `exact` [C] (any shape,
    flattened; normalised here)."""
    counts = counts.flatten().to(torch.float64)
    law = exact.flatten().to(torch.float64)
    if counts.shape != law.shape:
        raise ValueError(f"{counts.numel()} counts for {law.numel()} cells")
    if bool((law < 0).any()) or not float(law.sum()) > 0:
        raise ValueError("the exact law must be non-negative with positive mass")
    law = law / law.sum()
    n = int(counts.sum())
    possible = law > 0
    impossible = int(counts[~possible].sum())
    expected = n * law[possible]
    observed = counts[possible]
    order = expected.argsort()
    expected, observed = expected[order], observed[order]
    # Pool the smallest cells: every cell under min_expected, and more until the pool holds it.
    small = int((expected < min_expected).sum())
    cum = expected.cumsum(0)
    while 0 < small < len(expected) and cum[small - 1] < min_expected:
        small += 1
    if small:
        expected = torch.cat([cum[small - 1 : small], expected[small:]])
        observed = torch.cat([observed[:small].sum().view(1), observed[small:]])
    df = len(expected) - 1
    statistic = float(((observed - expected) ** 2 / expected).sum()) if df else 0.0
    pvalue = chi2_sf(statistic, df) if df else 1.0
    if impossible:
        pvalue = 0.0
    return Fit(statistic, df, pvalue, n, impossible)


def fit(samples: torch.Tensor, exact: torch.Tensor, min_expected: float = MIN_EXPECTED) -> Fit:
    """`fit_counts` for samples given as flat cell ids in [0, exact.numel())."""
    counts = torch.bincount(samples.flatten().long(), minlength=exact.numel())
    if counts.numel() != exact.numel():
        raise ValueError(f"cell ids up to {int(samples.max())} for {exact.numel()} cells")
    return fit_counts(counts, exact, min_expected)


def passes(fits: list[Fit]) -> bool:
    """The check a right verifier passes: no law rejected at ALPHA."""
    return all(f.pvalue > ALPHA for f in fits)


def assert_exact(fits: list[Fit], what: str = "") -> None:
    assert passes(fits), f"{what}: rejected at {ALPHA:g}: " + "; ".join(map(str, fits))


def assert_caught(fits: list[Fit], what: str = "") -> None:
    """A broken variant: the same check must reject it, by a wide margin (p < POWER)."""
    assert not passes(fits)
    best = min(f.pvalue for f in fits)
    assert best < POWER, f"{what}: only p = {best:.3g}: " + "; ".join(map(str, fits))


# ---------------------------------------------------------------------------------------------
# Total variation (the earlier check; tests/test_tree.py still uses it).


def tv_bound(n: int, cells: int, false_alarm: float = 1e-6) -> float:
    """Upper bound on the TV distance of n exact samples from their law: E[TV] <= 0.5 *
    sqrt(cells / n), plus a McDiarmid margin for the false alarm."""
    return 0.5 * math.sqrt(cells / n) + math.sqrt(math.log(1 / false_alarm) / (2 * n))


def tv(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """TV distance between the empirical law of flat cell ids and the exact law."""
    counts = torch.bincount(samples, minlength=exact.numel()).double()
    return 0.5 * float((counts / samples.numel() - exact.flatten().double()).abs().sum())
