"""Rewards for the router's offline data: reward = alpha * similarity + (1 - alpha) * cost.

similarity: Rouge-L F-measure (the `rouge-score` package) between an arm's token ids and the
target's greedy token ids. adaspec's speculative arms are exact, so at temperature 0 their
output *is* the target's: similarity is 1 for every speculative arm (up to bf16 near-ties),
and only plain decoding, scored as in the paper by a *sampled* target output against the
greedy one, gets less. The paper's proxy therefore cannot tell our drafters apart; the cost
term has to, and the measured one does.

cost (higher = cheaper = better, in [0, 1]):
- `params`: the paper's c_i = 1 - e^{p_i} / e^{p_max}, p in billions of parameters run per
  drafted token; one number per arm, the same for every prompt;
- `measured` (default): the arm's measured speed on this prompt relative to the fastest arm,
  t_best / t_i with t = decode ms per token on this machine (the prompt's prefill is the
  same work for every arm, so it is left out); 1 for the fastest arm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

import numpy as np

from adaspec.errors import InputError

COSTS = ("measured", "params")
DEFAULT_COST = "measured"


class _IdTokenizer:
    """rouge-score tokenizer for token-id strings: the ids are the tokens (token level,
    no lower-casing or stemming of words)."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


@cache
def _scorer():
    """Built on first use: importing rouge-score (nltk) costs most of a second."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_IdTokenizer())


def rouge_l(reference: Sequence[int], candidate: Sequence[int]) -> float:
    """Token-level Rouge-L F-measure of two token-id sequences (1.0 when identical)."""
    if not reference and not candidate:
        return 1.0
    score = _scorer().score(" ".join(map(str, reference)), " ".join(map(str, candidate)))
    return float(score["rougeL"].fmeasure)


def param_costs(params: Sequence[int]) -> np.ndarray:
    """The paper's c_i = 1 - e^{p_i - p_max}, p in billions."""
    p = np.asarray(params, dtype=np.float64) / 1e9
    return 1.0 - np.exp(p - p.max())


def measured_costs(ms_per_token: np.ndarray) -> np.ndarray:
    """t_best / t_i per prompt (rows) and arm (columns)."""
    t = np.asarray(ms_per_token, dtype=np.float64)
    if (t <= 0).any() or not np.isfinite(t).all():
        raise InputError("measured costs need positive, finite ms per token for every arm")
    return t.min(axis=1, keepdims=True) / t


def rewards(
    similarity: np.ndarray,
    ms_per_token: np.ndarray,
    params: Sequence[int],
    alpha: float,
    cost: str = DEFAULT_COST,
) -> np.ndarray:
    """[prompts, arms] rewards alpha * similarity + (1 - alpha) * cost."""
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0) or math.isnan(alpha):
        raise InputError(f"alpha must be in [0, 1], got {alpha!r}")
    if cost not in COSTS:
        raise InputError(f"unknown cost {cost!r}; use one of {', '.join(COSTS)}")
    sim = np.asarray(similarity, dtype=np.float64)
    c = measured_costs(ms_per_token) if cost == "measured" else param_costs(params)[None, :]
    return alpha * sim + (1.0 - alpha) * np.broadcast_to(c, sim.shape)
