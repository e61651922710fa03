"""End-to-end sampling exactness: what `generate` emits at temperature > 0 follows the
target's processed distribution, for a chain method and a tree method.

A tiny 8-token target lets us enumerate the exact law of plain decoding (`ar`) over the first
three generated tokens from the target's own logits (73 contexts, one batched forward). The
first token comes from the prefill; tokens 2 and 3 (and more, which are not checked) from the
first speculative step, so the check is the chi-square of tests/stats_helpers.py on the
joint laws of tokens (1, 2) and (2, 3): p > 1e-6 for the real verifiers. A verifier with a
classic bug, injected through `Engine(..., verify=...)`, must fail the same check at
p < 1e-12. The verifiers themselves are checked far more tightly (10^5 verdicts per case)
in tests/test_verify.py and tests/test_verify_multi.py; here the point is the wiring: the
engine hands the verifier the right draft and target distributions, draws the tree's
candidates the way the verifier needs, and emits what it verified.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import SamplingParams, process_logits, sample_rows
from adaspec.engine.loop import Engine
from adaspec.methods.build import build_generator
from adaspec.verify import MCSSWithoutReplacementVerifier, SpeculativeVerifier
from adaspec.verify.base import Verdict

from .conftest import sampling_backend, tiny_model
from .stats_helpers import Fit, assert_caught, assert_exact, fit
from .test_verify import broken_chain
from .test_verify_multi import broken_mcss

V = 8
PROMPT = [1, 2, 3]
RUNS = 1000  # generate() calls per check (about 2.5 ms each)


def exact_law(model, params: SamplingParams, length: int) -> torch.Tensor:
    """Plain decoding's exact law of the first `length` generated tokens, [V**length]
    (cell a * V + b for tokens a, b), from the target's processed logits."""
    seqs = torch.tensor(
        [PROMPT + list(s) for s in itertools.product(range(V), repeat=length - 1)]
    ).view(-1, len(PROMPT) + length - 1)
    with torch.no_grad():
        probs = process_logits(model(seqs).logits[:, len(PROMPT) - 1 :], params).double()
    rows = torch.arange(len(seqs))
    path = torch.ones(len(seqs), dtype=torch.float64)
    for j in range(length - 1):
        path = path * probs[rows, j, seqs[:, len(PROMPT) + j]]
    return (path.unsqueeze(1) * probs[:, length - 1]).flatten()


def first_tokens(
    engine, params: SamplingParams, max_new_tokens: int, runs: int = RUNS
) -> tuple[torch.Tensor, float]:
    """The first three generated tokens of `runs` seeded requests, as cells a * V^2 + b * V
    + c, and the acceptance rate."""
    cells = torch.zeros(runs, dtype=torch.long)
    accepted = drafted = 0
    for seed in range(runs):
        sampling = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        res = engine.generate(PROMPT, max_new_tokens=max_new_tokens, sampling=sampling)
        a, b, c = res.token_ids[:3]
        cells[seed] = (a * V + b) * V + c
        accepted += res.stats.accepted
        drafted += res.stats.drafted
    return cells, accepted / max(drafted, 1)


def check(cells: torch.Tensor, model, params: SamplingParams) -> list[Fit]:
    """Tokens (1, 2) and tokens (2, 3) against plain decoding's exact joint laws."""
    law = exact_law(model, params, 3).view(V * V, V)
    return [fit(cells // V, law.sum(1)), fit(cells % (V * V), law.view(V, V * V).sum(0))]


# ---------------------------------------------------------------------------------------------
# Broken verifiers (the rules of tests/test_verify*.py behind the engine's interface).


class CorrectionFromP(SpeculativeVerifier):
    """Speculative sampling that draws the correction from p, not norm(max(0, p - q))."""

    name = "broken-correction-from-p"

    def verify(self, proposal, target_probs, generator) -> Verdict:
        self.check(proposal, target_probs)
        k = proposal.depth
        if k == 0:
            return Verdict([], int(sample_rows(target_probs[:1], generator)[0]))
        tokens = torch.tensor(proposal.tokens, dtype=torch.long).view(1, k)
        q = None if proposal.probs is None else proposal.probs.unsqueeze(0)
        accepted, nxt = broken_chain("correction_from_p")(
            tokens, q, target_probs.unsqueeze(0), generator
        )
        return Verdict(list(range(1, int(accepted[0]) + 1)), int(nxt[0]))


class NoResidualUpdate(MCSSWithoutReplacementVerifier):
    """MCSS without replacement that tests every sibling against p (no residual update)."""

    name = "broken-no-residual"

    def step(self, candidates, q, p, generator):
        return broken_mcss("no_residual", replacement=False)(candidates, q, p, generator)


class DrawsChecked(MCSSWithoutReplacementVerifier):
    """The real mcss-wor, noting how the candidates of every proposal it gets were drawn."""

    def __init__(self) -> None:
        self.seen: list[bool | None] = []

    def verify(self, proposal, target_probs, generator) -> Verdict:
        if not proposal.is_chain:
            self.seen.append(proposal.replacement)
        return super().verify(proposal, target_probs, generator)


@pytest.fixture(scope="module")
def pair():
    return tiny_model(vocab=V, seed=5, sharpen=6.0), tiny_model(
        vocab=V, seed=6, layers=1, sharpen=6.0
    )


CHAIN = ("draft:k=3", SamplingParams(1.0, top_k=6), 5)  # the first step drafts 3
TREE = ("draft:tree=2x2,verify=mcss-wor", SamplingParams(0.8, top_k=5, top_p=0.9), 4)


def test_plain_decoding_fits_its_exact_law(pair):
    """The harness itself: `ar` samples fit the law computed from the target's logits."""
    target_model, _ = pair
    params = CHAIN[1]
    engine = build_generator("ar", TorchBackend(target_model), None, None, [])
    cells, _ = first_tokens(engine, params, 3, runs=500)
    assert_exact(check(cells, target_model, params), "ar")


# the chain through transformers' cache (`TorchBackend`), the rest on the quicker static
# decoder (`sampling_backend`): the same weights, the same law
@pytest.mark.parametrize(
    ("method", "params", "max_new", "broken", "runtime"),
    [
        pytest.param(*CHAIN, None, TorchBackend, id="chain"),
        pytest.param(*CHAIN, CorrectionFromP, sampling_backend, id="chain-correction-from-p"),
        pytest.param(*TREE, None, sampling_backend, id="tree"),
        pytest.param(*TREE, NoResidualUpdate, sampling_backend, id="tree-no-residual-update"),
    ],
)
def test_sampling_matches_plain_decoding(pair, method, params, max_new, broken, runtime):
    target_model, draft_model = pair
    engine = build_generator(method, runtime(target_model), None, runtime(draft_model), [])
    spy = None
    if broken is not None:
        engine = Engine(engine.target, None, drafter=engine.drafter,
                        controller=engine.controller, verify=broken(), eos_token_ids=[])
    elif engine.drafts_trees:
        spy = DrawsChecked()
        engine = Engine(engine.target, None, drafter=engine.drafter,
                        controller=engine.controller, verify=spy, eos_token_ids=[])
    cells, acceptance = first_tokens(engine, params, max_new)
    fits = check(cells, target_model, params)
    if broken is not None:
        assert_caught(fits, broken.name)
        return
    assert 0.05 < acceptance < 0.95  # both the accept and the reject paths ran
    assert_exact(fits, method)
    if spy is not None:  # the drafter drew every tree's siblings as the verifier needs
        assert spy.seen and set(spy.seen) == {spy.replacement}
