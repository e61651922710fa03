"""`auto`: cost-aware proposals. Exact whatever it chooses; what it chooses follows the
cost profile and the acceptance it observes."""

from __future__ import annotations

import math

import pytest
import torch

from adaspec.control.static import StaticLength
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams, process_logits, sample
from adaspec.cost.profile import CostProfile, Curve
from adaspec.draft.auto import AutoDrafter, RateEstimate
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
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
    engine = build_generator(f"auto:use={use}", target, None, draft, eos_token_ids=[],
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
    engine = build_generator("auto:use=ngram", target, None, draft, eos_token_ids=[],
                          profile=flat_profile())
    # A target that repeats itself: after a few tokens the n-gram index predicts it well.
    res = engine.generate(REPEATING, max_new_tokens=60)
    drafter = engine.drafter
    assert isinstance(drafter, AutoDrafter)
    assert drafter.choices.ngram > 0 and drafter.choices.draft == 0
    assert res.stats.drafted >= res.stats.target_calls - 1 - drafter.choices.plain


def dear_rows_profile() -> CostProfile:
    """A verified row costs 0.8 of a plain step: n-gram drafts pay only where they are
    accepted far more often than the priors say (0.95 pays for a token, 0.7 does not)."""
    sizes = list(range(1, 17))
    return CostProfile(target=Curve(sizes, [0], [[10.0 * (1 + 0.8 * (n - 1)) for n in sizes]]))


@pytest.mark.parametrize("learns", [True, False], ids=["learns", "negative control"])
def test_ngram_estimates_learn_from_continuations_not_proposed(target, draft, monkeypatch,
                                                                learns):
    """Where the priors do not pay for an n-gram draft, plain steps still tell how right the
    n-gram's continuation would have been, so a request that repeats itself starts drafting
    (without that it never proposes one, and never learns)."""
    import adaspec.draft.auto as auto_mod

    if not learns:
        monkeypatch.setattr(auto_mod, "_shadow_outcome", lambda seen, context: (0, 0))
    engine = build_generator("auto:use=ngram", target, None, draft, eos_token_ids=[],
                             profile=dear_rows_profile())
    res = engine.generate(REPEATING, max_new_tokens=60)
    drafter = engine.drafter
    assert isinstance(drafter, AutoDrafter)
    if learns:
        assert drafter.choices.ngram > 0 and res.stats.accepted > 0
        assert max(r.rate for r in drafter.ngram_rates.values()) > 0.9
    else:
        assert drafter.choices.ngram == 0 and res.stats.drafted == 0


def test_a_continuation_not_proposed_counts_up_to_its_first_miss():
    from adaspec.draft.auto import Choice, _shadow_outcome

    seen = Choice("ngram", [5, 6, 7], start=2, match=3)
    assert _shadow_outcome(seen, [1, 2, 5]) == (1, 1)  # a plain step: one token to judge
    assert _shadow_outcome(seen, [1, 2, 5, 6, 9]) == (3, 2)  # the third differs
    assert _shadow_outcome(seen, [1, 2, 4, 6, 7]) == (1, 0)  # the first differs: no more
    assert _shadow_outcome(seen, [1, 2]) == (0, 0)  # nothing emitted yet


def test_auto_uses_the_draft_model_when_it_is_cheap_and_stops_when_it_is_not(target, draft):
    cheap = build_generator("auto:use=draft", target, None, draft, eos_token_ids=[],
                         profile=flat_profile(draft_ms=0.5))
    res = cheap.generate(PROMPTS[1], max_new_tokens=30)
    assert cheap.drafter.choices.draft > 0 and res.stats.draft_calls > 0
    dear = build_generator("auto:use=draft", target, None, draft, eos_token_ids=[],
                        profile=flat_profile(draft_ms=400.0))
    res = dear.generate(PROMPTS[1], max_new_tokens=30)
    assert dear.drafter.choices.draft == 0 and res.stats.draft_calls == 0


def test_acceptance_estimates_learn_from_verification(target, draft):
    """A draft that the target always rejects drives its estimate down, and auto then stops
    drafting with it (plain steps take over)."""
    from .test_engine import NegatedBackend

    bad = NegatedBackend(draft.model, name="negated")
    engine = build_generator("auto:use=draft", target, None, bad, eos_token_ids=[],
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
        build_generator("auto", target, None, draft, eos_token_ids=[], profile=no_draft)
    with pytest.raises(InputError, match="needs a draft model"):
        build_generator("auto", target, None, None, eos_token_ids=[], profile=no_draft)


def test_auto_sampling_matches_target_distribution():
    """T > 0: whatever auto proposes (n-gram one-hot or the draft's distribution), the
    emitted tokens follow the target's distribution (the same check a wrong verifier fails
    in test_engine_sampling)."""
    from .conftest import sampling_backend, tiny_model

    target_model = tiny_model(vocab=V, seed=5, sharpen=6.0)
    draft_model = tiny_model(vocab=V, seed=6, layers=1, sharpen=6.0)
    engine = build_generator("auto:k_max=2", sampling_backend(target_model), None,
                          sampling_backend(draft_model), [], profile=flat_profile())
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
    engine = build_generator(f"auto:use=draft,disco={path}", target, None, draft,
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
        build_generator(f"auto:disco={path}", target, None, draft, eos_token_ids=[],
                     profile=flat_profile())


# ------------------------------------------------------------------------------------------
# `auto`'s cost arithmetic, exactly: the tests written against mutmut's survivors in
# `draft/auto.py` (docs/mutation.md; kept in this file, as mutmut's test selection is part of
# its configuration). Hand-made cost profiles whose prices depend on the context length (so
# a price read at the wrong context shows), and a scripted draft model whose confidences set
# each token's estimated acceptance.

VOCAB = 50
GREEDY = SamplingParams()
SIZES = list(range(1, 17))


def confident(token: int, confidence: float = 0.99) -> torch.Tensor:
    """Logits whose argmax is `token` with this top probability."""
    logits = torch.zeros(VOCAB)
    logits[token] = math.log(confidence * (VOCAB - 1) / (1 - confidence))
    return logits


class ScriptedDraft:
    """A draft model stand-in: returns the scripted logits, one row per step."""

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.backend = object()
        self.rows = list(rows)
        self.steps = 0
        self.cached_len = 0
        self.started_with: list[int] | None = None
        self.held: list[int] = []  # what the cache holds from an earlier request

    def reusable(self, prompt_ids: list[int]) -> int:
        n = 0
        while n < min(len(self.held), len(prompt_ids) - 1) and self.held[n] == prompt_ids[n]:
            n += 1
        return n

    def prefill(self, context: list[int]) -> None:
        self.started_with = list(context)
        self.cached_len = len(context) - 1

    def pending(self, context: list[int]) -> list[int]:
        return context[self.cached_len:]

    def step(self, tokens: list[int]) -> torch.Tensor:
        row = self.rows[min(self.steps, len(self.rows) - 1)]
        self.steps += 1
        self.cached_len += len(tokens)
        return row

    def commit(self, req: RequestState, path: list[int]) -> None:
        pass


def two_context_profile(target_rows, draft_rows=None, overhead_ms=0.0) -> CostProfile:
    """Row 0 prices context length 0, row 1 context length >= 10 (every test context)."""
    draft = None
    if draft_rows is not None:
        draft = Curve(list(range(1, len(draft_rows[0]) + 1)), [0, 10], draft_rows)
    return CostProfile(target=Curve(SIZES, [0, 10], target_rows), draft=draft,
                       draft_prefill_tokens_per_s=1e9, overhead_ms=overhead_ms)


STEEP = [40.0 * n for n in SIZES]
FLAT = [40.0 + 0.1 * n for n in SIZES]


def drafted(proposal) -> list[int]:
    return proposal.tree.tokens[1:]


def auto_propose(drafter: AutoDrafter, context: list[int], max_tokens: int = 8,
                 params: SamplingParams = GREEDY, generator=None, seat=None, remaining=0):
    req = RequestState.of(context, params, generator, remaining=remaining, seat=seat)
    return drafter.propose(req, max_tokens, StaticLength(max_tokens))


# ------------------------------------------------------------------ prices
def test_verify_ms_is_the_target_forward_plus_the_loop_overhead():
    drafter = AutoDrafter(two_context_profile([STEEP, FLAT], overhead_ms=5.0))
    assert drafter._verify_ms(2, 17) == pytest.approx(40.0 + 0.1 * 3 + 5.0)
    assert drafter._verify_ms(0, 0) == pytest.approx(40.0 + 5.0)


def test_best_length_prices_the_plain_step_at_this_context_and_keeps_it_on_a_tie():
    # Context 17 (row 1): a plain step costs 40 ms, a verification of one token too.
    rows = [[1.0] * 16, [40.0, 40.0, *[50.0 + n for n in range(14)]]]
    drafter = AutoDrafter(two_context_profile(rows))
    # Nothing is accepted: one drafted token is worth exactly the plain step: n = 0 stays.
    assert drafter._best_length(0.0, 2, 0.0, 0.0, 17) == (0, 1 / 40.0)
    # the plain step's price is read at the context asked for, not the first measured one
    assert drafter._best_length(0.0, 2, 0.0, 0.0, 0) == (0, 1 / 1.0)


def test_catch_up_is_free_when_only_the_last_token_is_new():
    profile = two_context_profile([FLAT, FLAT], [[2.0, 3.0, 4.0], [2.0, 3.0, 4.0]])
    draft = ScriptedDraft([confident(1)])
    drafter = AutoDrafter(profile, draft=draft)
    drafter.begin(RequestState.of(REPEATING))
    drafter._model_started = True
    draft.cached_len = len(REPEATING) - 1  # one token to feed: a plain draft forward
    assert drafter._catch_up_ms(REPEATING) == (0.0, 0.0)
    draft.cached_len = len(REPEATING)  # nothing pending still feeds one token
    assert drafter._catch_up_ms(REPEATING) == (0.0, 0.0)
    draft.cached_len = len(REPEATING) - 3  # three tokens: 4 ms instead of 2
    assert drafter._catch_up_ms(REPEATING) == pytest.approx((2.0, 0.0))


def test_the_draft_prefill_is_spread_over_the_tokens_still_to_come():
    """Alone, a draft model's prompt prefill is charged per token the request is expected
    to emit still: as many as it has produced, within its budget left. A short answer never
    pays for it, nor does a request about to end."""
    profile = two_context_profile([FLAT, FLAT], [[2.0, 3.0, 4.0], [2.0, 3.0, 4.0]])
    drafter = AutoDrafter(profile, draft=ScriptedDraft([confident(1)]))
    prompt = REPEATING[:6]
    drafter.begin(RequestState.of(prompt))
    per_s = profile.draft_prefill_tokens_per_s
    whole = 1000 * len(prompt) / per_s
    assert drafter._catch_up_ms(prompt) == pytest.approx((0.0, whole))  # nothing produced
    context = prompt + [1] * 40
    assert drafter._catch_up_ms(context) == pytest.approx((0.0, 1000 * len(context) / per_s / 40))
    drafter._remaining = 100  # a budget beyond what it produced: still 40 expected
    assert drafter._catch_up_ms(context) == pytest.approx((0.0, 1000 * len(context) / per_s / 40))
    drafter._remaining = 5  # five tokens left at most
    assert drafter._catch_up_ms(context) == pytest.approx((0.0, 1000 * len(context) / per_s / 5))
    # the draft cache still holds the shared start of the previous request's prompt (a chat
    # template's system turn): only the rest is priced
    drafter.model.held = prompt[:4] + [99]
    assert drafter._catch_up_ms(context) == pytest.approx(
        (0.0, 1000 * (len(context) - 4) / per_s / 5))


def test_a_prefill_priced_per_token_decides_whether_the_draft_starts():
    """The prefill's share rides on every expected token of the step that would start the
    draft: a draft that wins per step loses to a plain step when the request has few
    tokens left to pay the prefill back over, and wins when it has many."""
    profile = flat_profile()
    profile.draft_prefill_tokens_per_s = 200.0  # 46 tokens: 230 ms, five and a half calls
    drafter = AutoDrafter(profile, draft=ScriptedDraft([confident(1)]), use_ngram=False)
    drafter.begin(RequestState.of(REPEATING[:6]))
    context = REPEATING[:6] + [1] * 40
    fixed, per_emitted = drafter._catch_up_ms(context)
    n, _ = drafter._best_length(0.9, 4, fixed, 1.0, len(context), per_emitted)
    assert n > 0  # 40 tokens to come: the prefill is paid back
    drafter._remaining = 2
    fixed, per_emitted = drafter._catch_up_ms(context)
    assert drafter._best_length(0.9, 4, fixed, 1.0, len(context), per_emitted)[0] == 0


def test_the_draft_starts_only_where_it_beats_the_rate_the_request_had_without_it():
    """Before the draft model starts, a request's steps alone are counted at their priced
    ms; once they have made RATE_EVIDENCE tokens, the draft starts only at a step whose
    priced rate (prefill share included) beats theirs. A step with no n-gram match offers
    only a plain step beside the draft, which the draft beats; the n-gram steps that came
    before made tokens faster than the draft would."""
    from adaspec.draft.auto import RATE_EVIDENCE

    profile = two_context_profile([FLAT, FLAT], [[20.0] * 16, [20.0] * 16])
    context = list(range(10, 40))  # no repeats: no n-gram match, plain step or draft

    def choose(without: list) -> str:
        drafter = AutoDrafter(profile, draft=ScriptedDraft([confident(1)]))
        drafter.begin(RequestState.of(context[:20]))
        drafter._without_draft = list(without)
        drafter.propose(RequestState.of(context, SamplingParams()), 4, StaticLength(4))
        return "draft" if drafter.choices.draft else "plain"

    assert choose([0, 0.0]) == "draft"  # nothing known: the step's own options decide
    assert choose([RATE_EVIDENCE - 1, 1.0]) == "draft"  # too few tokens to tell
    assert choose([RATE_EVIDENCE, RATE_EVIDENCE * 10.0]) == "plain"  # 10 ms a token before
    assert choose([RATE_EVIDENCE, RATE_EVIDENCE * 40.0]) == "draft"  # plain steps before

    # what is counted: a step alone, the tokens it emitted and its priced ms
    drafter = AutoDrafter(profile, draft=ScriptedDraft([confident(1)]))
    drafter.begin(RequestState.of(REPEATING[:6]))
    drafter.propose(RequestState.of(REPEATING, SamplingParams()),
                    4, StaticLength(4))  # n-gram match
    proposed = drafter._last.tokens
    assert proposed and drafter.choices.ngram == 1
    drafter.commit(RequestState.of(REPEATING + proposed[:2] + [3]), [1, 2])
    assert drafter._without_draft == [3, pytest.approx(FLAT[len(proposed)])]


def test_in_a_batch_the_draft_prefill_is_charged_to_the_step_that_starts_it():
    """Joined to a batch, a draft prefill holds up every request, and the worth of the
    later steps it would serve moves as requests come and go: it is not spread."""
    from adaspec.cost.batch import BatchLoad, Seat

    profile = two_context_profile([FLAT, FLAT], [[2.0, 3.0, 4.0], [2.0, 3.0, 4.0]])
    drafter = AutoDrafter(profile, draft=ScriptedDraft([confident(1)]))
    prompt = REPEATING[:6]
    drafter.begin(RequestState.of(prompt))
    context = prompt + [1] * 4
    whole = 1000 * len(context) / profile.draft_prefill_tokens_per_s
    assert drafter._catch_up_ms(context) == pytest.approx((0.0, whole / 4))
    drafter._remaining = 20
    drafter._seat = Seat(BatchLoad(cost=lambda t, s: 10.0 * t, sequences=3))
    assert drafter._catch_up_ms(context) == pytest.approx((whole, 0.0))


# ----------------------------------------------------------------- propose
def ngram_drafter(rows) -> AutoDrafter:
    drafter = AutoDrafter(two_context_profile(rows))
    drafter.begin(RequestState.of(REPEATING))
    return drafter


def test_the_plain_step_is_priced_at_the_context_length():
    # At context 0 a plain step would cost 1 ms (worth more than any n-gram at context 17);
    # at context 17 it costs 40.1 ms, and a verification of the n-gram's tokens barely more.
    drafter = ngram_drafter([[1.0] * 16, FLAT])
    p = auto_propose(drafter, REPEATING, max_tokens=3)
    assert drafted(p) == [9, 10, 11]
    assert drafter.choices.ngram == 1 and drafter.choices.plain == 0


def test_the_ngram_option_is_priced_at_the_context_length():
    # At context 0 every verified token costs a whole pass: no n-gram would pay there.
    drafter = ngram_drafter([STEEP, FLAT])
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=3)) == [9, 10, 11]
    drafter = ngram_drafter([FLAT, STEEP])
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=3)) == []
    assert drafter.choices.plain == 1


