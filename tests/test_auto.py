"""`auto`: cost-aware proposals. Exact whatever it chooses; what it chooses follows the
cost profile and the acceptance it observes."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch_backend import TorchBackend
from adaspec.cost.profile import CostProfile, Curve
from adaspec.draft.auto import AutoDrafter, RateEstimate
from adaspec.engine.build import build_engine
from adaspec.engine.sampling import SamplingParams
from adaspec.errors import InputError
from adaspec.methods.spec import parse_method

from .stats_helpers import assert_exact
from .test_engine import PROMPTS, reference_greedy
from .test_engine_sampling import V, check, first_tokens

REPEATING = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]


def flat_profile(draft_ms: float = 2.0) -> CostProfile:
    """Verification nearly free, drafting cheap: speculation pays whenever it may."""
    sizes = list(range(1, 17))
    return CostProfile(
        target=Curve(sizes, [0], [[40.0 + 0.1 * n for n in sizes]]),
        draft=Curve([1, 2, 4], [0], [[draft_ms, draft_ms, draft_ms]]),
        draft_prefill_tokens_per_s=1e5,
    )


def steep_profile() -> CostProfile:
    """Every verified token costs a whole pass and the draft as much: nothing pays."""
    sizes = list(range(1, 17))
    return CostProfile(
        target=Curve(sizes, [0], [[40.0 * n for n in sizes]]),
        draft=Curve([1], [0], [[40.0]]),
        draft_prefill_tokens_per_s=1e3,
    )


@pytest.mark.parametrize("use", ["ngram+draft", "ngram", "draft"])
@pytest.mark.parametrize("profile", ["flat", "steep"])
def test_auto_greedy_equals_plain_decoding(target, draft, target_model, use, profile):
    costs = flat_profile() if profile == "flat" else steep_profile()
    engine = build_engine(f"auto:use={use}", target, None, draft, eos_token_ids=[],
                          profile=costs)
    drafted = 0
    for prompt in [*PROMPTS, REPEATING]:
        res = engine.generate(prompt, max_new_tokens=40)
        assert res.token_ids == reference_greedy(target_model, prompt, 40), (use, prompt)
        drafted += res.stats.drafted
    if profile == "flat":
        assert drafted > 0  # it did speculate: the equality above is not plain decoding's
    else:
        assert drafted == 0  # nothing pays under these costs: plain steps only


def test_auto_takes_long_ngram_runs_when_verification_is_cheap(target, draft):
    engine = build_engine("auto:use=ngram", target, None, draft, eos_token_ids=[],
                          profile=flat_profile())
    # A target that repeats itself: after a few tokens the n-gram index predicts it well.
    res = engine.generate(REPEATING, max_new_tokens=60)
    drafter = engine.drafter
    assert isinstance(drafter, AutoDrafter)
    assert drafter.choices.ngram > 0 and drafter.choices.draft == 0
    assert res.stats.drafted >= res.stats.target_calls - 1 - drafter.choices.plain


def test_auto_uses_the_draft_model_when_it_is_cheap_and_stops_when_it_is_not(target, draft):
    cheap = build_engine("auto:use=draft", target, None, draft, eos_token_ids=[],
                         profile=flat_profile(draft_ms=0.5))
    res = cheap.generate(PROMPTS[1], max_new_tokens=30)
    assert cheap.drafter.choices.draft > 0 and res.stats.draft_calls > 0
    dear = build_engine("auto:use=draft", target, None, draft, eos_token_ids=[],
                        profile=flat_profile(draft_ms=400.0))
    res = dear.generate(PROMPTS[1], max_new_tokens=30)
    assert dear.drafter.choices.draft == 0 and res.stats.draft_calls == 0


def test_acceptance_estimates_learn_from_verification(target, draft):
    """A draft that the target always rejects drives its estimate down, and auto then stops
    drafting with it (plain steps take over)."""
    from .test_engine import NegatedBackend

    bad = NegatedBackend(draft.model, name="negated")
    engine = build_engine("auto:use=draft", target, None, bad, eos_token_ids=[],
                          profile=flat_profile(draft_ms=5.0))
    res = engine.generate(PROMPTS[0], max_new_tokens=40)
    drafter = engine.drafter
    assert res.stats.accepted == 0
    assert drafter.draft_overall.rate < drafter.draft_overall.prior
    assert drafter.choices.plain > drafter.choices.draft  # it gave up on the draft


def test_rate_estimate_is_a_beta_posterior():
    r = RateEstimate(0.5, weight=2.0)
    assert r.rate == 0.5
    r.add(8, 8)
    assert r.rate == pytest.approx((8 + 1) / 10)


def test_best_length_follows_the_cost_curve():
    steep = AutoDrafter(steep_profile())
    flat = AutoDrafter(flat_profile())
    assert steep._best_length(0.9, 10, 0.0, 0.0, 100)[0] == 0  # plain step wins
    assert flat._best_length(0.9, 10, 0.0, 0.0, 100)[0] == 10  # all of it
    assert flat._best_length(0.0, 10, 0.0, 0.0, 100)[0] == 0  # nothing would be accepted


def test_auto_method_strings():
    assert parse_method("auto").needs_draft_model()
    assert not parse_method("auto:use=ngram").needs_draft_model()
    for bad, message in [("auto:use=tree", "use must be"), ("auto:k_max=0", "k_max"),
                         ("auto:n_min=3,n_max=2", "n_min")]:
        with pytest.raises(InputError, match=message):
            parse_method(bad)


def test_auto_needs_a_draft_profile_for_the_draft_model(target, draft):
    no_draft = CostProfile(target=Curve([1, 2], [0], [[40.0, 41.0]]))
    with pytest.raises(InputError, match="measured the draft"):
        build_engine("auto", target, None, draft, eos_token_ids=[], profile=no_draft)
    with pytest.raises(InputError, match="needs a draft model"):
        build_engine("auto", target, None, None, eos_token_ids=[], profile=no_draft)


def test_auto_sampling_matches_target_distribution():
    """T > 0: whatever auto proposes (n-gram one-hot or the draft's distribution), the
    emitted tokens follow the target's distribution (the same check a wrong verifier fails
    in test_engine_sampling)."""
    from .conftest import tiny_model

    target_model = tiny_model(vocab=V, seed=5, sharpen=6.0)
    draft_model = tiny_model(vocab=V, seed=6, layers=1, sharpen=6.0)
    engine = build_engine("auto:k_max=2", TorchBackend(target_model), None,
                          TorchBackend(draft_model), [], profile=flat_profile())
    params = SamplingParams(1.0)
    cells, _ = first_tokens(engine, params, max_new_tokens=4)
    assert engine.drafter.choices.draft + engine.drafter.choices.ngram > 0
    assert_exact(check(cells, target_model, params), "auto")
    torch.manual_seed(0)


@pytest.mark.parametrize("p_accept", [0.05, 0.97])
def test_a_disco_artifact_estimates_draft_acceptance(target, draft, target_model, tmp_path,
                                                     p_accept):
    """With disco=FILE the classifier's acceptance probability prices each draft token: a
    classifier that expects rejection keeps drafts short, one that expects acceptance lets
    them grow; greedy output stays plain decoding's either way."""
    from .disco_helpers import artifact, constant_classifier

    path = tmp_path / "disco.pt"
    artifact(constant_classifier(p_accept)).save(path)
    engine = build_engine(f"auto:use=draft,disco={path}", target, None, draft,
                          eos_token_ids=[], profile=flat_profile(draft_ms=3.0))
    res = engine.generate(PROMPTS[2], max_new_tokens=30)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[2], 30)
    longest = max((d for d, _ in res.stats.steps), default=0)
    if p_accept < 0.5:
        assert longest <= 1
    else:
        assert longest >= 4


def test_a_disco_artifact_for_another_pair_is_refused(target, draft, tmp_path):
    from .disco_helpers import artifact, constant_classifier

    path = tmp_path / "disco.pt"
    artifact(constant_classifier(0.5), target="other-target").save(path)
    with pytest.raises(InputError):
        build_engine(f"auto:disco={path}", target, None, draft, eos_token_ids=[],
                     profile=flat_profile())
