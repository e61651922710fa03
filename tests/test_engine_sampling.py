"""End-to-end sampling exactness: emitted tokens follow the target's processed distribution.

A tiny 8-token model lets us enumerate the exact target distribution of the first three
generated tokens; the second and third come out of one speculative step (k = 2). A verifier
that accepts every draft token is run through the same check and must fail it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from adaspec.backends.torch_backend import TorchBackend
from adaspec.engine.build import build_engine
from adaspec.engine.sampling import SamplingParams, process_logits
from adaspec.verify.base import Verdict, Verifier

from .conftest import tiny_model

V = 8
PROMPT = [1, 2, 3]
SAMPLES = 2000
# Total-variation bound over 8 cells: expected sampling error 0.5 * sqrt(8 / N) plus a
# McDiarmid margin for a 1e-4 false alarm (about 0.08 at N = 2000). The wrong verifier
# lands near 0.2.
BOUND = 0.5 * math.sqrt(V / SAMPLES) + math.sqrt(math.log(1e4) / (2 * SAMPLES))


class AcceptEverything(Verifier):
    """Deliberately wrong: keeps every draft token, so outputs follow the draft."""

    name = "wrong"

    def verify(self, draft_tokens, draft_probs, target_probs, generator) -> Verdict:
        n = len(draft_tokens)
        return Verdict(
            accepted=n, next_token=int(torch.multinomial(target_probs[n], 1, generator=generator))
        )


def exact_marginals(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of generated tokens 2 and 3 (marginalised over the others)."""
    with torch.no_grad():

        def dist(prefix: list[int]) -> torch.Tensor:
            return process_logits(model(torch.tensor([prefix])).logits[0, -1], params)

        p1 = dist(PROMPT)
        second = torch.zeros(V)
        third = torch.zeros(V)
        for a, b in itertools.product(range(V), range(V)):
            pa = p1[a]
            pb = dist(PROMPT + [a])[b]
            second[b] += pa * pb
            third += pa * pb * dist(PROMPT + [a, b])
    return second, third


def empirical(engine, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, float]:
    second = torch.zeros(V)
    third = torch.zeros(V)
    accepted = drafted = 0
    for seed in range(SAMPLES):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        res = engine.generate(PROMPT, max_new_tokens=4, sampling=p)
        second[res.token_ids[1]] += 1
        third[res.token_ids[2]] += 1
        accepted += res.stats.accepted
        drafted += res.stats.drafted
    return second / SAMPLES, third / SAMPLES, accepted / drafted


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


@pytest.fixture(scope="module")
def pair():
    return tiny_model(vocab=V, seed=5, sharpen=6.0), tiny_model(
        vocab=V, seed=6, layers=1, sharpen=6.0
    )


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=5, top_p=0.9)])
def test_speculative_sampling_matches_target_distribution(pair, params):
    target_model, draft_model = pair
    engine = build_engine(
        "draft:k=2", TorchBackend(target_model), None, TorchBackend(draft_model), []
    )
    second, third, acceptance = empirical(engine, params)
    exact2, exact3 = exact_marginals(target_model, params)
    assert 0.05 < acceptance < 0.95  # both the accept and the reject paths ran
    assert tv(second, exact2) < BOUND
    assert tv(third, exact3) < BOUND


def test_wrong_verifier_fails_the_same_check(pair):
    target_model, draft_model = pair
    params = SamplingParams(1.0)
    engine = build_engine(
        "draft:k=2", TorchBackend(target_model), None, TorchBackend(draft_model), []
    )
    engine.verifier = AcceptEverything()
    second, third, _ = empirical(engine, params)
    exact2, exact3 = exact_marginals(target_model, params)
    assert max(tv(second, exact2), tv(third, exact3)) > BOUND
