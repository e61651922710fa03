"""The draft head's token trees (issue 66, part 2): the head's chain with its next candidates
beside each drafted token, verified in one target pass. Greedy output is plain decoding's and
the siblings catch tokens the chain misses; sampling follows the target's law (MCSS, with
and without replacement); a tree the target's cache cannot hold this step becomes a chain."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.static import StaticLength
from adaspec.core.sampling import SamplingParams
from adaspec.draft.head_tree import HeadTreeDrafter, fit_widths
from adaspec.engine.loop import Engine
from adaspec.errors import InputError

from .conftest import runtime_backend, sampling_backend, tiny_model
from .test_head import _head, _trained_head_drafter


def test_a_tree_is_cut_to_what_the_target_holds_this_step():
    assert fit_widths((3, 2), None) == (3, 2)
    assert fit_widths((3, 2), 6) == (3, 2)  # 5 nodes and the root
    assert fit_widths((3, 2), 5) == (3,)
    assert fit_widths((3, 2), 3) == (1, 1)  # not even the first level: a chain
    assert fit_widths((3, 2), 1) == ()


def _steps_through_siblings(engine, prompts) -> tuple[int, int]:
    """(steps whose accepted path ran through a candidate other than the first, accepted
    tokens) over greedy runs of `prompts`, with each step's verdict read off the engine."""
    through = accepted = 0
    original = engine._verify

    def spy(proposal, out, *args, **kwargs):
        nonlocal through
        verdict = original(proposal, out, *args, **kwargs)
        node = 0
        for child in verdict.path:
            if proposal.tree.children[node][0] != child:
                through += 1
                break
            node = child
        return verdict

    engine._verify = spy
    for prompt in prompts:
        accepted += engine.generate(prompt, max_new_tokens=20).stats.accepted
    return through, accepted


@pytest.mark.parametrize("runtime", ["torch", "static"])
def test_greedy_head_trees_decode_what_plain_decoding_does_and_siblings_get_accepted(runtime):
    model = tiny_model(vocab=40, hidden=32, seed=3)
    head = _trained_head_drafter(model)
    plain = Engine(runtime_backend(runtime, model, "plain"), None, eos_token_ids=[])
    prompts = ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8], [30], [12, 13, 14])
    chain = Engine(runtime_backend(runtime, model, "chain"), None, drafter=head,
                   controller=StaticLength(2), eos_token_ids=[])
    tree = Engine(runtime_backend(runtime, model, "tree"), None,
                  drafter=HeadTreeDrafter(_trained_head_drafter(model), (3, 2)),
                  controller=StaticLength(2), eos_token_ids=[])
    for prompt in prompts:
        want = plain.generate(prompt, max_new_tokens=20).token_ids
        assert chain.generate(prompt, max_new_tokens=20).token_ids == want
        assert tree.generate(prompt, max_new_tokens=20).token_ids == want
    through, accepted = _steps_through_siblings(tree, prompts)
    _, chain_accepted = _steps_through_siblings(chain, prompts)
    # the siblings are what a tree adds: paths through them, more tokens a step
    assert through > 0 and accepted > chain_accepted


@pytest.mark.parametrize("verify", ["mcss-wor", "mcss", "broken"])
def test_sampled_head_trees_follow_the_target_law(verify):
    """Candidates drawn from the head's q (without replacement for MCSS-wor, i.i.d. for
    MCSS): the emitted tokens follow plain decoding's law (chi-square on the first three,
    `test_engine_sampling`). Negative control: candidates that are the head's top tokens
    while the verifier is told they were drawn must fail."""
    from .stats_helpers import assert_caught, assert_exact
    from .test_engine_sampling import check, first_tokens

    model = tiny_model(vocab=8, seed=5, sharpen=6.0)
    base = _trained_head_drafter(model, vocab_kept=None)
    drafter = (TopTokensClaimedDrawn if verify == "broken" else HeadTreeDrafter)(base, (2, 2))
    engine = Engine(sampling_backend(model), None, drafter=drafter, controller=StaticLength(2),
                    verify="mcss-wor" if verify == "broken" else verify, eos_token_ids=[])
    params = SamplingParams(1.0, top_k=6)
    cells, acceptance = first_tokens(engine, params, 5)
    fits = check(cells, model, params)
    if verify == "broken":
        assert_caught(fits, "top tokens verified as draws")
        return
    assert 0.05 < acceptance < 0.98
    assert_exact(fits, f"head tree, {verify}")


class TopTokensClaimedDrawn(HeadTreeDrafter):
    """Above temperature 0, the head's top tokens as the candidates (what greedy takes),
    with q as if they had been drawn from it: biased, so the law must break."""

    def _candidates(self, small, width, req):
        _, _, row = super()._candidates(small, width, req)
        top = torch.topk(small, min(width, small.shape[-1])).indices
        picks = self.head.tokens.token_ids[top].tolist()
        return picks, row[picks].tolist(), row


