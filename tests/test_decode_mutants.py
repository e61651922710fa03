"""Behaviour of the decode path that mutation testing (`make mutation`, docs/mutation.md)
found no test checking: each test here kills mutants that survived the rest of the suite,
by asserting what the code is for (defaults, messages users read, cache bookkeeping on
paths the engine rarely takes)."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.static import StaticLength
from adaspec.core.request import RequestState
from adaspec.core.sampling import SamplingParams
from adaspec.draft.model import ModelDrafter
from adaspec.errors import InputError
from tests.toy_models import greedy_next, toy_model

V = 64


@pytest.fixture(scope="module")
def toy():
    return toy_model(seed=0)


def assert_cache_is_prefill(backend: TorchBackend, model, tokens: list[int]) -> None:
    assert backend.cache_len == len(tokens)
    fresh = TorchBackend(model)
    fresh.prefill(torch.tensor(tokens))
    for got, want in zip(backend._layers(), fresh._layers(), strict=True):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------- control/static


def test_static_length_default_and_bad_values():
    assert StaticLength().max_tokens() == 4
    assert StaticLength(7).max_tokens() == 7
    for bad in (0, -2, 2.0, "3"):
        with pytest.raises(InputError, match=r"speculation length k must be an integer >= 1"):
            StaticLength(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- draft/model


def test_chain_draft_refeeds_the_last_token_when_the_whole_context_is_cached(toy):
    """The auto drafter can verify fewer tokens than it drafted; when the target's bonus
    token is the draft's next one, the draft cache already holds the whole new context.
    The draft must then drop the last cached token and feed it again (its logits give the
    first draft), cache and token list alike."""
    backend = TorchBackend(toy)
    drafter = ModelDrafter(backend)
    context = [4, 9, 33, 20, 2, 51]
    drafter.begin(RequestState.of(context))
    drafter.step(context[len(context) - 1:])  # now every context token is cached
    assert drafter.cached_len == len(context) == backend.cache_len
    proposal = drafter.propose(RequestState.of(context, SamplingParams()), 2, StaticLength(2))
    first = greedy_next(toy, context)
    assert proposal.tokens == [first, greedy_next(toy, [*context, first])]
    assert proposal.forward_calls == 2
    assert drafter.cached_len == len(context) + 1
    assert_cache_is_prefill(backend, toy, [*context, first])


# ------------------------------------------------------------------------- core/sampling


def test_sample_draws_from_the_vector():
    from adaspec.core.sampling import sample

    gen = torch.Generator().manual_seed(0)
    assert sample(torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]), gen) == 3
    draws = [sample(torch.tensor([0.0, 0.5, 0.0, 0.5]), gen) for _ in range(200)]
    assert set(draws) == {1, 3}


def test_tiny_temperature_shifts_each_row_by_its_own_maximum():
    """At a temperature so small that logit gaps / t overflow, each row is still one-hot on
    its own argmax: the shift before dividing is per row (a shared shift leaves a row whose
    maximum is below the other's all -inf, i.e. NaN)."""
    from adaspec.core.sampling import process_logits

    logits = torch.tensor([[1000.0, 0.0, -5.0], [0.0, 3.0, -2.0]])
    probs = process_logits(logits, SamplingParams(temperature=1e-36))  # 1000 / t overflows
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


# ----------------------------------------------------------------------------- core/text


class Chars:
    """One token per character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.mark.parametrize("text,stop,through", [
    ("Xbcdef", ["X"], 1),  # the stop string is the first token
    ("abXYcd", ["XY"], 4),  # completes in the middle of a step's tokens
    ("xabab" + "c", ["ab"], 3),  # a second occurrence later: the first one counts
    ("abcdef", ["zz", "cd"], 4),
])
def test_tokens_through_stop(text, stop, through):
    """A step can emit several tokens at once; the stop string's first occurrence may
    complete before the last of them: the output keeps exactly the tokens through it."""
    from adaspec.core.text import TextAssembler

    asm = TextAssembler(Chars(), stop)
    piece, hit = asm.push(ids(text), final=False)
    assert hit
    cut = min(text.find(s) for s in stop if s in text)
    assert piece == text[:cut]
    assert asm.tokens_through_stop(ids(text)) == through
    assert asm.final_text(ids(text)) == text[:cut]
    assert asm.push(ids(text), final=True) == ("", False)  # the same stop: no new hit


# -------------------------------------------------------------------------- engine/loop


def test_eos_ids_come_from_the_tokenizer(toy):
    from adaspec.engine.loop import Engine

    class Tok:
        eos_token_id = 5
        adaspec_eos_token_ids = [7, 9]

    class NoEos:
        eos_token_id = None
        adaspec_eos_token_ids = None

    class Bare:  # no eos_token_id, no extra ids, no chat template
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % V for c in text]

    target = TorchBackend(toy)
    assert Engine(target, Bare()).eos_token_ids == set()
    assert Engine(target, Bare()).encode_prompt("ab") == [97 % V, 98 % V]
    assert Engine(target, Tok()).eos_token_ids == {5, 7, 9}
    assert Engine(target, NoEos()).eos_token_ids == set()
    assert Engine(target, None).eos_token_ids == set()
    assert Engine(target, Tok(), eos_token_ids=[3]).eos_token_ids == {3}
    assert all(isinstance(t, int) for t in Engine(target, Tok()).eos_token_ids)


# ----------------------------------------------------------------------- core/token_tree


def _profile(draft_ms_by_context: tuple[float, float], target_ms: float = 10.0,
             long_target_ms: float | None = None):
    from adaspec.cost.profile import CostProfile, Curve

    sizes = [1, 64]
    far = target_ms if long_target_ms is None else long_target_ms
    target = Curve(sizes, [0, 1000], [[target_ms, target_ms], [far, far]])
    lo, hi = draft_ms_by_context
    draft = Curve(sizes, [0, 1000], [[lo, lo], [hi, hi]])
    return CostProfile(target=target, draft=draft, overhead_ms=0.5)


def test_tree_step_ms_prices_every_forward_at_the_context():
    from adaspec.draft.model_tree import tree_step_ms

    profile = _profile((1.0, 7.0), long_target_ms=30.0)
    # target pass + overhead + root's draft forward + one draft forward per inner level
    assert tree_step_ms((2, 2, 1), profile, 0) == pytest.approx(10 + 0.5 + 3 * 1.0)
    assert tree_step_ms((2, 2, 1), profile, 1000) == pytest.approx(30 + 0.5 + 3 * 7.0)
    assert tree_step_ms((), profile, 1000) == pytest.approx(30.5)


def test_choose_branching_reads_costs_at_the_context():
    """A draft that is cheap on short contexts and dear on long ones: deep shapes pay at
    the start, the smallest one later."""
    from adaspec.draft.model_tree import choose_branching

    profile = _profile((0.01, 500.0))
    assert len(choose_branching(profile, context=0)) > 1
    assert choose_branching(profile, context=1000) == (1,)


def test_choose_branching_breaks_ties_by_fewer_nodes_and_keeps_the_node_limit():
    from adaspec.core.token_tree import PricedBranching
    from adaspec.draft.model_tree import choose_branching

    flat = _profile((1.0, 1.0))
    # a sure first candidate: both shapes expect 3 tokens at the same (flat) price
    assert choose_branching(flat, (1.0,), [(2, 1), (1, 1)]) == (1, 1)
    assert choose_branching(flat, (1.0,), [(1, 1), (2, 1)]) == (1, 1)
    assert choose_branching(flat, (0.5,), [(2, 2)], max_nodes=6) == (2, 2)  # 6 nodes: fits
    with pytest.raises(InputError, match="no candidate tree fits"):
        choose_branching(flat, (0.5,), [(2, 2)], max_nodes=5)
    assert PricedBranching(2).candidates() == [(1,), (1, 1)]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "  "}],
    [{"role": "user"}],  # no content at all
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
])
def test_an_empty_chat_turn_is_refused(toy, messages):
    from adaspec.engine.loop import Engine

    class Tok:
        eos_token_id = 0
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            return [ord(c) % V for c in text]

    engine = Engine(TorchBackend(toy), Tok())
    with pytest.raises(InputError, match="a chat message is empty"):
        engine.encode_prompt(messages)
    assert engine.encode_prompt([{"role": "user", "content": "ab"}]) == [97 % V, 98 % V]


def test_top_p_one_keeps_every_token():
    """top_p = 1 truncates nothing, not even tokens whose probability is below float
    rounding of the mass before them (the support is what speculative sampling divides by)."""
    from adaspec.core.sampling import process_logits

    probs = process_logits(torch.tensor([0.0, -20.0, -20.0]), SamplingParams(1.0, top_p=1.0))
    assert bool((probs > 0).all())


def test_top_p_drops_a_token_whose_preceding_mass_reaches_p_exactly():
    from adaspec.core.sampling import process_logits

    logits = torch.tensor([0.5, 0.25, 0.25]).log()
    probs = process_logits(logits, SamplingParams(1.0, top_p=0.5))
    assert probs.tolist() == [1.0, 0.0, 0.0]
    probs = process_logits(logits, SamplingParams(1.0, top_p=0.75))
    assert probs[2] == 0 and probs[1] > 0


# ------------------------------------------------------------------ control/confidence


def test_confidence_controller_bounds_and_rule():
    from adaspec.control.confidence import HF_DEFAULT_THRESHOLD, ConfidenceLength

    default = ConfidenceLength()
    assert default.max_tokens() == 8 and default.threshold == HF_DEFAULT_THRESHOLD == 0.4
    assert ConfidenceLength(0.0, 1).max_tokens() == 1  # both ends of the ranges are valid
    assert ConfidenceLength(1.0).threshold == 1.0
    with pytest.raises(InputError, match=r"confidence threshold must be in \[0, 1\], got 1.5"):
        ConfidenceLength(1.5)
    with pytest.raises(InputError, match="confidence schedule needs k >= 1, got 0"):
        ConfidenceLength(0.4, 0)
    with pytest.raises(InputError) as err:
        default.keep_drafting(0, None)
    assert str(err.value) == "ctrl=confidence needs a drafter with a distribution (draft:...)"
    # top probability exactly at the threshold keeps drafting
    half = torch.tensor([0.0, 0.0]).log_softmax(-1)  # top probability 0.5
    assert ConfidenceLength(0.5).keep_drafting(0, half)
    assert not ConfidenceLength(0.51).keep_drafting(0, half)


# ----------------------------------------------------------------------- control/disco


def test_disco_from_file_passes_every_setting(tmp_path, monkeypatch):
    import adaspec.control.builtin as builtin
    from adaspec.control.disco import DiscoLength
    from tests.cost_helpers import steep
    from tests.disco_helpers import artifact, constant_classifier

    path = tmp_path / "disco.json"
    artifact(constant_classifier(0.9)).save(path)
    profile = steep()
    ctrl = DiscoLength.from_file(str(path), 0.3, 5, "cost", profile, "mean")
    assert (ctrl.tau, ctrl.sl_max, ctrl.stop, ctrl.guess) == (0.3, 5, "cost", "mean")
    assert ctrl.profile is profile
    assert DiscoLength.from_file("").builtin  # no path: the shipped classifier
    monkeypatch.setattr(builtin, "DISCO_BUILTIN", tmp_path / "not-shipped.pt")
    with pytest.raises(InputError) as err:  # an install without it: how to make one
        DiscoLength.from_file("")
    assert str(err.value) == (
        "ctrl=disco needs disco=PATH, an artifact that `adaspec disco collect`, `disco train` "
        "and `disco tune` build (docs/disco.md)")


def test_disco_cost_rule_reads_the_tuned_cap_and_guess():
    from adaspec.control.disco import COST_SL_MAX, DiscoLength, tuned_cost_rule
    from tests.cost_helpers import steep
    from tests.disco_helpers import artifact, constant_classifier

    art = artifact(constant_classifier(0.9), sl_max=6)
    assert tuned_cost_rule(art) == {}
    assert DiscoLength(art, stop="cost", profile=steep()).sl_max == COST_SL_MAX == 8
    art.tuning = {"best": {"disco-cost": {"sl_max": 3, "guess": "mean"}}}
    assert tuned_cost_rule(art) == {"sl_max": 3, "guess": "mean"}
    ctrl = DiscoLength(art, stop="cost", profile=steep())
    assert (ctrl.sl_max, ctrl.guess) == (3, "mean")
    assert DiscoLength(art).sl_max == 6  # stop=tau: the artifact's own SL_max
    art.tuning = {"best": None}
    assert tuned_cost_rule(art) == {}


# --------------------------------------------------------------------- control/heuristic


def test_heuristic_controller_defaults_and_bounds():
    from adaspec.control.heuristic import HeuristicLength

    ctrl = HeuristicLength()
    assert (ctrl.max_tokens(), ctrl.k_max) == (4, 16)
    assert HeuristicLength(3, 3).max_tokens() == 3  # k == k_max is allowed
    with pytest.raises(InputError, match=r"heuristic schedule needs 1 <= k <= k_max, got k=5"):
        HeuristicLength(5, 4)


# ---------------------------------------------------------------------- lab/bench/oracle


def test_oracle_run_stops_at_the_end_of_the_reference():
    from adaspec.lab.bench.oracle import OracleLength

    assert OracleLength().k_max == 64
    o = OracleLength(k_max=10)
    with pytest.raises(InputError) as err:
        o.begin()
    assert str(err.value) == (
        "ctrl=oracle needs the target's reference output, which only the bench has "
        "(adaspec bench / adaspec disco bench run it after `ar`)")
    o.set_hits([True, True, True, True])  # every reference token after the first hits
    o.begin()
    assert o.max_tokens() == 3  # tokens 1..3: the reference ends there
    o.update(3, 3)
    assert o.max_tokens() == 0


def test_oracle_k_max_bounds():
    from adaspec.lab.bench.oracle import OracleLength

    assert OracleLength(1).k_max == 1
    with pytest.raises(InputError, match="oracle needs k_max >= 1, got 0"):
        OracleLength(0)


# ------------------------------------------------------------ draft/model_tree (tree=priced)


def _context_profile(short_draft_ms: float, long_draft_ms: float, long: int = 8):
    """A flat target; a draft whose forwards cost `short_draft_ms` at context 0 and
    `long_draft_ms` from `long` tokens on."""
    from adaspec.cost.profile import CostProfile, Curve

    target = Curve([1, 64], [0, long], [[10.0, 10.0], [10.0, 10.0]])
    draft = Curve([1, 64], [0, long],
                  [[short_draft_ms, short_draft_ms], [long_draft_ms, long_draft_ms]])
    return CostProfile(target=target, draft=draft)


def test_priced_tree_shape_is_bounded_by_the_step_and_priced_at_the_context(toy):
    from adaspec.draft.model_tree import PricedTreeDrafter

    drafter = PricedTreeDrafter(TorchBackend(toy), _context_profile(0.01, 500.0))
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # past the profile's long context: drafts are dear
    drafter.begin(RequestState.of(ctx))
    proposal = drafter.propose(RequestState.of(ctx, SamplingParams()), 4, StaticLength(4))
    assert drafter.branching == (1,) and proposal.depth == 1
    drafter.commit(RequestState.of([*ctx, 0]), [])
    cheap = PricedTreeDrafter(TorchBackend(toy), _context_profile(0.01, 0.01))
    cheap.begin(RequestState.of(ctx))
    for limit in (2, 3):  # cheap drafts: as deep as the step allows, wide first levels
        proposal = cheap.propose(RequestState.of(ctx, SamplingParams()), limit, StaticLength(limit))
        assert proposal.depth == limit == len(cheap.branching)
        assert len(proposal.tree) - 1 > len(ctx)  # more nodes than context tokens
        cheap.commit(RequestState.of([*ctx, 0]), [])
    assert sum(cheap.shapes.values()) == 2 and all(n == 1 for n in cheap.shapes.values())
    cheap.propose(RequestState.of(ctx, SamplingParams()), 3, StaticLength(3))
    assert cheap.shapes[cheap.branching] == 2


def test_priced_tree_draws_siblings_as_asked(toy):
    from adaspec.draft.model_tree import PricedTreeDrafter

    drafter = PricedTreeDrafter(TorchBackend(toy), _context_profile(0.01, 0.01))
    ctx = [3, 1, 4, 1, 5]
    params = SamplingParams(1.0)
    gen = torch.Generator().manual_seed(0)
    drafter.begin(RequestState.of(ctx))
    assert drafter.propose(RequestState.of(ctx, params, gen),
                           2, StaticLength(2)).replacement is False
    drafter.commit(RequestState.of([*ctx, 0]),
                   [])
    assert drafter.propose(RequestState.of(ctx, params, gen, True),
                           2, StaticLength(2)).replacement is True


def test_priced_tree_learns_per_rank_with_a_short_prior(toy):
    """Ranks past the prior's last entry share its estimate."""
    from adaspec.draft.model_tree import PricedTreeDrafter

    drafter = PricedTreeDrafter(TorchBackend(toy), _context_profile(0.01, 0.01),
                              prior=(0.6, 0.3))
    drafter.candidates = [(4, 1)]
    ctx = [3, 1, 4, 1, 5]
    drafter.begin(RequestState.of(ctx))
    proposal = drafter.propose(RequestState.of(ctx, SamplingParams()), 2, StaticLength(2))
    assert drafter.branching == (4, 1) and len(proposal.tree) == 9
    drafter.commit(RequestState.of([*ctx, 63]), [])  # all four candidates missed
    first, rest = drafter.rank_rates
    assert (first.trials, first.successes) == (1, 0)
    assert (rest.trials, rest.successes) == (3, 0)


def test_priced_tree_counts_each_level_it_reached(toy):
    """Path [2, 5] through a 2x2x1 tree: level 1 hit at rank 2 (rank 1 missed), level 2 hit
    at rank 1, level 3 missed (its one candidate)."""
    from adaspec.draft.model_tree import PricedTreeDrafter

    drafter = PricedTreeDrafter(TorchBackend(toy), _context_profile(0.01, 0.01))
    assert drafter.branching == drafter.candidates[0] == (1,)
    assert drafter.shapes == {}
    drafter.candidates = [(2, 2, 1)]
    ctx = [9, 8, 7, 6]
    drafter.begin(RequestState.of(ctx))
    proposal = drafter.propose(RequestState.of(ctx, SamplingParams()), 3, StaticLength(3))
    tree = proposal.tree
    assert tree.children[0] == [1, 2] and tree.children[2] == [5, 6]
    drafter.commit(RequestState.of([*ctx, tree.tokens[2], tree.tokens[5], 0]), [2, 5])
    counts = [(r.trials, r.successes) for r in drafter.rank_rates[:3]]
    assert counts == [(3, 1), (1, 1), (0, 0)]


def test_priced_tree_needs_a_draft_cost(toy):
    from adaspec.cost.profile import CostProfile, Curve
    from adaspec.draft.model_tree import PricedTreeDrafter

    no_draft = CostProfile(target=Curve([1], [0], [[1.0]]))
    with pytest.raises(InputError) as err:
        PricedTreeDrafter(TorchBackend(toy), no_draft)
    assert str(err.value) == ("tree=priced prices draft forwards: it needs a cost profile that "
                              "measured the draft (adaspec profile, with a draft model)")


def test_disco_settings_bounds_and_messages():
    from adaspec.control.disco import DiscoLength
    from tests.disco_helpers import artifact, constant_classifier

    art = artifact(constant_classifier(0.9))
    assert DiscoLength(art, tau=0.0).tau == 0.0 and DiscoLength(art, tau=1.0).tau == 1.0
    with pytest.raises(InputError) as err:
        DiscoLength(art, stop="never")
    assert str(err.value) == "DISCO stop rule 'never': use one of tau, cost"


def test_disco_cost_rule_guesses_the_requests_mean():
    """stop=cost, guess=mean: each decision is the shared cost rule's, with the mean of
    this request's probabilities as the guess; a new request starts a new mean."""
    from adaspec.control.disco import DiscoLength
    from adaspec.cost.rule import cost_keeps_drafting
    from tests.cost_helpers import steep
    from tests.disco_helpers import artifact, constant_classifier

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for p in (0.35, 0.5, 0.62, 0.8, 0.92):  # 0.92: the first guess decides the first stop
        ctrl = DiscoLength(artifact(constant_classifier(p)), stop="cost", profile=steep(),
                           guess="mean", sl_max=6)
        for _request in range(2):
            ctrl.begin()
            ctrl.max_tokens()
            seen: list[float] = []
            for pos in range(4):
                got = ctrl.keep_drafting(pos, logits)
                q = ctrl.last_probability
                seen.append(q)
                want = cost_keeps_drafting(seen, sum(seen) / len(seen), ctrl.step_ms, 6)
                assert got == want, (p, pos)
                if not got:
                    break


def test_disco_rejects_bad_settings_with_the_fix():
    from adaspec.control.disco import DiscoLength
    from tests.cost_helpers import steep
    from tests.disco_helpers import artifact, constant_classifier

    art = artifact(constant_classifier(0.9))
    with pytest.raises(InputError) as err:
        DiscoLength(art, tau=1.5)
    assert str(err.value) == "DISCO threshold tau must be in [0, 1], got 1.5"
    with pytest.raises(InputError) as err:
        DiscoLength(art, sl_max=0)
    assert str(err.value) == "DISCO sl_max must be >= 1, got 0"
    assert DiscoLength(art, sl_max=1).max_tokens() == 1
    with pytest.raises(InputError) as err:
        DiscoLength(art, stop="cost", profile=steep(), guess="median")
    assert str(err.value) == "DISCO guess 'median': use one of last, mean"


def test_disco_tau_rule_ignores_the_cost_rules_tuning():
    from adaspec.control.disco import DiscoLength
    from tests.disco_helpers import artifact, constant_classifier

    art = artifact(constant_classifier(0.9), sl_max=6)
    art.tuning = {"best": {"disco-cost": {"sl_max": 3, "guess": "mean"}}}
    ctrl = DiscoLength(art)
    assert (ctrl.sl_max, ctrl.guess, ctrl.step_ms) == (6, "last", [])


def test_disco_cost_rule_prices_each_length_and_needs_a_draft_profile():
    from adaspec.control.disco import DiscoLength
    from adaspec.cost.profile import CostProfile, Curve
    from tests.cost_helpers import steep
    from tests.disco_helpers import artifact, constant_classifier

    art = artifact(constant_classifier(0.9))
    profile = steep()  # target 34 + 10 (n - 1) ms, draft 15 ms a token
    ctrl = DiscoLength(art, stop="cost", profile=profile, sl_max=3)
    assert ctrl.last_probability is None
    # n drafted tokens: n draft forwards + a verification of n + 1 tokens
    assert ctrl.step_ms == pytest.approx([34 + 10 * n + 15 * n for n in range(4)])
    with pytest.raises(InputError) as err:
        DiscoLength(art, stop="cost")
    assert str(err.value) == ("DISCO's stop=cost prices each step with a cost profile: "
                              "give profile=FILE|flat, or build it with build_generator")
    with pytest.raises(InputError) as err:
        DiscoLength(art, stop="cost", profile=CostProfile(target=Curve([1], [0], [[1.0]])))
    assert str(err.value) == ("DISCO's stop=cost needs a cost profile that measured the "
                              "draft (adaspec profile, with a draft model)")


# ------------------------------------------------------------------------------ draft/auto


class CountingBackend(TorchBackend):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.prefills = 0

    def prefill(self, tokens, hidden_layer=None, reuse=0):
        self.prefills += 1
        return super().prefill(tokens, hidden_layer, reuse)


def _cheap_draft_profile():
    from adaspec.cost.profile import CostProfile, Curve

    sizes = list(range(1, 17))
    return CostProfile(target=Curve(sizes, [0], [[40.0 + 0.1 * n for n in sizes]]),
                       draft=Curve([1, 2, 4], [0], [[2.0, 2.0, 2.0]]),
                       draft_prefill_tokens_per_s=1e5)


def test_auto_draft_samples_from_the_draft_and_starts_it_once(toy):
    """auto drafting with the model at temperature 1: each token is drawn from the
    processed draft distribution after its prefix (the rows it hands the verifier), one
    forward per token, at most the step's limit; the draft prefills once per request and
    its confidence buckets learn from the verified outcome."""
    from adaspec.draft.auto import AutoDrafter

    backend = CountingBackend(toy)
    drafter = AutoDrafter(_cheap_draft_profile(), ModelDrafter(backend), use_ngram=False)
    ctx = [5, 17, 42, 8, 33]
    params = SamplingParams(1.0)
    drafter.begin(RequestState.of(ctx))
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        proposal = drafter.propose(RequestState.of(ctx, params, gen), 4, StaticLength(4))
        tokens = proposal.tokens
        assert 1 <= len(tokens) <= 4 and drafter.choices.draft == 2 * step + 1
        assert proposal.forward_calls == len(tokens)
        assert proposal.probs is not None and proposal.probs.shape == (len(tokens), V)
        for i, tok in enumerate(tokens):
            with torch.no_grad():
                logits = toy(torch.tensor([ctx + tokens[:i]])).logits[0, -1]
            want = torch.softmax(logits.float(), -1)
            torch.testing.assert_close(proposal.probs[i], want, rtol=1e-4, atol=1e-6)
            assert want[tok] > 0
        # same seed, same draws, after rolling the draft back (the verdict of none
        # accepted may shorten the draft)
        drafter.commit(RequestState.of(ctx), [])
        same = drafter.propose(RequestState.of(ctx, params, torch.Generator().manual_seed(step)),
                               4, StaticLength(4))
        assert same.tokens and same.tokens == tokens[: len(same.tokens)]
        tokens = same.tokens
        before = [(r.trials, r.successes) for r in drafter.draft_rates]
        drafter.commit(RequestState.of([*ctx, tokens[0], 0]), [1])  # the first token accepted
        trials = [r.trials - b for r, (b, _) in zip(drafter.draft_rates, before, strict=True)]
        hits = [r.successes - h for r, (_, h) in zip(drafter.draft_rates, before, strict=True)]
        assert sum(trials) == min(2, len(tokens)) and sum(hits) == 1
        ctx = [*ctx, tokens[0], 0]
    assert backend.prefills == 1


def test_tree_children_draws_are_reproducible_from_the_generator():
    from adaspec.draft.model_tree import draw_children

    probs = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(0)), -1)
    for replacement in (True, False):
        a = draw_children(probs, 4, torch.Generator().manual_seed(5), replacement)
        b = draw_children(probs, 4, torch.Generator().manual_seed(5), replacement)
        c = draw_children(probs, 4, torch.Generator().manual_seed(6), replacement)
        assert a == b != c