def test_an_ngram_costs_nothing_beyond_its_verification():
    # A plain step 10 ms, verifying one token 14.9 ms: at acceptance 0.5 the n-gram token is
    # worth 1.5 / 14.9 = 0.1007 tokens/ms, just over the plain step's 0.1. One ms more (to
    # look it up, or per token) would make it a loss.
    row = [10.0, 14.9, *[15.0 + n for n in range(14)]]
    drafter = ngram_drafter([row, row])
    drafter.ngram_rates = {m: RateEstimate(0.5) for m in (1, 2, 3, 4)}
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=1)) == [9]
    assert drafter.choices.ngram == 1
    # at acceptance 0.45: 1.45 / 14.9 < 0.1, a plain step
    drafter.ngram_rates = {m: RateEstimate(0.45) for m in (1, 2, 3, 4)}
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=1)) == []


# ------------------------------------------------------------------ drafts
# Target: a whole pass per token at context 0, nearly flat at context >= 10. Draft: 100 ms
# (200 for two tokens) at context 0, 1 ms (50 for two tokens) at context >= 10.
DRAFT_ROWS = [[100.0, 200.0], [1.0, 50.0]]


def draft_drafter(rows: list[torch.Tensor], target_rows=None) -> tuple[AutoDrafter,
                                                                         ScriptedDraft]:
    draft = ScriptedDraft(rows)
    profile = two_context_profile(target_rows or [STEEP, FLAT], DRAFT_ROWS)
    drafter = AutoDrafter(profile, draft=draft, use_ngram=False)
    drafter.begin(RequestState.of(REPEATING))
    return drafter, draft


