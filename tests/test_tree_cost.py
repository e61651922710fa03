"""Tree shapes chosen by expected accepted tokens per unit of measured cost (`tree=priced`):
a chain where every verified token is dear, a wide tree where verification is nearly free;
the drafter learns the request's acceptance per candidate rank; greedy output stays exact."""

from __future__ import annotations

import copy

import pytest

from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.static import StaticLength
from adaspec.core.sampling import SamplingParams
from adaspec.core.token_tree import (
    CANDIDATE_SHAPES,
    PricedBranching,
    parse_branching,
    tree_node_count,
)
from adaspec.cost.profile import CostProfile, Curve
from adaspec.draft.model_tree import (
    DEFAULT_RANK_RATES,
    PricedTreeDrafter,
    choose_branching,
    expected_tokens,
    level_hit,
    tree_step_ms,
)
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.methods.spec import parse_method

from .cost_helpers import steep, stub_machine_profile
from .test_engine import PROMPTS, NegatedBackend, reference_greedy


@pytest.fixture(autouse=True)
def measured(monkeypatch, tmp_path):
    return stub_machine_profile(monkeypatch, tmp_path, flat)


def flat() -> CostProfile:
    """A GPU: 64 nodes verify in about the time of one token, drafting is cheap."""
    return CostProfile.from_formula("linear:target_ms=20,per_token_ms=0.05,draft_ms=1")


def is_chain(shape) -> bool:
    return all(b == 1 for b in shape)


# ----------------------------------------------------------------------- the chooser
def test_expected_tokens_and_cost_by_hand():
    assert level_hit([0.5], 2) == pytest.approx(0.75)
    assert level_hit([0.6, 0.35], 3) == pytest.approx(1 - 0.4 * 0.65 * 0.65)  # last rate on
    assert expected_tokens((2, 1), [0.5]) == pytest.approx(1 + 0.75 + 0.75 * 0.5)
    profile = CostProfile(
        target=Curve([1, 8], [0], [[10.0, 80.0]]),
        draft=Curve([1, 8], [0], [[2.0, 9.0]]),
        overhead_ms=1.0,
    )
    # 2x2x1: 2 + 4 + 4 = 10 nodes -> target(11); draft forwards of 1 (root), 2, 4 tokens
    assert tree_step_ms((2, 2, 1), profile) == pytest.approx(110 + 1 + 2 + 3 + 5)
    # a chain of 3 is what a chain step costs: 3 draft forwards + verifying 3
    assert tree_step_ms((1, 1, 1), profile) == pytest.approx(profile.step_ms(3, 3))


def test_chain_under_a_steep_curve_wide_tree_under_a_flat_one():
    dear = choose_branching(steep())
    cheap = choose_branching(flat())
    assert is_chain(dear)
    assert cheap[0] >= 4 and tree_node_count(cheap) > len(cheap)
    # the choice is the best of the candidates by expected tokens per ms
    for profile, best in ((steep(), dear), (flat(), cheap)):
        rate = expected_tokens(best, DEFAULT_RANK_RATES) / tree_step_ms(best, profile)
        for shape in CANDIDATE_SHAPES:
            if tree_node_count(shape) <= 64:
                other = expected_tokens(shape, DEFAULT_RANK_RATES) / tree_step_ms(shape, profile)
                assert other <= rate + 1e-12


def test_acceptance_moves_the_choice():
    """A draft that always agrees earns a long chain; one that rarely agrees a short one."""
    sure = choose_branching(steep(), [0.95])
    assert is_chain(sure) and len(sure) > len(choose_branching(steep())) == 1
    assert choose_branching(steep(), [0.2, 0.1]) == (1,)
    assert len(choose_branching(steep(), [0.95], max_depth=3)) == 3
    assert tree_node_count(choose_branching(flat(), max_nodes=10)) <= 10
    with pytest.raises(InputError, match="no candidate"):
        choose_branching(flat(), max_depth=0)


