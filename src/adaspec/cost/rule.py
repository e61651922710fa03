"""When one more draft token pays: the stop rule every cost-aware drafter shares."""

from __future__ import annotations

from collections.abc import Sequence

# Look-ahead of the cost rule, as `auto`'s: a step in the verification curve (e.g. a kernel
# that works on blocks of 4 rows) can make one more token a loss and two more a gain.
LOOKAHEAD = 3


def cost_keeps_drafting(
    probs: Sequence[float], guess: float, step_ms: Sequence[float], limit: int,
    base: float = 1.0,
) -> bool:
    """The cost rule, shared by `auto`, DISCO's `stop=cost` and the tuning simulation.

    probs: acceptance probability of each token drafted so far in this step; step_ms[n]: ms
    of a step that drafts n tokens (n draft forwards + a verification of n + overhead).
    A step drafting n tokens emits base + sum_{i <= n} prod_{j <= i} p_j tokens on average
    (base: 1, or in a batch the round's time in this request's tokens, `AutoDrafter._base`);
    draft another when that per ms would rise with one more token, or with up to LOOKAHEAD
    more, each guessed accepted with probability `guess` (at most `limit` in all)."""
    n = len(probs)
    value, p_all = base, 1.0
    for p in probs:
        p_all *= p
        value += p_all
    now = value / step_ms[n]
    extra, p = 0.0, p_all
    for h in range(1, min(LOOKAHEAD, limit - n, len(step_ms) - 1 - n) + 1):
        p *= guess
        extra += p
        if (value + extra) / step_ms[n + h] > now:
            return True
    return False