def test_a_cheap_draft_drafts_to_the_limit_priced_at_the_context_length():
    # At context 17 a draft token costs 1 ms and a verified one 0.1 ms: with confidences of
    # 0.99 (estimated acceptance 0.891) every one of the 8 pays. Priced at context 0 (or a
    # draft forward read as a two-token one, 50 ms) drafting would stop after one token.
    drafter, draft = draft_drafter([confident(t) for t in range(1, 9)])
    p = auto_propose(drafter, REPEATING, max_tokens=8)
    assert drafted(p) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert p.forward_calls == 8 and draft.steps == 8
    assert drafter.choices.draft == 1
    assert drafter._last.buckets == [7] * 8


def test_a_draft_of_one_token_when_one_is_allowed():
    drafter, draft = draft_drafter([confident(5)])
    p = auto_propose(drafter, REPEATING, max_tokens=1)
    assert drafted(p) == [5] and draft.steps == 1
    assert drafter.choices.draft == 1


def test_the_draft_prior_follows_recent_requests_but_not_for_a_seeded_sample():
    """Requests the draft served badly lower the next request's prior, so a fresh request
    no longer starts the draft on the prior alone; a seeded sampled request keeps the fixed
    prior (its proposals must not depend on what the engine served before)."""
    from adaspec.draft.auto import DRAFT_PRIOR, Choice

    # a draft forward costs 15 ms, a verified token 0.1: a one-token draft pays when its
    # acceptance is above 15.1 / 40.1 = 0.38
    draft = ScriptedDraft([confident(5)])
    profile = two_context_profile([STEEP, FLAT], [[15.0, 30.0], [15.0, 30.0]])
    drafter = AutoDrafter(profile, draft=draft, use_ngram=False)
    drafter.begin(RequestState.of(REPEATING))
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=1)) == [5]  # the prior pays
    for _ in range(4):  # four requests whose draft steps were all rejected
        drafter.begin(RequestState.of(REPEATING))
        for _ in range(6):
            drafter._credit(Choice("draft", [5], len(REPEATING), buckets=[7]), 0)
    drafter.begin(RequestState.of(REPEATING))
    assert drafter.draft_learned.rate < 0.3 and drafter.draft_overall.rate == DRAFT_PRIOR
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=1)) == []  # plain now
    seeded = SamplingParams(temperature=1.0, seed=3)
    assert drafter._draft_rate(seeded) == DRAFT_PRIOR
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=1, params=seeded,
                                generator=torch.Generator().manual_seed(3))) != []


