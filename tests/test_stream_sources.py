"""Each streamed token says how the step produced it (the playground colours tokens by it):
a drafted token the target accepted, the target's correction after a rejection, its bonus
after a fully accepted draft, or a plain step."""

from __future__ import annotations

from adaspec.backends.torch.backend import TorchBackend
from adaspec.engine.steps import ACCEPTED, BONUS, CORRECTION, PLAIN, StreamChunk
from adaspec.methods.build import build_generator

from .test_engine import PROMPTS, NegatedBackend, reference_greedy


def streamed(engine, prompt, n):
    tokens, sources = [], []
    for item in engine.stream(prompt, max_new_tokens=n):
        if isinstance(item, StreamChunk):
            assert len(item.sources) == len(item.token_ids)
            tokens += item.token_ids
            sources += item.sources
    return tokens, sources


def test_a_draft_that_always_agrees_gives_accepted_runs_ending_in_a_bonus(target_model):
    engine = build_generator("draft:k=3", TorchBackend(target_model), None,
                          TorchBackend(target_model), eos_token_ids=[])
    tokens, sources = streamed(engine, PROMPTS[1], 13)
    assert tokens == reference_greedy(target_model, PROMPTS[1], 13)
    assert sources == [PLAIN] + [ACCEPTED, ACCEPTED, ACCEPTED, BONUS] * 3


def test_a_draft_that_always_disagrees_gives_corrections(target, target_model):
    engine = build_generator("draft:k=2", target, None, NegatedBackend(target_model),
                          eos_token_ids=[])
    tokens, sources = streamed(engine, PROMPTS[2], 6)
    assert tokens == reference_greedy(target_model, PROMPTS[2], 6)
    assert sources == [PLAIN] + [CORRECTION] * 4 + [PLAIN]  # the last token: no room to draft


def test_plain_decoding_is_plain(target, target_model):
    engine = build_generator("ar", target, None, None, eos_token_ids=[])
    tokens, sources = streamed(engine, PROMPTS[0], 5)
    assert sources == [PLAIN] * 5