def test_a_target_that_holds_no_tree_this_step_gets_the_chain():
    """`RequestState.tree_nodes` (the target's room this step): the drafter's tree becomes a
    chain of the levels that fit, and the output stays plain decoding's."""
    model = tiny_model(vocab=40, hidden=32, seed=3)
    drafter = HeadTreeDrafter(_trained_head_drafter(model), (3, 2))

    class OneRowShort(TorchBackend):
        def tree_room(self, root: int) -> int | None:
            return 3  # root + 2: no level of 3 candidates

    target = OneRowShort(model, name="short")
    seen = []
    original = target.forward

    def forward(tokens, positions=None, tree_mask=None, hidden_layer=None):
        seen.append(len(tokens.reshape(-1)))
        return original(tokens, positions, tree_mask, hidden_layer)

    target.forward = forward
    engine = Engine(target, None, drafter=drafter, controller=StaticLength(2),
                    eos_token_ids=[])
    plain = Engine(runtime_backend("torch", model, "plain"), None, eos_token_ids=[])
    prompt = [5, 9, 11, 3]
    assert engine.generate(prompt, max_new_tokens=12).token_ids == \
        plain.generate(prompt, max_new_tokens=12).token_ids
    assert seen and max(seen) <= 3


def test_head_tree_settings_are_checked():
    from adaspec.methods.head import HeadParams

    assert HeadParams(tree="3x2").widths() == (3, 2)
    assert HeadParams().widths() == () and HeadParams(tree="priced").widths() == ()
    with pytest.raises(InputError, match="profile prices tree=priced only"):
        HeadParams(tree="2", profile="flat")
    for bad in ("3x", "0x2", "17", "a"):
        with pytest.raises(InputError, match="tree="):
            HeadParams(tree=bad)
    with pytest.raises(ValueError):
        HeadTreeDrafter(_head_drafter(), ())


def _head_drafter():
    from adaspec.draft.head import HeadDrafter
    from adaspec.lab.head import train as head_train

    model = tiny_model(vocab=40, hidden=32)
    frozen = head_train.frozen_parts(model, torch.arange(40))
    return HeadDrafter(_head(model), frozen.token_head, frozen.embed)


def test_the_priced_plan_keeps_what_pays_under_the_profile():
    """tree=priced: where rows are nearly free (a GPU's profile) the step keeps every
    candidate worth anything; where each row costs a whole step, none; in between, the
    likely chain before the unlikely siblings; a level only below its parent level's
    first candidate, and each level's candidates a prefix of its order."""
    from adaspec.cost.profile import CostProfile
    from adaspec.draft.head_tree import plan

    levels = [[0.6, 0.3, 0.05], [0.8, 0.1], [0.5, 0.2]]
    free = CostProfile.from_formula("linear:target_ms=10,per_token_ms=0.01")
    assert plan(levels, free, 16) == [3, 2, 2]
    assert plan(levels, free, 4) == [2, 1, 1]  # 0.6, 0.48, 0.3 (sibling), 0.24
    dear = CostProfile.from_formula("linear:target_ms=10,per_token_ms=10")
    assert plan(levels, dear, 16) == [0, 0, 0]
    cpu = CostProfile.from_formula("linear:target_ms=25,per_token_ms=5")
    kept = plan(levels, cpu, 16)
    assert kept[0] >= 1 and sum(kept) < 7
    assert plan([[0.9, 0.05], [0.0]], free, 16) == [2, 0]  # a worthless node is left out


def test_a_priced_head_tree_decodes_what_plain_decoding_does():
    from adaspec.cost.profile import CostProfile
    from adaspec.draft.head_tree import PricedHeadTree

    model = tiny_model(vocab=40, hidden=32, seed=3)
    plain = Engine(runtime_backend("torch", model, "plain"), None, eos_token_ids=[])
    free = CostProfile.from_formula("linear:target_ms=10,per_token_ms=0.1")
    drafter = PricedHeadTree(_trained_head_drafter(model), free)
    engine = Engine(runtime_backend("torch", model, "tree"), None, drafter=drafter,
                    controller=StaticLength(3), eos_token_ids=[])
    for prompt in ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8]):
        assert engine.generate(prompt, max_new_tokens=16).token_ids == \
            plain.generate(prompt, max_new_tokens=16).token_ids
    assert max(drafter.kept) > 3  # wide trees where rows are cheap