def low_tail_drafter(target_rows, low_rate: float):
    """Three confident draft tokens (acceptance 0.891 each), then an unconfident one whose
    bucket's acceptance is `low_rate`; the look-ahead guesses 0.9."""
    rows = [confident(1), confident(2), confident(3), torch.zeros(VOCAB)]
    drafter, draft = draft_drafter(rows, target_rows)
    drafter.draft_learned = RateEstimate(0.9)
    drafter.draft_rates[0] = RateEstimate(low_rate)
    return drafter, draft


def test_a_drafted_token_not_worth_verifying_is_dropped():
    # Verification 40 ms + 1 ms per token: the fourth token (worth 0.891^3 * 0.01 = 0.007
    # tokens) is drafted (the look-ahead guessed it at 0.9) but not worth its 1 ms.
    row = [40.0 + n for n in SIZES]
    drafter, draft = low_tail_drafter([row, row], 0.01)
    p = auto_propose(drafter, REPEATING, max_tokens=8)
    assert draft.steps == 4 and p.forward_calls == 4
    assert drafted(p) == [1, 2, 3]
    assert drafter._last.tokens == [1, 2, 3] and drafter._last.buckets == [7, 7, 7]


def test_the_verified_prefix_maximizes_expected_tokens_per_ms():
    # Draft forwards 4 ms; verification 41.5 ms for 3 tokens, 45.5 for 4. Acceptance 0.891
    # for the three confident tokens, 0.4 for the fourth: the expected tokens after the
    # prefixes of 3 and 4 tokens are 3.392 and 3.675; with the 16 ms of drafting spent
    # either way, 3.675 / 61.5 = 0.0598 beats 3.392 / 57.5 = 0.0590: all four are verified.
    # (Counting the plain step's token twice, values from 2.0, or the drafting as 4 / 4 ms,
    # would verify three.)
    row = [40.0, 40.5, 41.0, 41.5, 45.5, *[46.0 + n for n in range(11)]]
    rows = [confident(1), confident(2), confident(3), torch.zeros(VOCAB)]
    draft = ScriptedDraft(rows)
    drafter = AutoDrafter(two_context_profile([row, row], [[4.0, 8.0], [4.0, 8.0]]),
                          draft=draft, use_ngram=False)
    drafter.begin(RequestState.of(REPEATING))
    drafter.draft_learned = RateEstimate(0.9)
    drafter.draft_rates[0] = RateEstimate(0.4)
    p = auto_propose(drafter, REPEATING, max_tokens=4)
    assert draft.steps == 4
    assert drafted(p) == [1, 2, 3, 0]
    assert drafter._last.buckets == [7, 7, 7, 0]


