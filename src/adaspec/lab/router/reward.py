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
- `profile`: the same ratio with t = the arm's decode ms per token predicted by a cost
  profile from what the arm did on this prompt (`priced_decode_ms`: its recorded steps,
  each a verification of that many drafted tokens or tree nodes, its draft forwards, the
  draft's prompt prefill). Free of the collection run's timing noise, and it prices the same
  collected runs for another machine (a measured profile) or for hardware one does not have
  (`flat`): the parameter-count proxy cannot see that on a CPU every verified token costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from adaspec.errors import InputError

if TYPE_CHECKING:
    from adaspec.cost.profile import CostProfile

COSTS = ("measured", "params", "profile")
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


def priced_decode_ms(
    row: dict, profile: CostProfile, branching: Sequence[int] | None = None
) -> float:
    """A bench row's decode (the target's prompt prefill left out, as in the measured cost)
    priced by `profile`, in ms: every recorded step (drafted, accepted) one target pass over
    the drafted tokens + 1 (for a tree arm with `branching`, over the nodes of a tree that
    deep + 1), every other decode call of the target one single-token pass, the loop's
    overhead per pass, every draft forward one single-token draft forward (a tree's level
    forwards over that level's nodes) and the draft's prompt prefill when the arm drafted.
    Priced at the prompt's length + half the answer, per turn (the context a step sees)."""
    from adaspec.core.token_tree import PricedBranching, tree_node_count

    if isinstance(branching, PricedBranching):
        raise InputError("a tree=priced arm records its steps' depth, not their shapes: price "
                         "the router with --cost measured, or give the arm a fixed tree")
    steps = [(int(d), int(a)) for d, a in row.get("steps") or []]
    turns = max(1, len(row.get("turn_tokens") or [1]))
    context = (int(row.get("prompt_tokens", 0)) + int(row.get("new_tokens", 0)) // 2) // turns
    single = int(row["target_calls"]) - turns - len(steps)  # plain steps: no draft
    if single < 0:
        raise InputError(f"bench row of {row.get('method')!r} on {row.get('prompt_id')!r} has "
                         "fewer target calls than steps")
    ms = single * profile.target_ms(1, context) + (single + len(steps)) * profile.overhead_ms
    draft_calls = int(row.get("draft_calls", 0))
    for d, _ in steps:
        nodes = d if not branching else tree_node_count(tuple(branching)[:d])
        ms += profile.target_ms(nodes + 1, context)
    if draft_calls:
        if profile.draft is None:
            raise InputError("the cost profile has no draft model, the arm drafts with one: "
                             "measure it with a draft (adaspec profile)")
        if branching:  # one forward for the root, one per further level over its nodes
            for d, _ in steps:
                width = 1
                ms += profile.draft_ms(1, context)
                for b in tuple(branching)[: d - 1]:
                    width *= b
                    ms += profile.draft_ms(width, context)
        else:
            ms += draft_calls * profile.draft_ms(1, context)
        if profile.draft_prefill_tokens_per_s > 0:
            ms += 1000 * int(row.get("prompt_tokens", 0)) / profile.draft_prefill_tokens_per_s
    return ms


def rewards(
    similarity: np.ndarray,
    ms_per_token: np.ndarray,
    params: Sequence[int],
    alpha: float,
    cost: str = DEFAULT_COST,
) -> np.ndarray:
    """[prompts, arms] rewards alpha * similarity + (1 - alpha) * cost. For `measured` the
    ms per token are the measured ones, for `profile` the profile's prices of the same runs
    (`priced_decode_ms` per new token); `params` reads only the parameter counts."""
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0) or math.isnan(alpha):
        raise InputError(f"alpha must be in [0, 1], got {alpha!r}")
    if cost not in COSTS:
        raise InputError(f"unknown cost {cost!r}; use one of {', '.join(COSTS)}")
    sim = np.asarray(similarity, dtype=np.float64)
    c = param_costs(params)[None, :] if cost == "params" else measured_costs(ms_per_token)
    return alpha * sim + (1.0 - alpha) * np.broadcast_to(c, sim.shape)