@pytest.mark.parametrize("replacement", [True, False])
def test_tree_children_never_take_a_zero_probability_token_at_the_edges(monkeypatch,
                                                                        replacement):
    """The inverse-CDF draws at their extreme uniforms (0, and 1 as rounding can make
    u * total): never a token without mass, on either side of the support."""
    from adaspec.draft import model_tree

    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]])
    real_rand = torch.rand
    for edge in (0.0, 1.0):
        def rand(*shape, generator=None, dtype=None, _edge=edge, **kw):
            return torch.full(shape, _edge, dtype=dtype or torch.float32)

        monkeypatch.setattr(model_tree.torch, "rand", rand)
        kids = model_tree.draw_children(probs, 2, None, replacement)[0]
        monkeypatch.setattr(model_tree.torch, "rand", real_rand)
        assert kids and all(probs[0, k] > 0 for k in kids), (edge, kids)


def test_sample_rows_never_take_a_zero_probability_token_at_the_edges(monkeypatch):
    from adaspec.core import sampling

    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]])
    real_rand = torch.rand
    for edge in (0.0, 1.0):
        def rand(*shape, generator=None, dtype=None, device=None, _edge=edge, **kw):
            return torch.full(shape, _edge, dtype=dtype or torch.float32)

        monkeypatch.setattr(sampling.torch, "rand", rand)
        got = sampling.sample_rows(probs, None).tolist()
        monkeypatch.setattr(sampling.torch, "rand", real_rand)
        assert got == ([1, 3] if edge == 0.0 else [2, 3]), edge