def test_sampled_draft_tokens_come_from_the_request_generator():
    rows = [torch.zeros(VOCAB) for _ in range(6)]  # uniform: every token equally likely
    params = SamplingParams(temperature=1.0)
    drafter, draft = draft_drafter(rows)
    drafter.draft_rates = [RateEstimate(0.9) for _ in drafter.draft_rates]
    drafter.draft_learned = RateEstimate(0.9)
    torch.manual_seed(1234)  # the global generator is not the one to draw from
    p = auto_propose(drafter, REPEATING, max_tokens=6, params=params,
                generator=torch.Generator().manual_seed(7))
    reference = torch.Generator().manual_seed(7)
    expected = [sample(process_logits(rows[i], params), reference) for i in range(draft.steps)]
    assert drafted(p) == expected[:len(drafted(p))]
    assert len(drafted(p)) >= 4


# ------------------------------------------------------------ DISCO estimate
class FakeClassifier:
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def accept_probability(self, x):
        self.seen.append(x)
        return 0.75


class FakeDisco:
    def __init__(self) -> None:
        self.spec = object()
        self.classifier = FakeClassifier()


def test_disco_features_carry_the_draft_and_generation_positions(monkeypatch):
    import adaspec.control.disco_features as features

    calls = []

    def fake_assemble(dist, draft_position, generation_position, spec):
        calls.append((draft_position, generation_position))
        return torch.tensor([float(draft_position), float(generation_position)])

    monkeypatch.setattr(features, "assemble", fake_assemble)
    disco = FakeDisco()
    draft = ScriptedDraft([confident(t) for t in range(1, 5)])
    profile = two_context_profile([STEEP, FLAT], DRAFT_ROWS)
    drafter = AutoDrafter(profile, draft=draft, use_ngram=False, disco=disco)
    drafter.begin(RequestState.of(REPEATING[:10]))  # a 10-token prompt; 7 tokens generated since
    assert drafter._accept_estimate(confident(1), 7, 2, 17) == 0.75
    assert calls == [(2, 9)]
    calls.clear()
    p = auto_propose(drafter, REPEATING, max_tokens=4)
    n = draft.steps
    assert n >= 2 and len(drafted(p)) >= 1
    assert calls == [(i, 7 + i) for i in range(n)]