def test_method_string(target, tokenizer, draft):
    spec = parse_method("draft:tree=priced")
    assert isinstance(spec.tree, PricedBranching) and spec.tree.max_nodes == 64
    assert isinstance(parse_branching("PRICED", 10), PricedBranching)
    assert all(tree_node_count(c) <= 10 for c in parse_branching("priced", 10).candidates())
    ctrl = build_generator(spec, target, tokenizer, draft).controller
    assert isinstance(ctrl, StaticLength) and ctrl.max_tokens() == 8
    with pytest.raises(InputError, match="fixed shape"):
        parse_method("draft:tree=priced,ctrl=heuristic")
    with pytest.raises(InputError, match="verify=speculative checks chains"):
        parse_method("draft:tree=priced,verify=speculative")
    parse_method("draft:tree=priced,verify=mcss-wor,profile=flat")


# ------------------------------------------------------------------------ the engine
def test_greedy_equals_plain_decoding(target, draft, target_model):
    """Exact under either profile; where verification is nearly free it drafts wide trees,
    where it is dear small shapes (a chain, or two candidates when the draft is poor)."""
    shapes: dict[str, set] = {}
    for name, costs in (("flat", flat()), ("steep", steep())):
        engine = build_generator("draft:tree=priced", target, None, draft, eos_token_ids=[],
                              profile=costs)
        assert isinstance(engine.drafter, PricedTreeDrafter)
        shapes[name] = set()
        for prompt in PROMPTS:
            res = engine.generate(prompt, max_new_tokens=30)
            assert res.token_ids == reference_greedy(target_model, prompt, 30), (name, prompt)
            shapes[name] |= set(engine.drafter.shapes)
    widest = max(tree_node_count(s) for s in shapes["flat"])
    assert any(not is_chain(s) for s in shapes["flat"]) and widest >= 8
    assert max(tree_node_count(s) for s in shapes["steep"]) <= 2


def test_the_machines_profile_by_default(target, draft, measured):
    engine = build_generator("draft:tree=priced", target, None, draft, eos_token_ids=[])
    assert measured == [("tiny-target", "tiny-draft")] and engine.drafter.profile.simulated
    build_generator("draft:tree=4x2", target, None, draft, eos_token_ids=[])
    assert len(measured) == 1  # a fixed shape reads no costs


def test_the_methods_own_profile(target, draft, target_model):
    engine = build_generator("draft:tree=priced,profile=flat,max_nodes=20", target, None, draft,
                          eos_token_ids=[])
    assert engine.drafter.profile.simulated and engine.drafter.max_nodes == 20
    res = engine.generate(PROMPTS[1], max_new_tokens=20)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[1], 20)
    assert all(tree_node_count(s) <= 20 for s in engine.drafter.shapes)


def test_running_acceptance_per_rank(target_model):
    """The target as its own draft: rank 1 always matches, so its rate climbs and the chain
    grows; a draft that always disagrees drives it down to one-token chains."""
    twin = build_generator("draft:tree=priced", TorchBackend(target_model), None,
                        TorchBackend(copy.deepcopy(target_model)), eos_token_ids=[],
                        profile=steep())
    res = twin.generate(PROMPTS[0], max_new_tokens=40)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[0], 40)
    drafter = twin.drafter
    assert drafter.rates[0] > DEFAULT_RANK_RATES[0] + 0.2
    assert max(len(s) for s in drafter.shapes) > len(choose_branching(steep()))
    no = build_generator("draft:tree=priced", TorchBackend(target_model), None,
                      NegatedBackend(copy.deepcopy(target_model)), eos_token_ids=[],
                      profile=flat())
    res = no.generate(PROMPTS[0], max_new_tokens=30)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[0], 30)
    assert no.drafter.rates[0] < DEFAULT_RANK_RATES[0] - 0.2
    assert res.stats.acceptance_rate < 0.5


def test_sampled_trees_run(target, draft):
    engine = build_generator("draft:tree=priced", target, None, draft, eos_token_ids=[],
                          profile=flat())
    a = engine.generate(PROMPTS[2], 20, SamplingParams(temperature=0.8, seed=3)).token_ids
    b = engine.generate(PROMPTS[2], 20, SamplingParams(temperature=0.8, seed=3)).token_ids
    assert a == b and len(a) == 20  # seeded: reproducible


def test_needs_a_profile_with_a_draft(draft):
    with pytest.raises(InputError, match="measured the draft"):
        PricedTreeDrafter(draft, CostProfile(target=Curve([1], [0], [[10.0]])))
