"""End-to-end engine behaviour on tiny fp32 models: exactness, stops, streaming, errors."""

from __future__ import annotations

import pytest
import torch

from adaspec.backends.base import ForwardOutput
from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import SamplingParams
from adaspec.engine.loop import Engine
from adaspec.engine.steps import GenerationResult, StreamChunk
from adaspec.errors import InputError
from adaspec.methods.build import build_generator


@pytest.fixture
def target(runtime_target):
    """Every test here runs on each torch runtime (tests/conftest.py)."""
    return runtime_target

PROMPTS = [[5, 9, 13, 2], [17, 3, 3, 3, 40, 41, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [33]]


def reference_greedy(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding without any cache: full recompute each token."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
    return out


class NegatedBackend(TorchBackend):
    """A draft whose greedy choice is the target's least likely token: it always disagrees."""

    def forward(self, tokens, positions=None, tree_mask=None, hidden_layer=None) -> ForwardOutput:
        out = super().forward(tokens, positions, tree_mask, hidden_layer)
        return ForwardOutput(logits=-out.logits, hidden=out.hidden)

    def prefill(self, tokens, hidden_layer=None, reuse=0) -> ForwardOutput:
        out = super().prefill(tokens, hidden_layer, reuse)
        return ForwardOutput(logits=-out.logits, hidden=out.hidden)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("method", ["draft", "ngram", "draft-ctrl-heuristic"])
def test_greedy_equals_plain_decoding(target, draft, target_model, method, k):
    spec = {
        "draft": f"draft:k={k}",
        "ngram": f"ngram:k={k}",
        "draft-ctrl-heuristic": f"draft:ctrl=heuristic,k={k}",
    }[method]
    engine = build_generator(spec, target, None, draft, eos_token_ids=[])
    for prompt in PROMPTS:
        res = engine.generate(prompt, max_new_tokens=40)
        assert res.token_ids == reference_greedy(target_model, prompt, 40), (spec, prompt)
        assert res.finish_reason == "length"


def test_plain_method_is_plain_decoding(target, target_model):
    engine = build_generator("ar", target, None, eos_token_ids=[])
    res = engine.generate(PROMPTS[1], max_new_tokens=30)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[1], 30)
    assert res.stats.target_calls == 30 and res.stats.drafted == 0
    assert res.stats.mean_accepted_tokens == pytest.approx(1.0)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_that_always_agrees(target_model, k):
    """The target as its own draft: everything is accepted, k + 1 tokens per target call."""
    engine = build_generator(
        f"draft:k={k}",
        TorchBackend(target_model),
        None,
        TorchBackend(target_model),
        eos_token_ids=[],
    )
    res = engine.generate(PROMPTS[0], max_new_tokens=1 + 5 * (k + 1))
    assert res.token_ids == reference_greedy(target_model, PROMPTS[0], 1 + 5 * (k + 1))
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.target_calls == 1 + 5  # the prefill, then k + 1 tokens per call


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_that_always_disagrees(target, target_model, k):
    engine = build_generator(
        f"draft:k={k}", target, None, NegatedBackend(target_model), eos_token_ids=[]
    )
    res = engine.generate(PROMPTS[2], max_new_tokens=25)
    assert res.token_ids == reference_greedy(target_model, PROMPTS[2], 25)
    assert res.stats.accepted == 0 and res.stats.drafted > 0


def test_stops_on_eos(target, draft, target_model):
    ref = reference_greedy(target_model, PROMPTS[0], 30)
    eos = ref[7]
    engine = build_generator("draft:k=4", target, None, draft, eos_token_ids=[eos])
    res = engine.generate(PROMPTS[0], max_new_tokens=30)
    assert res.finish_reason == "eos"
    assert res.token_ids == ref[: ref.index(eos) + 1]


def test_stop_strings_and_streaming(target, draft, tokenizer, target_model):
    engine = build_generator("draft:k=3", target, tokenizer, draft, eos_token_ids=[])
    prompt = "hello world"
    ids = tokenizer.encode(prompt)
    full_text = tokenizer.decode(reference_greedy(target_model, ids, 40))
    stop = full_text[12:14]
    chunks = list(engine.stream(prompt, max_new_tokens=40, stop=[stop], chat=False))
    result = chunks[-1]
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == "stop"
    assert result.text == full_text[: full_text.index(stop)]
    # token ids end with the token that completed the stop string
    ids_text = tokenizer.decode(result.token_ids)
    assert stop in ids_text and stop not in tokenizer.decode(result.token_ids[:-1])
    streamed = "".join(c.text for c in chunks if isinstance(c, StreamChunk))
    assert streamed == result.text
    assert stop not in streamed


def test_streamed_tokens_arrive_in_accepted_groups(target_model):
    engine = build_generator(
        "draft:k=3", TorchBackend(target_model), None, TorchBackend(target_model), eos_token_ids=[]
    )
    chunks = [c for c in engine.stream(PROMPTS[0], max_new_tokens=9) if isinstance(c, StreamChunk)]
    assert [len(c.token_ids) for c in chunks] == [1, 4, 4]


def test_seeded_sampling_is_reproducible(target, draft):
    engine = build_generator("draft:k=4", target, None, draft, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    a = engine.generate(PROMPTS[1], max_new_tokens=30, sampling=params).token_ids
    b = engine.generate(PROMPTS[1], max_new_tokens=30, sampling=params).token_ids
    c = engine.generate(
        PROMPTS[1], max_new_tokens=30, sampling=SamplingParams(1.0, seed=99)
    ).token_ids
    assert a == b
    assert a != c


def test_stats_are_consistent(target, draft):
    engine = build_generator("draft:k=4", target, None, draft, eos_token_ids=[])
    s = engine.generate(PROMPTS[1], max_new_tokens=30).stats
    assert s.new_tokens == 30
    assert s.accepted <= s.drafted
    assert sum(d for d, _ in s.steps) == s.drafted
    # every target call after the prefill emits its accepted drafts plus one token
    assert s.new_tokens <= s.accepted + s.target_calls
    assert s.draft_calls >= s.drafted
    assert s.wall_time >= s.draft_time + s.verify_time


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": [], "max_new_tokens": 4}, "prompt is empty"),
        ({"prompt": [1, 2, 9999]}, "outside the vocabulary"),
        ({"prompt": [1] * 250, "max_new_tokens": 10}, "context too long"),
        ({"prompt": [1, 2], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": [1, 2], "stop": [""]}, "stop strings"),
    ],
)
def test_input_errors(target, draft, tokenizer, kwargs, message):
    engine = build_generator("draft:k=2", target, tokenizer, draft)
    with pytest.raises(InputError, match=message):
        engine.generate(**kwargs)


def test_greedy_verifier_refused_when_sampling(target, draft):
    engine = build_generator("draft:k=2,verify=greedy", target, None, draft)
    with pytest.raises(InputError, match="greedy verifier"):
        engine.generate([1, 2], sampling=SamplingParams(temperature=0.7))


def test_engine_without_drafter_accepts_plain_engine_construction(target):
    res = Engine(target, None, eos_token_ids=[]).generate([3, 4], max_new_tokens=5)
    assert len(res.token_ids) == 5


PREFILL_PAUSE = 0.05


class SlowPrefillBackend(TorchBackend):
    """A draft whose prompt prefill takes 50 ms more on a fake clock (when one is set),
    recording what it was given."""

    prefilled: list[list[int]]
    clock: list[float] | None = None

    def prefill(self, tokens, hidden_layer=None, reuse=0) -> ForwardOutput:
        self.prefilled.append(tokens.tolist())
        if self.clock is not None:
            self.clock[0] += PREFILL_PAUSE
        return super().prefill(tokens, hidden_layer, reuse)


def slow_prefill_engine(method: str, target, draft_model) -> tuple[Engine, SlowPrefillBackend]:
    draft = SlowPrefillBackend(draft_model, name="draft")
    draft.prefilled = []
    return build_generator(method, target, None, draft, eos_token_ids=[]), draft


@pytest.mark.parametrize("method", ["draft:k=3", "draft:tree=2x1"])
def test_draft_prefill_is_timed_on_its_own(draft_model, target, target_model, method,
                                           monkeypatch):
    """On a fake clock (1 us per reading, plus the draft prefill's 50 ms): the prefill shows
    as draft_prefill_time, inside draft_time, and in no other part of the request."""
    import time

    clock = [0.0]

    def fake_perf_counter() -> float:
        clock[0] += 1e-6
        return clock[0]

    monkeypatch.setattr(time, "perf_counter", fake_perf_counter)
    engine, draft = slow_prefill_engine(method, target, draft_model)
    draft.clock = clock
    prompt = PROMPTS[2]
    out = engine.generate(prompt, max_new_tokens=12)
    assert out.token_ids == reference_greedy(target_model, prompt, 12)
    assert draft.prefilled == [prompt[:-1]]  # once, at the start, all but the last token
    s = out.stats
    assert PREFILL_PAUSE <= s.draft_prefill_time <= s.draft_time < s.wall_time
    assert s.draft_time - s.draft_prefill_time < PREFILL_PAUSE  # the pause counted once
    assert s.prefill_time < PREFILL_PAUSE and s.verify_time < PREFILL_PAUSE
    assert s.other_time < PREFILL_PAUSE
    assert s.draft_calls >= 1


@pytest.mark.parametrize("method", ["draft:k=3", "draft:tree=2x1"])
def test_draft_prefill_waits_for_a_step_that_drafts(draft_model, target, target_model, method):
    engine, draft = slow_prefill_engine(method, target, draft_model)
    prompt = PROMPTS[2]
    one = engine.generate(prompt, max_new_tokens=1)  # ends at the target's first token
    assert one.token_ids == reference_greedy(target_model, prompt, 1)
    assert draft.prefilled == [] and one.stats.draft_prefill_time == 0.0
    chunks = engine.stream(prompt, max_new_tokens=6)
    first = next(chunks)  # the first token comes before the draft's prompt prefill
    assert first.token_ids == reference_greedy(target_model, prompt, 1)
    assert draft.prefilled == []
    rest = list(chunks)
    assert draft.prefilled == [prompt[:-1]]
    assert rest[-1].token_ids == reference_greedy(target_model, prompt, 6)