def test_a_plain_step_is_priced_as_one_fed_token():
    # A noisy measured curve: feeding one token takes 100 ms, two only 30. A one-token draft
    # (20 ms, estimated acceptance 0.6) is worth 1.6 / 50 = 0.032 tokens/ms, over the plain
    # step's 1 / 100 (had the plain step been priced as two fed tokens, 1 / 30, it would win).
    row = [100.0, 30.0, *[30.0 + 0.1 * n for n in range(1, 15)]]
    draft = ScriptedDraft([confident(4)])
    profile = two_context_profile([row, row], [[20.0, 40.0], [20.0, 40.0]])
    drafter = AutoDrafter(profile, draft=draft, use_ngram=False)
    drafter.begin(RequestState.of(REPEATING))
    assert drafted(auto_propose(drafter, REPEATING, max_tokens=1)) == [4]
    assert drafter.choices.draft == 1 and drafter.choices.plain == 0


def test_a_steps_prices_are_asked_once_and_not_kept_past_it():
    """One step asks the batch's cost for each call it prices once (the plain step, both
    free options and the draft's lengths read the same calls); the next step, in a round
    whose load changed, asks again."""
    from adaspec.cost.batch import BatchLoad, Seat

    asked: list[tuple[int, int]] = []

    def cost(tokens: int, sequences: int) -> float:
        asked.append((tokens, sequences))
        return 40.0 + 0.1 * tokens

    drafter = AutoDrafter(flat_profile(), draft=ScriptedDraft([confident(1)] * 8))
    drafter.begin(RequestState.of(REPEATING))
    seat = Seat(BatchLoad(cost=cost, sequences=3, budgets=[50, 60, 70]))
    auto_propose(drafter, REPEATING, max_tokens=6, seat=seat, remaining=50)
    calls = [a for a in asked if a[1] == 3]  # the round's calls (`token_ms` asks others)
    assert calls and len(calls) == len(set(calls))
    assert drafter._memo is None
    first = len(asked)
    seat.load.sequences = 5
    auto_propose(drafter, REPEATING, max_tokens=6, seat=seat, remaining=50)
    assert any(s == 5 for _, s in asked[first:])


