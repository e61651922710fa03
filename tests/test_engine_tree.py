"""The engine's tree step on tiny fp32 models: greedy tree decoding is plain greedy decoding,
both caches hold exactly the accepted context after every step, sampled trees are drawn the
way their verifier needs. That sampled trees emit the target's distribution end to end is
checked in tests/test_engine_sampling.py (with a broken verifier that must fail)."""

from __future__ import annotations

import pytest

from adaspec.backends.torch.backend import TorchBackend
from adaspec.control.static import StaticLength
from adaspec.core.sampling import SamplingParams
from adaspec.draft.model import ModelDrafter
from adaspec.draft.model_tree import ModelTreeDrafter
from adaspec.engine.loop import Engine
from adaspec.engine.steps import StreamChunk
from adaspec.errors import InputError
from adaspec.methods.build import build_generator
from adaspec.verify import (
    MCNSVerifier,
    MCSSVerifier,
    MCSSWithoutReplacementVerifier,
    SpeculativeVerifier,
)

from .test_engine import PROMPTS, NegatedBackend, reference_greedy
from .test_tree import cache_equals_prefill


@pytest.fixture
def target(runtime_target):
    """Every test here runs on each torch runtime (tests/conftest.py)."""
    return runtime_target


@pytest.mark.parametrize(
    "method",
    [
        "draft:tree=4x2x2x1",
        "draft:tree=2x2x2x1",
        "draft:tree=8x2x1",
        "draft:tree=16x1",
        "draft:tree=1x1x1x1",
        "draft:tree=3x3,verify=mcss",  # MCSS at T=0: deterministic candidates, one-hot p
        "draft:tree=2x2x2,verify=mcns",
    ],
)
def test_greedy_tree_decoding_equals_plain_decoding(target, draft, target_model, method):
    engine = build_generator(method, target, None, draft, eos_token_ids=[])
    for prompt in PROMPTS:
        res = engine.generate(prompt, max_new_tokens=30)
        assert res.token_ids == reference_greedy(target_model, prompt, 30), (method, prompt)


def test_tree_near_the_context_limit_is_cut_short(target, draft, target_model):
    prompt = [(7 * i) % 60 + 1 for i in range(244)]  # 244 + 12 = the 256-token window
    engine = build_generator("draft:tree=4x2x2x1", target, None, draft, eos_token_ids=[])
    res = engine.generate(prompt, max_new_tokens=12)
    assert res.token_ids == reference_greedy(target_model, prompt, 12)


def test_draft_that_always_agrees_fills_every_level(target_model):
    engine = build_generator(
        "draft:tree=3x2x1",
        TorchBackend(target_model),
        None,
        TorchBackend(target_model),
        eos_token_ids=[],
    )
    res = engine.generate(PROMPTS[0], max_new_tokens=1 + 5 * 4)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[0], 21)
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.target_calls == 1 + 5 and res.stats.draft_calls == 5 * 3
    assert res.stats.steps == [(3, 3)] * 5


def test_draft_that_always_disagrees(target, target_model):
    engine = build_generator(
        "draft:tree=4x2", target, None, NegatedBackend(target_model), eos_token_ids=[]
    )
    res = engine.generate(PROMPTS[2], max_new_tokens=20)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[2], 20)
    assert res.stats.accepted == 0 and res.stats.drafted > 0


@pytest.mark.parametrize(
    ("method", "sampling"),
    [
        ("draft:tree=3x2x2", SamplingParams()),
        ("draft:tree=3x2x2,verify=mcss", SamplingParams(1.0, seed=4)),
        ("draft:tree=4x2x1,verify=mcss-wor", SamplingParams(0.7, top_k=6, seed=5)),
    ],
)
def test_both_caches_hold_exactly_the_accepted_context(
    target, draft, target_model, draft_model, method, sampling
):
    """After every step the target cache is a fresh prefill of the context but its last
    token, and the draft cache a fresh prefill of a prefix that misses at most the accepted
    leaf and the new token."""
    engine = build_generator(method, target, None, draft, eos_token_ids=[])
    assert isinstance(engine.drafter, ModelTreeDrafter)
    prompt = PROMPTS[1]
    generated: list[int] = []
    paths = set()
    for chunk in engine.stream(prompt, max_new_tokens=30, sampling=sampling):
        if not isinstance(chunk, StreamChunk):
            break
        generated += chunk.token_ids
        context = prompt + generated
        cache_equals_prefill(target, target_model, context[:-1])
        if len(generated) > 1:  # after the first tree step
            cached = engine.drafter.cached_tokens
            assert cached == context[: len(cached)] and len(cached) >= len(context) - 2
            cache_equals_prefill(draft, draft_model, cached)
        paths.add(len(chunk.token_ids))
    assert len(generated) == 30
    assert max(paths) > 1  # some drafts were accepted


@pytest.mark.parametrize(
    "verifier", [MCSSVerifier(), MCSSWithoutReplacementVerifier(), MCNSVerifier()],
    ids=lambda v: v.name,
)
def test_tree_siblings_are_drawn_as_the_verifier_needs(target, draft, verifier):
    """Every sampled tree proposal says how its siblings were drawn, and that is the
    verifier's way (asserted here, not taken on trust from the engine's call)."""
    seen = []

    class Spy(type(verifier)):
        def verify(self, proposal, target_probs, generator):
            if not proposal.is_chain:
                seen.append(proposal.replacement)
            return super().verify(proposal, target_probs, generator)

    engine = Engine(target, None, drafter=ModelTreeDrafter(draft, (3, 2)),
                    controller=StaticLength(2), verify=Spy(), eos_token_ids=[])
    engine.generate(PROMPTS[0], max_new_tokens=12, sampling=SamplingParams(1.0, seed=3))
    assert seen and set(seen) == {verifier.replacement}


def test_seeded_tree_sampling_is_reproducible(target, draft):
    engine = build_generator("draft:tree=4x2x1", target, None, draft, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, seed=99)
    a = engine.generate(PROMPTS[3], max_new_tokens=25, sampling=params).token_ids
    b = engine.generate(PROMPTS[3], max_new_tokens=25, sampling=params).token_ids
    assert a == b


def test_verifier_and_drafter_must_match(target, draft):
    engine = build_generator("draft:tree=4x2,verify=greedy", target, None, draft)
    with pytest.raises(InputError, match="greedy verifier only keeps the output exact"):
        engine.generate([1, 2], sampling=SamplingParams(temperature=0.7))
    with pytest.raises(InputError, match="needs a draft model"):
        build_generator("draft:tree=4x2", target, None, None)
    tree_drafter = ModelTreeDrafter(draft, (2, 2))
    with pytest.raises(InputError, match="checks chains"):
        Engine(target, None, drafter=tree_drafter, verify=SpeculativeVerifier())
    tree = Engine(target, None, drafter=tree_drafter, eos_token_ids=[])
    tree.verify = "speculative"  # a name given later is checked per request too
    with pytest.raises(InputError, match="checks chains"):
        tree.generate([1, 2])


def test_tree_verifier_checks_chains_too(target, draft, target_model):
    """A chain is a tree with one child per node: a chain drafter may be verified by a tree
    rule (greedy decoding stays plain greedy decoding)."""
    for name in ["mcss", "mcss-wor", "mcns"]:
        engine = Engine(target, None, drafter=ModelDrafter(draft), controller=StaticLength(3),
                        verify=name, eos_token_ids=[])
        res = engine.generate(PROMPTS[0], max_new_tokens=20)
        assert res.token_ids == reference_greedy(target_model, PROMPTS[0], 20), name
        assert res.stats.drafted > 0
