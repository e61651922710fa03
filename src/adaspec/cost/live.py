"""What target calls cost here, learned from the calls a method runs: the cost profile's
curve rescaled per row count (`LiveScale`).

A profile is measured once per configuration and cached; the machine it prices changes
under it (another process, a slower or faster hour of a shared host, the Python side of a
served step): on a 2-vCPU Xeon a profile cached hours earlier priced a 1-row call at 59 ms
where the engine's took 43. The ratio of what a call took to what the profile
priced it at is learned per row count, each count's estimate pulled toward the ratio pooled
over all counts (a count seldom run is priced like the others, relative to the profile,
until its own calls say otherwise).
"""

from __future__ import annotations

import math

ROWS = 8  # row counts learned apart; calls of more rows share the last one's estimate
WINDOW = 32.0  # calls one row count's estimate remembers (older ones fade)
POOLED_WEIGHT = 2.0  # pseudo-calls at the pooled ratio behind each row count's estimate
LIMIT = 4.0  # a single call's ratio counts at most this far either way (a stall of the host)


class LiveScale:
    """Per row count, the geometric mean of (ms a call took / ms the profile priced it at)."""

    def __init__(self) -> None:
        self._logs = [0.0] * (ROWS + 1)  # index: rows (0 unused)
        self._calls = [0.0] * (ROWS + 1)

    def observe(self, rows: int, seen_ms: float, priced_ms: float) -> None:
        """A call of `rows` rows took `seen_ms`; the profile priced it at `priced_ms`."""
        if rows < 1 or not seen_ms > 0 or not priced_ms > 0:
            return
        i = min(rows, ROWS)
        ratio = min(max(seen_ms / priced_ms, 1 / LIMIT), LIMIT)
        self._logs[i] += math.log(ratio)
        self._calls[i] += 1.0
        if self._calls[i] > WINDOW:
            fade = WINDOW / self._calls[i]
            self._logs[i] *= fade
            self._calls[i] *= fade

    def scale(self, rows: int) -> float:
        """What to multiply the profile's price of a `rows`-row call by (1.0 before any
        call is seen)."""
        total = sum(self._calls)
        if total <= 0:
            return 1.0
        pooled = sum(self._logs) / total
        i = min(max(rows, 1), ROWS)
        return math.exp((self._logs[i] + POOLED_WEIGHT * pooled)
                        / (self._calls[i] + POOLED_WEIGHT))

    @property
    def calls(self) -> float:
        """Calls the estimates remember (faded), all row counts together."""
        return sum(self._calls)