def test_chat_turns_go_through_the_chat_template(toy):
    from adaspec.engine.loop import Engine

    class Encoding(dict):
        pass

    class ChatTok:
        eos_token_id = 0
        chat_template = "{{ messages }}"

        def __init__(self, as_encoding: bool) -> None:
            self.calls: list[tuple] = []
            self.as_encoding = as_encoding

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
            self.calls.append((messages, add_generation_prompt, tokenize))
            ids = [1, 2, len(messages)]
            return Encoding(input_ids=ids) if self.as_encoding else ids

        def encode(self, text, add_special_tokens=False):
            return [ord(c) % V for c in text]

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ab"}]
    for as_encoding in (False, True):
        tok = ChatTok(as_encoding)
        engine = Engine(TorchBackend(toy), tok)
        assert engine.encode_prompt(messages) == [1, 2, 3]
        assert tok.calls == [(messages, True, True)]
        assert engine.encode_prompt("ab") == [1, 2, 1]  # a text prompt is one user turn
    # chat=False: the turns' text, one per line, without the template
    assert engine.encode_prompt(messages, chat=False) == [ord(c) % V for c in "hi\nyo\nab"]
    with pytest.raises(InputError) as err:
        Engine(TorchBackend(toy), None).encode_prompt(messages)
    assert str(err.value) == "this engine has no tokenizer: pass the prompt as token ids"
    with pytest.raises(InputError) as err:
        engine.encode_prompt([{"role": "user", "content": " "}])
    assert str(err.value) == "a chat message is empty: every turn needs some text"