# ------------------------------------------------------------- learned prices
def test_live_scale_learns_a_ratio_per_row_count_pulled_toward_the_pooled_one():
    from adaspec.cost.live import LIMIT, LiveScale

    live = LiveScale()
    assert live.scale(1) == live.scale(5) == 1.0  # nothing seen: the profile as it is
    for _ in range(40):
        live.observe(1, 40.0, 50.0)  # one row: 0.8 of its price
        live.observe(2, 78.0, 60.0)  # two rows: 1.3
    assert live.scale(1) == pytest.approx(0.8, rel=0.1)
    assert live.scale(2) == pytest.approx(1.3, rel=0.1)
    # a count never run is priced at the pooled ratio, between the two
    assert live.scale(1) < live.scale(3) < live.scale(2)
    stalled = LiveScale()
    stalled.observe(1, 1e6, 50.0)  # a stall of the host counts at most LIMIT
    assert stalled.scale(1) <= LIMIT
    live.observe(0, 10.0, 10.0)  # nothing learned from a call of no rows or no price
    live.observe(2, 10.0, 0.0)
    assert live.calls == pytest.approx(2 * 32.0)


def _run_ngram_steps(drafter: AutoDrafter, steps: int, seen_ms) -> AutoDrafter:
    """`steps` steps, each target call of n rows taking `seen_ms(n)` (the engine's call
    time, `RequestState.stats`): a draft's first token is accepted and the correction is a
    token never seen (so the next step has no n-gram to draft: a plain step, which emits a
    token of the cycle, and the n-gram matches again)."""
    cycle = REPEATING[:5]
    req = RequestState.of(REPEATING)
    drafter.begin(req)
    for i in range(steps):
        tokens = drafted(auto_propose_req(drafter, req))
        req.stats.target_time += seen_ms(1 + len(tokens)) / 1000
        if tokens:
            req.accept([tokens[0], 100 + i])
            drafter.commit(req, [1])
        else:
            req.accept([cycle[i % 5]])
            drafter.commit(req, [])
    return drafter