def test_the_priced_tree_learns_how_far_the_heads_probabilities_hold():
    """A head trained on another target is confident and wrong: tree=priced measures its
    kept nodes' hits against its probabilities per depth and keeps fewer nodes as the
    evidence comes in; the head trained on this target keeps its probabilities' worth. The
    output is plain decoding's either way."""
    from adaspec.cost.profile import CostProfile
    from adaspec.draft.head_tree import PricedHeadTree

    model = tiny_model(vocab=40, hidden=32, seed=3)
    cpu = CostProfile.from_formula("linear:target_ms=25,per_token_ms=3")
    plain = Engine(runtime_backend("torch", model, "plain"), None, eos_token_ids=[])
    prompts = [[5, 9, 11, 3], [7, 7, 20, 31, 2, 8], [30, 1], [12, 13, 14], [3, 3, 9]] * 2
    scales = {}
    for name, trained_on in (("own", model), ("other", tiny_model(vocab=40, hidden=32,
                                                                 seed=11))):
        drafter = PricedHeadTree(_trained_head_drafter(trained_on), cpu)
        engine = Engine(runtime_backend("torch", model, name), None, drafter=drafter,
                        controller=StaticLength(3), eos_token_ids=[])
        for prompt in prompts:
            assert engine.generate(prompt, max_new_tokens=12).token_ids == \
                plain.generate(prompt, max_new_tokens=12).token_ids
        scales[name] = drafter._scale(0)
        if name == "other":
            steps = len(drafter.kept)
            assert sum(drafter.kept[-steps // 3:]) < sum(drafter.kept[: steps // 3])
    assert scales["other"] < 0.6 < scales["own"]


def test_auto_drafts_the_heads_trees_where_rows_are_nearly_free(tmp_path):
    """`auto:tree=priced`: where verified rows cost almost nothing (a GPU's profile) a greedy
    step drafting from the head proposes its next candidates beside the chain, paths run
    through them, and the output is plain decoding's; the same method where every row
    costs a whole pass proposes no tree, and without tree= auto drafts chains only (the
    control)."""
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    from .test_auto import flat_profile, steep_profile

    model = tiny_model(vocab=40, hidden=32, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    plain = Engine(runtime_backend("torch", model, "plain"), None, eos_token_ids=[])
    prompts = ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8], [30], [12, 13, 14])

    def run(tree: str, profile) -> tuple[int, int, int]:
        engine = build_generator(f"auto:use=head,head={path},head_ms=1,k_max=4{tree}",
                                 runtime_backend("torch", model, "auto"), None,
                                 eos_token_ids=[], profile=profile)
        trees = 0
        propose = engine.drafter.propose

        def spy(req, k, controller):
            nonlocal trees
            proposal = propose(req, k, controller)
            trees += not proposal.is_chain
            return proposal

        engine.drafter.propose = spy
        for prompt in prompts:
            got = engine.generate(prompt, max_new_tokens=20)
            assert got.token_ids == plain.generate(prompt, max_new_tokens=20).token_ids
        through, accepted = _steps_through_siblings(engine, prompts)
        return trees, through, engine.drafter.choices.head

    trees, through, by_head = run(",tree=priced", flat_profile())
    assert by_head > 0 and trees > 0 and through > 0
    assert run(",tree=priced", steep_profile())[0] == 0  # rows dear: chains (or nothing)
    assert run("", flat_profile())[:2] == (0, 0)


def test_auto_tree_settings_are_checked():
    from adaspec.methods.auto import AutoParams

    with pytest.raises(InputError, match="tree must be priced"):
        AutoParams(tree="3x2")
    with pytest.raises(InputError, match="needs head in use="):
        AutoParams(use="ngram+history", tree="priced")


def test_auto_credits_the_heads_chain_by_the_path_through_its_tree():
    """A verdict whose path leaves the chain for a sibling kept the chain's tokens only up to
    there: that many head tokens were right, the next one wrong."""
    from adaspec.draft.auto import Choice

    tree = Choice("head", [11, 12, 13], nodes=[1, 4, 6], rows=7)
    assert tree.accepted([1, 4, 6]) == 3
    assert tree.accepted([1, 5]) == 1  # through the second level's sibling
    assert tree.accepted([2]) == 0
    assert tree.accepted([]) == 0
    assert Choice("head", [11, 12]).accepted([1, 2]) == 2  # a chain: its nodes in order


def test_auto_trees_decoded_together_answer_what_each_gets_alone(tmp_path):
    """Requests of `auto:tree=priced` in one batch (a server's rounds: each its own sequence
    of one cache) propose trees and each answers what plain decoding gives it."""
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.engine.batch import BatchDecoder
    from adaspec.methods.build import build_generator

    from .test_auto import flat_profile
    from .test_batch import run_together

    model = tiny_model(vocab=40, hidden=32, seed=3)
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(model).head, torch.arange(40), {})
    plain = Engine(runtime_backend("torch", model, "plain"), None, eos_token_ids=[])
    prompts = ([5, 9, 11, 3], [7, 7, 20, 31, 2, 8], [12, 13, 14])
    engines = [build_generator(f"auto:use=head,head={path},head_ms=1,k_max=4,tree=priced",
                               seq, None, eos_token_ids=[], profile=flat_profile())
               for seq in TorchBackend(model).sequences(len(prompts))]
    trees = 0
    for engine in engines:
        propose = engine.drafter.propose

        def spy(req, k, controller, propose=propose):
            nonlocal trees
            proposal = propose(req, k, controller)
            trees += not proposal.is_chain
            return proposal

        engine.drafter.propose = spy
    requests = {i: e.stream_steps(p, max_new_tokens=20)
                for i, (e, p) in enumerate(zip(engines, prompts, strict=True))}
    results, _ = run_together(BatchDecoder(cost=None), requests)
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == plain.generate(prompt, max_new_tokens=20).token_ids
    assert trees > 0