def test_auto_credits_ngram_steps_to_their_match_length():
    from adaspec.draft.auto import AutoDrafter

    cheap = _cheap_draft_profile()
    drafter = AutoDrafter(cheap, None, use_ngram=True)
    ctx = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]
    drafter.begin(RequestState.of(ctx))
    proposal = drafter.propose(RequestState.of(ctx, SamplingParams()), 4, StaticLength(4))
    assert drafter.choices.ngram == 1 and proposal.tokens == [9, 10, 11, 7][: proposal.depth]
    match = drafter._last.match
    before = {m: (r.trials, r.successes) for m, r in drafter.ngram_rates.items()}
    drafter.commit(RequestState.of([*ctx, proposal.tokens[0], 5]),
                   [1])  # one accepted, then a correction
    after = {m: (r.trials, r.successes) for m, r in drafter.ngram_rates.items()}
    key = min(match, 4)
    assert after[key] == (before[key][0] + min(2, proposal.depth), before[key][1] + 1)
    assert all(after[m] == before[m] for m in after if m != key)


# ------------------------------------------------------------------- verify/speculative


def test_speculative_sample_checks_shapes_and_ids():
    from adaspec.verify.speculative import speculative_sample

    tokens = torch.tensor([[1, 2]])
    p = torch.full((1, 3, 4), 0.25)
    q = torch.full((1, 2, 4), 0.25)
    with pytest.raises(InputError) as err:
        speculative_sample(tokens, q, p[0], None)
    assert str(err.value) == "target_probs must be [B, k + 1, V] = [1, 3, V], got [3, 4]"
    with pytest.raises(InputError) as err:
        speculative_sample(tokens, q, p[:, :2], None)
    assert str(err.value) == "target_probs must be [B, k + 1, V] = [1, 3, V], got [1, 2, 4]"
    with pytest.raises(InputError) as err:
        speculative_sample(tokens, q[:, :1], p, None)
    assert str(err.value) == "draft_probs must be [B, k, V] = [1, 2, V] or None, got [1, 1, 4]"
    with pytest.raises(InputError) as err:
        speculative_sample(tokens, q[0], p, None)
    assert str(err.value) == "draft_probs must be [B, k, V] = [1, 2, V] or None, got [2, 4]"
    with pytest.raises(InputError, match=r"draft token ids must be in \[0, 4\), got \[\[1, 4\]\]"):
        speculative_sample(torch.tensor([[1, 4]]), q, p, None)
    accepted, nxt = speculative_sample(tokens.int(), q, p, torch.Generator().manual_seed(0))
    assert accepted.dtype == nxt.dtype == torch.long
    accepted, nxt = speculative_sample(torch.zeros(1, 0, dtype=torch.long), None, p[:, :1], None)
    assert accepted.tolist() == [0] and accepted.dtype == nxt.dtype == torch.long


def test_speculative_sample_pads_a_vocabulary_one_short():
    from adaspec.verify.speculative import speculative_sample

    p = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]])  # target V = 4
    q = torch.tensor([[[1.0, 0.0, 0.0]]])  # draft V = 3, drafted token 0
    accepted, nxt = speculative_sample(torch.tensor([[0]]), q, p, torch.Generator())
    assert accepted.tolist() == [0] and nxt.tolist() == [3]


def test_a_token_the_target_forbids_is_rejected_even_at_u_zero(monkeypatch):
    from adaspec.verify import speculative

    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    monkeypatch.setattr(speculative.torch, "rand",
                        lambda *shape, generator=None, dtype=None, device=None: torch.zeros(
                            shape, dtype=dtype))
    for q in (None, torch.tensor([[[1.0, 0.0]]])):
        accepted, _ = speculative.speculative_sample(torch.tensor([[0]]), q, p, None)
        assert accepted.tolist() == [0]


def test_auto_prices_the_draft_catch_up(toy):
    """Before the draft model has started, a step that would use it pays its prompt
    prefill spread over as many tokens as were produced, within the budget left (at the
    profile's prefill rate, else 1000 tokens per s); after, the first forward's extra
    tokens (those accepted since its last step), at the context length."""
    from adaspec.cost.profile import CostProfile, Curve
    from adaspec.draft.auto import AutoDrafter

    draft_curve = Curve([1, 8], [0, 20], [[1.0, 8.0], [3.0, 24.0]])  # 1 ms a token, x3 at 20
    profile = CostProfile(target=Curve([1, 16], [0], [[10.0, 10.5]]), draft=draft_curve,
                          draft_prefill_tokens_per_s=2000.0)
    ctx = list(range(1, 21))
    drafter = AutoDrafter(profile, ModelDrafter(TorchBackend(toy)), use_ngram=False)
    drafter.begin(RequestState.of(ctx[:12]))  # 8 tokens produced: spread over 8 tokens to come
    assert drafter._catch_up_ms(ctx) == pytest.approx((0.0, 1000 * 20 / 2000.0 / 8))
    drafter._remaining = 3  # three tokens left
    assert drafter._catch_up_ms(ctx) == pytest.approx((0.0, 1000 * 20 / 2000.0 / 3))
    drafter._remaining = 0
    default_rate = AutoDrafter(CostProfile(target=profile.target, draft=draft_curve),
                               ModelDrafter(TorchBackend(toy)), use_ngram=False)
    default_rate.begin(RequestState.of(ctx[:12]))
    assert default_rate._catch_up_ms(ctx) == pytest.approx((0.0, 1000 * 20 / 1000.0 / 8))
    drafter.propose(RequestState.of(ctx, SamplingParams()), 2, StaticLength(2))  # starts the draft
    drafter.commit(RequestState.of(ctx), [])
    cached = drafter.model.cached_len
    longer = ctx + [3, 4, 5]  # three tokens beyond what the draft holds
    pending = len(longer) - cached
    assert pending >= 2
    assert drafter._catch_up_ms(longer) == pytest.approx((3.0 * pending - 3.0, 0.0))