def auto_propose_req(drafter: AutoDrafter, req: RequestState, max_tokens: int = 8):
    return drafter.propose(req, max_tokens, StaticLength(max_tokens))


def test_auto_prices_its_steps_by_what_the_targets_calls_took_here():
    """The profile says a verified row costs almost nothing (40 ms + 0.1 a row); the calls
    here cost 40 ms a row. Learning from them, `auto` stops drafting n-grams; priced by the
    profile alone (the negative control), it keeps drafting at a loss."""
    def steep(rows: int) -> float:
        return 40.0 * rows

    learned = _run_ngram_steps(AutoDrafter(flat_profile(), learn_prices=True), 80, steep)
    fixed = _run_ngram_steps(AutoDrafter(flat_profile()), 80, steep)
    assert fixed.choices.ngram == 40 and fixed.choices.plain == 40  # every step it could
    assert learned.choices.ngram <= 20 and learned.choices.plain >= 60
    learned._memo, learned._live = {}, True
    prices = learned._prices(2, len(REPEATING))
    assert prices[1] / prices[0] > 1.5  # a row more: priced at what it took here
    # where the calls cost what the profile says, learning changes nothing
    same = _run_ngram_steps(AutoDrafter(flat_profile(), learn_prices=True), 80,
                            lambda rows: 40.0 + 0.1 * rows)
    assert same.choices.ngram == 40


def test_a_seeded_sampled_request_is_priced_by_the_profile_alone():
    drafter = _run_ngram_steps(AutoDrafter(flat_profile(), learn_prices=True), 40,
                               lambda rows: 40.0 * rows)
    ctx = len(REPEATING)
    seeded = RequestState.of(REPEATING, SamplingParams(temperature=1.0, seed=3),
                             torch.Generator().manual_seed(3))
    drafter.begin(seeded)
    drafter.propose(seeded, 8, StaticLength(8))
    assert not drafter._live and drafter._timed is None  # read nothing, learns nothing
    drafter._memo = {}
    assert drafter._prices(2, ctx)[1] == pytest.approx(40.2 + drafter.profile.overhead_ms)
    assert drafter.memory.call_scale.scale(2) > 1.5  # learned, not read for it
