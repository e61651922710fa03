"""Running acceptance estimates, shared by the drafters that price their own proposals
(`auto` per n-gram match length, draft confidence and history match, `tree=priced` per candidate
rank)."""

from __future__ import annotations

PRIOR_WEIGHT = 3.0  # pseudo-observations behind each prior


class RateEstimate:
    """A per-token acceptance rate: a Beta posterior with `weight` pseudo-trials at
    `prior`. A trial is a drafted token whose predecessors in its step were all accepted."""

    def __init__(self, prior: float, weight: float = PRIOR_WEIGHT) -> None:
        self.prior = prior
        self.weight = weight
        self.trials = 0.0
        self.successes = 0.0

    def add(self, trials: int, successes: int, window: float | None = None) -> None:
        """Count `trials` more, `successes` of them accepted. `window`: keep at most this
        many trials, older ones fading in proportion (for estimates that span requests)."""
        self.trials += trials
        self.successes += successes
        if window is not None and self.trials > window:
            scale = window / self.trials
            self.trials *= scale
            self.successes *= scale

    @property
    def rate(self) -> float:
        return (self.successes + self.weight * self.prior) / (self.trials + self.weight)