def test_auto_plain_step_when_nothing_pays_or_nothing_may_be_drafted(toy):
    from adaspec.cost.profile import CostProfile, Curve
    from adaspec.draft.auto import AutoDrafter

    sizes = list(range(1, 17))
    steep = CostProfile(target=Curve(sizes, [0], [[40.0 * n for n in sizes]]),
                        draft=Curve([1], [0], [[40.0]]), draft_prefill_tokens_per_s=1e5)
    ctx = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]
    drafter = AutoDrafter(steep, ModelDrafter(TorchBackend(toy)))
    drafter.begin(RequestState.of(ctx))
    proposal = drafter.propose(RequestState.of(ctx, SamplingParams()), 4, StaticLength(4))
    assert proposal.depth == 0 and drafter.choices.plain == 1
    assert drafter.choices.ngram == drafter.choices.draft == 0
    cheap = AutoDrafter(_cheap_draft_profile(), ModelDrafter(TorchBackend(toy)))
    cheap.begin(RequestState.of(ctx))
    assert cheap.propose(RequestState.of(ctx, SamplingParams()), 0, StaticLength(1)).depth == 0
    assert cheap.choices.plain == 1
    assert cheap.propose(RequestState.of(ctx, SamplingParams()), 4, StaticLength(4)).depth > 0


@pytest.mark.parametrize("dear", ["verification", "draft"])
def test_auto_prices_at_the_context_length(toy, dear):
    """Costs that depend on the context: cheap on short contexts, dear past 20 tokens (the
    target's verification or the draft's forwards). auto drafts on a short context and
    decodes plainly on a long one: every price is read at the context's length."""
    from adaspec.cost.profile import CostProfile, Curve
    from adaspec.draft.auto import AutoDrafter

    sizes, contexts = [1, 16], [0, 10, 20]  # cheap up to 10 tokens of context, dear from 20
    cheap_target, dear_target = [40.0, 41.5], [40.0, 40.0 + 40.0 * 15]
    cheap_draft, dear_draft = [2.0, 2.0 * 16], [400.0, 400.0 * 16]
    last_target = dear_target if dear == "verification" else cheap_target
    last_draft = dear_draft if dear == "draft" else cheap_draft
    target = Curve(sizes, contexts, [cheap_target, cheap_target, last_target])
    draft = Curve(sizes, contexts, [cheap_draft, cheap_draft, last_draft])
    profile = CostProfile(target=target, draft=draft, draft_prefill_tokens_per_s=1e6)
    short, long = [3, 1, 4, 1, 5], list(range(1, 31))
    for ctx, drafts in ((short, True), (long, False)):
        drafter = AutoDrafter(profile, ModelDrafter(TorchBackend(toy)), use_ngram=False)
        drafter.begin(RequestState.of(ctx))
        proposal = drafter.propose(RequestState.of(ctx, SamplingParams()), 4, StaticLength(4))
        assert (proposal.depth > 0) == drafts, (dear, len(ctx))
        assert drafter.choices.draft == int(drafts) and drafter.choices.plain == int(not drafts)


def test_auto_bucket_priors_and_defaults():
    from adaspec.draft.auto import CONFIDENCE_EDGES, AutoDrafter, _bucket_of, _bucket_prior

    assert _bucket_prior(0) == pytest.approx(0.9 * 0.3 / 2)
    assert _bucket_prior(1) == pytest.approx(0.9 * (0.3 + 0.5) / 2)
    assert _bucket_prior(len(CONFIDENCE_EDGES)) == pytest.approx(0.9 * (0.98 + 1.0) / 2)
    assert [_bucket_of(c) for c in (0.0, 0.3, 0.49, 0.5, 0.98, 1.0)] == [0, 1, 1, 2, 7, 7]
    drafter = AutoDrafter(_cheap_draft_profile())
    assert drafter.k_max == 16 and drafter.ngram is not None
    assert (drafter.ngram.n_max, drafter.ngram.n_min) == (4, 1)
    assert AutoDrafter(_cheap_draft_profile(), n_max=3, n_min=2).ngram.n_min == 2


def test_text_leaves_special_tokens_out():
    from adaspec.core.text import TextAssembler

    class WithSpecials:
        def decode(self, ids, skip_special_tokens=False):
            return "".join("<eos>" if i == 0 and not skip_special_tokens else
                           "" if i == 0 else chr(i) for i in ids)

    asm = TextAssembler(WithSpecials(), [])
    assert asm.push([104, 0, 105], final=True) == ("hi", False)
    assert asm.final_text([104, 0, 105]) == "hi"


def test_auto_bookkeeping_across_steps(toy):
    from adaspec.cost.profile import CostProfile
    from adaspec.draft.auto import AutoDrafter, AutoStats

    with pytest.raises(InputError) as err:
        AutoDrafter(CostProfile(target=_cheap_draft_profile().target),
                    ModelDrafter(TorchBackend(toy)))
    assert str(err.value) == ("method auto with a draft model needs a cost profile that "
                              "measured the draft (adaspec profile --draft ...)")
    ngram_only = AutoDrafter(_cheap_draft_profile(), None)
    assert ngram_only.choices == AutoStats()
    ctx = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]
    ngram_only.begin(RequestState.of(ctx))
    one = ngram_only.propose(RequestState.of(ctx, SamplingParams()), 1, StaticLength(1))
    assert one.tokens == [9] and ngram_only.choices.ngram == 1  # a one-token step pays too
    ngram_only.commit(RequestState.of([*ctx, 9, 10]), [1])
    ngram_only.propose(RequestState.of([*ctx, 9, 10], SamplingParams()), 4, StaticLength(4))
    assert ngram_only.choices.ngram == 2
    # the draft model's cache follows every verdict, not only the next proposal
    drafter = AutoDrafter(_cheap_draft_profile(), ModelDrafter(TorchBackend(toy)),
                          use_ngram=False)
    short = [3, 1, 4, 1, 5]
    drafter.begin(RequestState.of(short))
    proposal = drafter.propose(RequestState.of(short, SamplingParams()), 4, StaticLength(4))
    assert proposal.depth >= 2
    drafter.commit(RequestState.of([*short, 0]), [])
    assert drafter.model.cached_len == len(short)


def test_auto_best_length_is_geometric():
    """Expected tokens of n drafts at per-token acceptance r: 1 + r + r^2 + ... + r^n."""
    from adaspec.cost.profile import CostProfile, Curve
    from adaspec.draft.auto import AutoDrafter

    sizes = list(range(1, 17))
    profile = CostProfile(target=Curve(sizes, [0], [[40.0 + 10.0 * (n - 1) for n in sizes]]),
                          draft=Curve([1], [0], [[1.0]]))
    drafter = AutoDrafter(profile, None)
    n, value = drafter._best_length(0.5, 4, 0.0, 0.0, 0)
    assert n == 1 and value == pytest.approx(1.5 / 50.0)
    n, value = drafter._best_length(0.9, 4, 0.0, 0.0, 0)
    want = max(range(5), key=lambda k: sum(0.9 ** i for i in range(k + 1)) / (40 + 10 * k))
    assert n == want


def test_auto_with_long_ngrams_prices_them_as_length_four():
    """Matches longer than 4 tokens (n_max > 4) share the estimate of length 4."""
    from adaspec.draft.auto import AutoDrafter

    drafter = AutoDrafter(_cheap_draft_profile(), None, n_max=6)
    ctx = [7, 8, 9, 10, 11, 12, 13] * 3 + [7, 8, 9, 10, 11, 12]
    drafter.begin(RequestState.of(ctx))
    proposal = drafter.propose(RequestState.of(ctx, SamplingParams()), 4, StaticLength(4))
    assert proposal.tokens[:1] == [13] and drafter._last.match >= 5
    before = drafter.ngram_rates[4].trials
    drafter.commit(RequestState.of([*ctx, 13, 7]), [1])
    assert drafter.ngram_rates[4].trials > before


def test_bad_tree_config_names_the_format():
    from adaspec.core.token_tree import parse_branching

    with pytest.raises(InputError) as err:
        parse_branching("4x-2")
    assert str(err.value) == ("tree config '4x-2': '-2' is not a positive integer; write the "
                              "branching per level separated by 'x', e.g. 4x2x2x1")


def test_mcss_never_accepts_a_candidate_the_target_forbids(monkeypatch):
    """u < r(x) / q(x) with r(x) = 0 rejects even at u = 0."""
    from adaspec.verify import multi_candidate as mc

    monkeypatch.setattr(mc.torch, "rand", lambda *shape, generator=None, dtype=None,
                        device=None: torch.zeros(shape, dtype=dtype))
    p = torch.tensor([[0.0, 1.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for replacement in (True, False):
        choice, token = mc.mcss_step(torch.tensor([[0]]), q, p, None, replacement=replacement)
        assert choice.tolist() == [-1] and token.tolist() == [1]


def test_a_prefix_ending_inside_a_character_is_not_kept_as_decoded():
    """Decoding reuses the text of a long enough prefix, but not one that ends in the middle
    of a multi-byte character (its text ends in U+FFFD until the next byte arrives)."""
    from adaspec.core.text import TextAssembler

    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    asm = TextAssembler(Bytes(), [])
    head = list(b"a" * (TextAssembler.STABLE_EVERY - 1)) + [0xC3]  # the first byte of "é"
    asm.push(head, final=False)
    assert asm.final_text([*head, 0xA9, 0x21]) == "a" * (TextAssembler.STABLE_EVERY - 1) + "é!"


class _Bytes:
    """UTF-8 bytes as token ids: a multi-byte character split over tokens decodes to U+FFFD
    until its last byte arrives."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text, stop, piece", [
    (b"abc", [], "abc"),  # nothing can still change: everything goes out
    (b"ab\xc3", [], "ab"),  # the first byte of a 2-byte character waits for the next
    (b"ab\xe2\x82", [], "ab"),  # two bytes of a 3-byte character: U+FFFD, held back
    (b"ab\xf0\x9f\x98", [], "ab"),  # three bytes of a 4-byte character
    (b"ab\xff\xff", [], "ab"),  # every trailing U+FFFD, not only the last
    (b"abX", ["XYZ"], "ab"),  # the first character of a stop string is held back
    (b"abXY", ["XYZ"], "ab"),  # ... and its first two
    (b"aXb", ["XYZ"], "aXb"),  # a stop string's start that did not continue goes out
])
def test_a_streamed_piece_holds_back_exactly_what_may_still_change(text, stop, piece):
    """Not final: the piece is all the text but a trailing partial character or a trailing
    prefix of a stop string, and the final push sends the rest."""
    from adaspec.core.text import TextAssembler

    asm = TextAssembler(_Bytes(), stop)
    assert asm.push(list(text), final=False) == (piece, False)
    full = text.decode("utf-8", errors="replace")
    assert asm.push(list(text), final=True) == (full[len(piece):], False)


class _CleanUp:
    """A tokenizer that rewrites spaces across tokens (" ." -> "."), as Hugging Face's
    clean_up_tokenization_spaces does: the text of a prefix is not a prefix of the text."""

    clean_up_tokenization_spaces = True

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids)).replace(" .", ".")


def test_a_tokenizer_that_rewrites_across_tokens_is_decoded_whole():
    from adaspec.core.text import TextAssembler

    asm = TextAssembler(_CleanUp(), [])
    head = ids("a" * TextAssembler.STABLE_EVERY + " ")
    asm.push(head, final=False)
    assert asm.final_text([*head, ord(".")]) == "a" * TextAssembler.STABLE_EVERY + "."


def test_decoded_text_follows_the_tokens_when_they_change():
    """A kept prefix is reused only while the tokens still start with it (tokens_through_stop
    decodes shorter lists after longer ones)."""
    from adaspec.core.text import TextAssembler

    n = TextAssembler.STABLE_EVERY + 4
    asm = TextAssembler(Chars(), [])
    asm.push(ids("a" * n), final=False)
    other = "b" + "a" * (n - 1)
    assert asm.final_text(ids(other)) == other
    assert asm.final_text(ids("a" * 3)) == "aaa"
    assert TextAssembler(None, []).push([1, 2], final=True) == ("", False)


def test_too_long_a_request_says_how_to_fit(toy):
    from adaspec.engine.loop import Engine

    engine = Engine(TorchBackend(toy), None, max_context=10)
    with pytest.raises(InputError) as err:
        engine.generate([1, 2, 3, 4], max_new_tokens=7)
    assert str(err.value) == ("context too long: prompt has 4 tokens + max_new_tokens 7 = 11 > "
                              "context window 10; shorten the prompt or lower max_new_tokens")


def test_token_tree_errors_and_mask_type():
    from adaspec.core.token_tree import TokenTree

    with pytest.raises(ValueError) as err:
        TokenTree([1, 2], [0, 0])
    assert str(err.value) == "a tree needs a root (parent -1) and one parent per token"
    tree = TokenTree([1, 2, 3], [-1, 0, 0])
    assert tree.ancestor_mask().dtype == torch.bool


def test_verifier_mismatch_messages_name_the_fix():
    from adaspec import verify
    from adaspec.core.proposal import Proposal
    from adaspec.core.token_tree import TokenTree

    with pytest.raises(InputError) as err:
        verify.choose("greedy", trees=False, greedy=False)
    assert str(err.value) == (
        "the greedy verifier only keeps the output exact at temperature 0; use "
        "verify=speculative or mcss or mcss-wor or mcns (or leave verify unset) for "
        "temperature > 0")
    tree = TokenTree([0, 1, 2], [-1, 0, 0])
    probs = torch.full((1, 3), 1 / 3)
    for name, drawn, wanted, flag in (("mcss", "without", "with", False),
                                      ("mcss-wor", "with", "without", True)):
        proposal = Proposal(tree, probs, replacement=flag)
        with pytest.raises(InputError) as err:
            verify.VERIFIERS[name]().check(proposal, torch.full((3, 3), 1 / 3))
        assert str(err.value) == (
            f"verifier {name!r} needs sibling candidates drawn {wanted} replacement; "
            f"this proposal's were drawn {drawn}")


def test_time_spent_routing_is_not_counted_as_prefill(toy, monkeypatch):
    """A router hands the engine its stats with route_time already spent: the prefill time
    is the prefill's own, and the wall time includes the routing. A fake clock (a
    millisecond a read): nothing here depends on how fast the machine is."""
    import adaspec.engine.loop as loop
    from adaspec.core.metrics import RequestStats
    from adaspec.engine.loop import Engine
    from adaspec.engine.steps import GenerationResult

    ticks = iter(range(10**6))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: 0.001 * next(ticks))
    engine = Engine(TorchBackend(toy), None, eos_token_ids=[])
    stats = RequestStats(prompt_tokens=3, route_time=5.0)
    out = list(engine.decode([1, 2, 3], 3, SamplingParams(), [], stats=stats))
    result = out[-1]
    assert isinstance(result, GenerationResult)
    assert 0 <= result.stats.prefill_time < 1.0
    assert result.stats.wall_time >= 5.0


def test_small_edges_of_the_decode_helpers(toy):
    """Edges the engine's own calls never reach, each with the documented result."""
    from adaspec.core.sampling import argmax
    from adaspec.core.token_tree import PricedBranching, TokenTree, parse_branching
    from adaspec.draft.model_tree import ModelTreeDrafter
    from adaspec.engine.loop import Engine
    from adaspec.verify import MCSSVerifier
    from adaspec.verify import multi_candidate as mc

    drafter = ModelTreeDrafter(TorchBackend(toy), (2, 2))
    drafter.begin(RequestState.of([1, 2, 3]))
    assert drafter.propose(RequestState.of([1, 2, 3], SamplingParams()),
                           0, StaticLength(1)).depth == 0

    class WithBos:
        chat_template = None
        eos_token_id = 0

        def encode(self, text, add_special_tokens=True):  # transformers' default: add BOS
            return ([63] if add_special_tokens else []) + [ord(c) % V for c in text]

    assert Engine(TorchBackend(toy), WithBos()).encode_prompt("ab") == [97 % V, 98 % V]
    grad = torch.tensor([0.1, 0.9, 0.3], requires_grad=True)
    assert int(argmax(grad)) == 1
    rows = torch.tensor([[0.1, 0.9], [0.8, 0.2]], requires_grad=True)
    assert argmax(rows).tolist() == [1, 0]  # per row, as on the numpy path
    assert parse_branching("priced", 1) == PricedBranching(1)
    with pytest.raises(InputError) as err:
        parse_branching("priced", 0)
    assert str(err.value) == "tree=priced needs max_nodes >= 1, got 0"
    with pytest.raises(ValueError):
        TokenTree.root(5).add_level([0, 0], [1])  # one parent per token
    p = torch.full((1, 4), 0.25)
    with pytest.raises(InputError) as err:
        mc.mcss_step(torch.tensor([[1]]), torch.full((2, 4), 0.25), p, None)
    assert str(err.value) == "q must be [B, V] like p, got [2, 4]"
    with pytest.raises(InputError, match=r"candidate token ids must be in \[0, 4\)"):
        mc.mcss_step(torch.tensor([[4]]), None, p, None)
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5, 6]])  # a 2x2 tree: the target wants token 9
    target = torch.zeros(1, 7, 10)
    target[..., 9] = 1.0
    path, accepted, nxt = MCSSVerifier().walk_regular((2, 2), tokens, None, target, None)
    assert path.tolist() == [[-1, -1]] and accepted.tolist() == [0] and nxt.tolist() == [9]


def test_drafted_by_reaches_the_request_stats(target, target_model):
    """A drafter's per-part counts (S2D: tokens per exit) go through Proposal.chain into the
    request's stats, summed over steps."""
    from adaspec.control.static import StaticLength as Static
    from adaspec.core.proposal import Proposal
    from adaspec.draft.base import Drafter
    from adaspec.engine.loop import Engine

    class Labelled(Drafter):
        def propose(self, req, max_tokens, controller):
            tokens = [req.context[-1]] * max_tokens
            return Proposal.chain(req.context[-1], tokens, drafted_by={"part a": 1,
                                                                   "part b": max_tokens - 1})

    engine = Engine(target, None, drafter=Labelled(), controller=Static(3),
                    eos_token_ids=[])
    out = engine.generate([1, 2, 3], max_new_tokens=10)
    steps = len(out.stats.steps)
    assert steps >= 1
    assert set(out.stats.drafted_by) == {"part a", "part b"}
    assert out.stats.drafted_by["part a"] == steps  # one per step: summed, not replaced
    assert sum(out.stats.drafted_by.values()) == out.stats.drafted


def test_sampled_chain_hands_the_verifier_the_draft_distributions(toy):
    """At temperature > 0 a model drafter's proposal carries q: one processed distribution
    per drafted token, the one it was drawn from (without it the verifier would treat the
    tokens as certain and accept them with min(1, p), a wrong law)."""
    from adaspec.core.sampling import process_logits

    backend = TorchBackend(toy)
    drafter = ModelDrafter(backend)
    context = [3, 9, 4, 7, 1]
    drafter.begin(RequestState.of(context))
    params = SamplingParams(0.9, top_k=20)
    gen = torch.Generator().manual_seed(0)
    proposal = drafter.propose(RequestState.of(context, params, gen), 3, StaticLength(3))
    assert proposal.depth == 3 and proposal.probs is not None
    assert proposal.probs.shape == (3, toy.config.vocab_size)
    fresh = TorchBackend(toy)
    for i in range(3):
        prefix = context + proposal.tokens[:i]
        logits = fresh.prefill(torch.tensor(prefix)).logits[-1]
        torch.testing.assert_close(proposal.probs[i], process_logits(logits, params),
                                   rtol=0, atol=1e-5)
        assert proposal.probs[i][proposal.tokens[i]] > 0
    # the tokens come from the request's generator: the same seed, the same draft, whatever
    # the global random state
    drafts = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        again = ModelDrafter(TorchBackend(toy))
        again.begin(RequestState.of(context))
        req = RequestState.of(context, params, torch.Generator().manual_seed(0))
        drafts.append(again.propose(req, 3, StaticLength(3)).tokens)
    assert drafts[0] == drafts[1] == proposal.tokens


def test_a_two_token_prompt_drafts_from_both_tokens(toy):
    """After a 2-token prompt the draft cache holds one token; the first draft step must feed
    after it, not restart the cache (which would drop the first token)."""
    drafter = ModelDrafter(TorchBackend(toy))
    context = [11, 5]
    drafter.begin(RequestState.of(context))
    assert drafter.backend.cache_len == 1
    proposal = drafter.propose(RequestState.of(context, SamplingParams(0.0)), 3, StaticLength(3))
    expected: list[int] = []
    for _ in range(3):
        expected.append(greedy_next(toy, context + expected))
    assert proposal.tokens == expected
    assert_cache_is_prefill(drafter.backend, toy, context + expected[:-1])


def test_ngram_lookup_follows_the_context_it_is_given():
    """The n-gram index follows the context: extended when the context grows, rebuilt when it
    diverges (a rejected draft, another request); no match and no room give ([], 0)."""
    from adaspec.draft.ngram import NgramDrafter

    d = NgramDrafter(n_max=2, n_min=1)
    d.begin(RequestState.of([1, 2, 3, 1]))
    assert d.lookup_with_match([1, 2, 3, 1], 2) == ([2, 3], 1)
    assert d.lookup_with_match([1, 2, 3, 1], 0) == ([], 0)  # no room: nothing, no match
    assert d.lookup_with_match([1, 2, 3, 1, 2], 3) == ([3, 1, 2], 2)  # grown: 2-gram 1 2
    # diverged at the third token: the old continuation (3) must be forgotten
    assert d.lookup_with_match([1, 2, 7, 1, 2], 2) == ([7, 1], 2)
    # a context with no repeat: no match, length 0
    assert d.lookup_with_match([4, 5, 6], 2) == ([], 0)
    # the same context again (not longer): still the same answer, nothing re-indexed wrongly
    assert d.lookup_with_match([4, 5, 6], 2) == ([], 0)
    assert d.lookup_with_match([4, 5, 6, 4], 2) == ([5, 6], 1)
    # the default longest n-gram is 3: the latest 3-gram match wins over an older 4-gram one
    context = [9, 1, 2, 3, 5, 8, 1, 2, 3, 6, 9, 1, 2, 3]
    assert NgramDrafter().lookup(context, 1) == [6]
    assert NgramDrafter(n_max=4).lookup(context, 1) == [5]


@pytest.mark.parametrize("n_min, n_max", [(1.5, 3), (1, 2.5), (0, 2), (3, 2)])
def test_ngram_sizes_are_checked(n_min, n_max):
    from adaspec.draft.ngram import NgramDrafter

    with pytest.raises(InputError, match="n_min"):
        NgramDrafter(n_max=n_max, n_min=n_min)


def test_candidate_shapes_are_named_in_the_error():
    from adaspec.verify import multi_candidate as mc

    with pytest.raises(InputError) as err:
        mc.mcss_step(torch.tensor([1, 2]), None, torch.full((1, 4), 0.25), None)
    assert str(err.value) == "need candidates [B, k] and p [B, V], got [2] and [1, 4]"


def test_a_tree_proposal_left_uncommitted_is_dropped_by_the_next(toy):
    """A proposal never committed (the engine stopped between draft and verify) leaves tree
    nodes in the draft cache; the next proposal, on the same context or a longer one, drops
    them and drafts what a fresh drafter drafts."""
    from adaspec.draft.model_tree import ModelTreeDrafter

    def proposal(drafter, context):
        return drafter.propose(RequestState.of(context, SamplingParams()), 2, StaticLength(2)).tree

    context = [5, 9, 11, 3, 8]
    for later in (context, context + [17, 2], context[:3] + [40]):  # same, longer, diverging
        drafter = ModelTreeDrafter(TorchBackend(toy), (2, 2))
        drafter.begin(RequestState.of(context))
        proposal(drafter, context)
        got = proposal(drafter, later)
        fresh = ModelTreeDrafter(TorchBackend(toy), (2, 2))
        fresh.begin(RequestState.of(context))
        want = proposal(fresh, later)
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
        drafter.commit(RequestState.of(later), [])
        assert_cache_is_prefill(drafter.backend, toy, later)
    # a one-level proposal feeds no nodes: after the dropped tree, its commit must still know
    # that nothing was fed
    drafter = ModelTreeDrafter(TorchBackend(toy), (2, 2))
    drafter.begin(RequestState.of(context))
    proposal(drafter, context)
    tree = drafter.propose(RequestState.of(context, SamplingParams()), 1, StaticLength(1)).tree
    accepted = context + [tree.tokens[1]]
    drafter.commit(RequestState.of(accepted), [1])
    assert drafter._cached == accepted[: len(drafter._cached)]
    assert_cache_is_prefill(drafter.backend, toy, drafter._cached)


class _ChatTokenizer:
    """A chat template that writes each turn's role: user turns start with token 50."""

    chat_template = "role-tagged"
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % V for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(65 + t % 26) for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        ids = []
        for m in messages:
            ids += [{"user": 50, "assistant": 51, "system": 52}[m["role"]]]
            ids += self.encode(m["content"])
        return ids + ([53] if add_generation_prompt else [])


def test_a_text_prompt_is_one_user_turn_unless_chat_is_off(toy):
    from adaspec.engine.loop import Engine

    engine = Engine(TorchBackend(toy), _ChatTokenizer(), eos_token_ids=[])
    plain = [ord(c) % V for c in "ab"]
    assert engine.encode_prompt("ab") == [50, *plain, 53]
    assert engine.encode_prompt("ab", chat=False) == plain
    assert engine.generate("ab", 2).stats.prompt_tokens == 4
    assert engine.generate("ab", 2, chat=False).stats.prompt_tokens == 2


def test_prefill_time_keeps_what_a_router_prefill_already_spent(toy):
    """A router that prefilled the prompt hands its prefill and stats over: the request's
    prefill time is the router's share plus the engine's first verification."""
    from adaspec.core.metrics import RequestStats
    from adaspec.engine.loop import Engine

    backend = TorchBackend(toy)
    engine = Engine(backend, None, eos_token_ids=[])
    prefill = backend.prefill(torch.tensor([1, 2, 3]))
    stats = RequestStats(prompt_tokens=3, prefill_time=4.0, target_calls=1)
    result = list(engine.decode([1, 2, 3], 2, SamplingParams(), [], prefill, stats))[-1]
    assert 4.0 <= result.stats.prefill_time < 5.0
    assert result.stats.target_calls == 1 + 2  # the router's pass, then one per token


def test_the_recorder_sees_every_verification_with_the_targets_logits(toy):
    """What online distillation learns from: each step's root, depth, path and the target's
    logits over the drafted tokens."""
    from adaspec.engine.loop import Engine

    class Recorder:
        def __init__(self):
            self.prompts, self.steps = [], []

        def begin(self, prompt_ids):
            self.prompts.append(list(prompt_ids))

        def step(self, root, depth, path, logits, features=None):
            self.steps.append((root, depth, list(path), logits.shape))

    backend = TorchBackend(toy)
    engine = Engine(backend, None, drafter=ModelDrafter(TorchBackend(toy)),
                    controller=StaticLength(3), eos_token_ids=[])
    recorder = Recorder()
    result = engine.generate([1, 2, 3], 9, recorder=recorder)
    assert recorder.prompts == [[1, 2, 3]]
    steps = recorder.steps
    assert len(steps) == result.stats.target_calls - 1 and steps[0][0] == 3
    # the same model drafts: every draft is accepted, each pass scores root + 3 drafts
    assert all(depth == 3 and path == [1, 2, 3] and shape == (4, V)
               for _, depth, path, shape in steps[:-1])


def test_the_last_streamed_piece_flushes_text_held_back_for_a_stop_string(toy):
    """Text that could start a stop string is held back while decoding goes on; when the
    request ends without the stop string, the last chunk sends it."""
    from adaspec.engine.loop import Engine
    from adaspec.engine.steps import GenerationResult, StreamChunk

    engine = Engine(TorchBackend(toy), _ChatTokenizer(), eos_token_ids=[])
    tokens = engine.generate([1, 2, 3], 6, chat=False).token_ids
    last = _ChatTokenizer().decode(tokens[-1:])
    pieces, result = [], None
    for item in engine.stream([1, 2, 3], 6, stop=[last + "@@"]):
        if isinstance(item, StreamChunk):
            pieces.append(item.text)
        elif isinstance(item, GenerationResult):
            result = item
    assert result is not None and result.text.endswith(last)
    assert "".join(pieces) == result.text


def test_without_replacement_renormalises_the_draft_for_the_next_sibling():
    """MCSS without replacement: after candidate 1 (token 2) is rejected, candidate 2 (token 1)
    is judged against q with token 2 removed and renormalised ([1/3, 2/3, 0]) and the residual
    r = norm(max(p - q, 0)) = [0.6, 0.4, 0]: accepted with probability min(1, 0.4 / (2/3)) =
    0.6 (judging it as a given token, r(x) = 0.4, is also exact but accepts less)."""
    from adaspec.verify import multi_candidate as mc

    n = 20000
    p = torch.tensor([[0.4, 0.4, 0.2]], dtype=torch.float64).repeat(n, 1)
    q = torch.tensor([[0.1, 0.2, 0.7]], dtype=torch.float64).repeat(n, 1)
    cands = torch.tensor([[2, 1]]).repeat(n, 1)
    choice, token = mc.mcss_step(cands, q, p, torch.Generator().manual_seed(0),
                                 replacement=False)
    first, second = (choice == 0).double().mean(), (choice == 1).double().mean()
    want_first, want_second = 0.2 / 0.7, (1 - 0.2 / 0.7) * 0.6
    sd = (want_second * (1 - want_second) / n) ** 0.5
    assert abs(float(first) - want_first) < 5 * sd and abs(float(second) - want_second) < 5 * sd
    # by default candidates count as drawn with replacement: q stays as it is, so candidate 2
    # is accepted with probability min(1, 0.4 / 0.2) = 1 once candidate 1 is rejected
    choice, _ = mc.mcss_step(cands, q, p, torch.Generator().manual_seed(0))
    assert abs(float((choice == 1).double().mean()) - (1 - 0.2 / 0.7)) < 5 * sd


def test_a_sampled_tree_draws_siblings_without_replacement_by_default(toy):
    from adaspec.draft.model_tree import ModelTreeDrafter

    drafter = ModelTreeDrafter(TorchBackend(toy), (2, 2))
    drafter.begin(RequestState.of([5, 9, 11]))
    req = RequestState.of([5, 9, 11], SamplingParams(1.0), torch.Generator().manual_seed(0))
    proposal = drafter.propose(req, 2, StaticLength(2))
    assert proposal.replacement is False
    for kids in proposal.tree.children:
        tokens = [proposal.tree.tokens[c] for c in kids]
        assert len(tokens) == len(set(tokens))


def test_the_engine_context_is_the_smallest_of_target_draft_and_asked(toy):
    from adaspec.engine.loop import Engine

    draft = TorchBackend(toy)
    draft.max_context = 40
    engine = Engine(TorchBackend(toy), None, drafter=ModelDrafter(draft), eos_token_ids=[])
    assert engine.max_context == 40
    assert Engine(TorchBackend(toy), None, drafter=ModelDrafter(draft), eos_token_ids=[],
                  max_context=30).max_context == 30


def test_a_missing_draft_row_for_a_node_with_children_is_named():
    from adaspec.core.proposal import Proposal
    from adaspec.core.token_tree import TokenTree
    from adaspec.verify import MCSSVerifier

    tree = TokenTree([0, 1, 2, 3], [-1, 0, 1, 2])  # a chain of 3: nodes 0-2 have children
    proposal = Proposal(tree, torch.full((2, 4), 0.25))
    with pytest.raises(InputError) as err:
        MCSSVerifier().verify(proposal, torch.full((4, 4), 0.25), None)
    assert str(err.value) == "draft probs have no row for node 2, which has children"


def test_decoding_times_add_up_over_steps(toy, monkeypatch):
    """On a clock that ticks once per reading: verification time sums every step's, and the
    wall time is the span from the request's start."""
    import adaspec.engine.loop as loop

    ticks = iter(range(1000, 10**6))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(ticks)))
    engine = loop.Engine(TorchBackend(toy), None, drafter=ModelDrafter(TorchBackend(toy)),
                         controller=StaticLength(2), eos_token_ids=[])
    stats = engine.generate([1, 2, 3], 9).stats
    steps = stats.target_calls - 1
    assert steps >= 3 and stats.verify_time >= steps
    assert stats.verify_time < stats.wall_time < 1000


def test_generation_defaults_to_128_new_tokens(toy):
    from adaspec.engine.loop import Engine
    from adaspec.engine.steps import StreamChunk

    engine = Engine(TorchBackend(toy), None, eos_token_ids=[])
    assert len(engine.generate([1, 2, 3]).token_ids) == 128
    streamed = [t for item in engine.stream([1, 2, 3]) if isinstance(item, StreamChunk)
                for t in item.token_ids]
    assert len(streamed) == 128


def test_drafts_stop_at_the_end_of_the_context(toy):
    """A context window exactly as long as prompt + max_new_tokens: the same model drafting
    (everything accepted), k = 4: steps draft 4 then 3 (the room left), 7 in all."""
    from adaspec.engine.loop import Engine

    engine = Engine(TorchBackend(toy), None, drafter=ModelDrafter(TorchBackend(toy)),
                    controller=StaticLength(4), eos_token_ids=[], max_context=13)
    stats = engine.generate([1, 2, 3], 10).stats
    assert stats.steps == [(4, 4), (3, 3)] and stats.drafted == 7


def test_a_drafter_that_proposes_more_than_asked_is_named(toy):
    from adaspec.engine.loop import Engine

    class Greedy(ModelDrafter):
        name = "greedy-too-long"

        def propose(self, req, max_tokens, controller):
            return super().propose(req, max_tokens + 1, controller)

    engine = Engine(TorchBackend(toy), None, drafter=Greedy(TorchBackend(toy)),
                    controller=StaticLength(2), eos_token_ids=[])
    with pytest.raises(RuntimeError) as err:
        engine.generate([1, 2, 3], 6)
    assert str(err.value) == "drafter 'greedy-too-long' proposed 3 levels, more than the 2 asked"
